"""tools/reference_models/build_corpus.py: the text converters, the held-out pick, and the committed corpus notes."""

from __future__ import annotations

import json
import re

from quality_helpers import HELDOUT, REPO
from tools.reference_models import build_corpus as bc



def test_html_keeps_visible_text_and_preformatted_layout():
    page = ("<html><head><title>T</title><style>p {}</style></head><body><nav>menu</nav>"
            "<h1>Title</h1><p>Some   <b>bold</b>\ntext.</p><pre>def f():\n    return 1</pre>"
            "<script>x()</script></body>")
    text = bc.tidy(bc.html_to_text(page))
    assert "menu" not in text and "x()" not in text and "p {}" not in text
    assert "Title" in text and "Some bold text." in text
    assert "def f():\n    return 1" in text  # code indentation survives


def test_pod_and_roff_markup_is_removed():
    pod = "=head1 NAME\n\nperlfoo - B<bold> and C<< code >> and L<perlsyn|perlsyn>\n\n=cut\n"
    assert bc.tidy(bc.pod_to_text(pod)) == "NAME\n\nperlfoo - bold and code and perlsyn"
    roff = '.\\" comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.PP\nmore\n'
    assert bc.tidy(bc.roff_to_text(roff)) == "LS 1\nNAME\nls - list directory contents\n\nmore"


def test_split_chunks_cuts_at_blank_lines_and_loses_nothing():
    paragraphs = [f"paragraph {i} " + "x" * 50 for i in range(40)]
    text = "\n\n".join(paragraphs)
    chunks = bc.split_chunks(text, 300)
    assert len(chunks) > 1 and "\n\n".join(chunks) == text
    assert all(chunk.startswith("paragraph") for chunk in chunks)


def test_tidy_normalizes_whitespace_and_control_characters():
    assert bc.tidy("a\r\nb\x00\tc  \n\n\n\nd\xa0e") == "a\nb    c\n\nd e"


def test_heldout_pick_is_deterministic_and_capped():
    long_text = "word " * 3000
    picks = [[bc.is_heldout("src", f"doc{i}", long_text, counts, 2) for i in range(200)] for counts in ({}, {})]
    assert picks[0] == picks[1] and sum(picks[0]) == 2
    assert not bc.is_heldout("src", "doc0", "short", {}, 2)


def test_committed_heldout_split_has_a_licence_note_for_every_source():
    sources_md = (REPO / "data/corpus/SOURCES.md").read_text()
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines()]
    assert len(rows) >= 20 and sum(len(r["text"]) for r in rows) < 600_000
    for source in {r["source"] for r in rows}:
        assert re.search(rf"^\| {re.escape(source)} \|", sources_md, re.M), source
        assert (REPO / f"data/corpus/licenses/{source}.txt").stat().st_size > 0
    assert {s.name for s in bc.SOURCES} == set(re.findall(r"^\| ([a-z0-9-]+) \| (?:deb|pypi):", sources_md, re.M))
