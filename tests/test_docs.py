"""The README stays a five-minute read and no link in it or in docs/ points at nothing."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def note_files() -> list[Path]:
    """docs/notes/: dated measurement notes, linked from their index, not from the README."""
    return sorted((ROOT / "docs" / "notes").glob("*.md"))


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks: a link written inside one is not rendered."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return lines


def link_targets(text: str) -> list[str]:
    return [m.group(1) for line in prose_lines(text)
            for m in LINK.finditer(INLINE_CODE.sub("", line))]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(0)[1:-1], heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for line in prose_lines(path.read_text())
            if (m := HEADING.match(line))}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of one markdown file whose file (or heading anchor) is missing."""
    name, broken = path.relative_to(root), []
    for target in link_targets(path.read_text()):
        if SCHEME.match(target):
            continue  # a web address: not ours to check offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{name}: {target} (no such heading)")
    return broken


def test_the_readme_is_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


@pytest.mark.parametrize("path", markdown_files() + note_files(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_something_that_exists(path: Path):
    assert broken_links(path) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in link_targets(README.read_text())}
    orphans = [p.name for p in markdown_files()[1:] if p.resolve() not in linked]
    assert orphans == []


def test_every_note_is_linked_from_the_notes_index_and_the_index_from_the_readme():
    index = ROOT / "docs" / "notes" / "README.md"
    readme_links = {(ROOT / t.partition("#")[0]).resolve()
                    for t in link_targets(README.read_text())}
    assert index.resolve() in readme_links
    linked = {(index.parent / t.partition("#")[0]).resolve()
              for t in link_targets(index.read_text())}
    assert [p.name for p in note_files() if p != index and p.resolve() not in linked] == []


def test_design_docs_hold_no_dated_headings():
    """Dated lab notes live in docs/notes/; the design docs say how things work now."""
    dated = re.compile(r"^#{1,6} .*\b20\d\d-\d\d-\d\d\b")
    found = [f"{p.name}: {line}" for p in markdown_files()[1:]
             for line in prose_lines(p.read_text()) if dated.match(line)]
    assert found == []


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path: Path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope)\n"
                    "`[in code](skipped.md)` [web](https://example.com/x.md)\n"
                    "```\n[fenced](skipped.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["page.md: missing.md (no such file)",
                                                 "page.md: there.md#nope (no such heading)"]


def test_the_readme_installs_every_package_the_preflight_can_ask_for():
    """A desktop user's first step (issue 23, item 1): the README's apt-get line names every
    Debian package the xcb preflight (app/preflight.py) may report missing, and .ci/run
    installs them too."""
    from kvscope.app.preflight import DEBIAN_PACKAGES

    readme, ci = README.read_text(), (ROOT / ".ci" / "run").read_text()
    missing = {p for p in DEBIAN_PACKAGES.values() if p not in readme}
    assert not missing, f"README's apt-get line lacks {sorted(missing)}"
    assert not {p for p in DEBIAN_PACKAGES.values() if p not in ci}, ".ci/run lacks some"
