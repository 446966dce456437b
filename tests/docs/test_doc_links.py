"""Every relative link in README.md and docs/ resolves: the file or folder exists and, where the link names a
heading (`page.md#anchor`), the page has that heading. Links inside code (fenced blocks, inline spans) are text,
not links, and are skipped; so are links to other sites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The page without its code: fenced blocks and inline code spans."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped, spaces to hyphens, repeats -1, -2."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: ...


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif not resolved.is_relative_to(root):
            broken.append(f"{target}: outside the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.relative_to(root)} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: " + "; ".join(broken_links(page))


def test_the_checker_finds_links_and_flags_broken_ones(tmp_path):
    """The checker itself: a link to a missing file, a missing heading and a file outside the repository are broken;
    a link in code, an external link and good anchors are not."""
    assert "docs/format.md" in relative_links(ROOT / "README.md")  # it sees the real pages' links
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("# Out\n", encoding="utf-8")
    (repo / "docs" / "other.md").write_text("# Import rules: what may import what\n", encoding="utf-8")
    probe = repo / "docs" / "page.md"
    probe.write_text("# Top\n## Top\n[a](missing.md) [b](other.md#no-such)\n"
                     "[c](other.md#import-rules-what-may-import-what)\n"
                     "[d](#top-1) ![e](https://example.com/x.png) `[f](missing-in-code.md)`\n"
                     "```\n[g](missing-in-fence.md)\n```\n[h](../../outside.md) [i](./)\n", encoding="utf-8")
    assert broken_links(probe, root=repo) == ["missing.md: no such file",
                                              "other.md#no-such: docs/other.md has no heading #no-such",
                                              "../../outside.md: outside the repository"]
