"""Every pointer into the documentation resolves: a `docs/<name>.md` or `docs/<name>.md#<anchor>` / `README.md#<anchor>`
written in the code, the tests, the benches, the Makefile, pipeline.yaml, README.md or docs/; a relative markdown
link in README.md or docs/ (`](store.md#the-hit-rule)`, `](../README.md#changes)`, `](#an-installed-wheel)`);
and a README section named in words (README's Layout, `README, Changes`, README "Quick start"). The file must
exist and the anchor must be one of its headings' GitHub anchors (lowercase, spaces to '-', punctuation other
than '-' and '_' dropped, a repeated heading suffixed -1, -2...). Reads files only: well under a second."""

from __future__ import annotations

import difflib
import re
from functools import cache
from pathlib import Path

from helpers import ROOT

CODE_DIRS = ("stages", "flows", "tests", "bench")
TOP_FILES = ("Makefile", "pipeline.yaml", "README.md")

# docs/<name>.md[#<anchor>] or README.md#<anchor>, written anywhere (a path from the repository root)
ROOTED = re.compile(r"(?<![\w/.-])((?:docs/[\w.-]+\.md|README\.md)(?:#([\w-]+))?)")
# a relative markdown link: ](target.md#anchor) or ](#anchor), resolved from the file it is written in
LINK = re.compile(r"\]\(((?:[\w./-]*\.md)?(?:#([\w-]*))?)\)")
# a README section named in words: README's Layout / README, Changes (a capital: a section, not prose) /
# README "Quick start"
WORDS = re.compile(r"README(?:\.md)?(?:'s|,) (?=[A-Z])([^\n]{1,80})")
QUOTED = re.compile(r"README(?:\.md)?(?:'s|,)? \"([^\"\n]{1,80})\"")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def headings(path: Path) -> tuple[tuple[str, str], ...]:
    """(title, anchor) of every heading of a markdown file, fenced code blocks skipped."""
    out, seen, fenced = [], {}, False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or not (m := HEADING.match(line)):
            continue
        title = m.group(2).replace("`", "")
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append((title, base if n == 0 else f"{base}-{n}"))
    return tuple(out)


def sources() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES] + sorted((ROOT / "docs").glob("*.md"))
    for folder in CODE_DIRS:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return [p for p in files if p.is_file()]


def where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def anchor_problem(target: Path, anchor: str | None) -> str | None:
    """Why `target#anchor` does not resolve (None when it does), with the fix."""
    if not target.is_file():
        near = difflib.get_close_matches(target.name, [p.name for p in (ROOT / "docs").glob("*.md")], n=1)
        return f"{target.relative_to(ROOT)} does not exist" + (f"; did you mean docs/{near[0]}?" if near else "")
    if not anchor:
        return None
    anchors = [a for _, a in headings(target)]
    if anchor in anchors:
        return None
    near = difflib.get_close_matches(anchor, anchors, n=1, cutoff=0.4)
    return (f"{target.relative_to(ROOT)} has no heading whose anchor is #{anchor}: "
            + (f"point at #{near[0]}" if near else f"point at one of #{', #'.join(anchors)}")
            + " or add that heading")


def section_problem(name: str) -> str | None:
    """Why a README section named in words is not one (None when a heading starts the text)."""
    titles = [t for t, _ in headings(ROOT / "README.md")]
    if any(name.lower().startswith(t.lower()) for t in titles):
        return None
    docs = [(f"docs/{p.name}#{a}", t) for p in sorted((ROOT / "docs").glob("*.md")) for t, a in headings(p)]
    moved = [d for d, t in docs if name.lower().startswith(t.lower()) or t.lower().startswith(name.lower())]
    return (f"README.md has no section '{name}': "
            + (f"it is {moved[0]}: write that pointer" if moved else
               f"name one of its sections ({', '.join(titles)}) or point at docs/<name>.md#<anchor>"))


def broken_pointers() -> list[str]:
    out = []
    for path in sources():
        text = path.read_text()
        for m in ROOTED.finditer(text):
            file, _, anchor = m.group(1).partition("#")
            if problem := anchor_problem(ROOT / file, anchor or None):
                out.append(f"{where(path, text, m.start())}: {m.group(1)}: {problem}")
        if path.suffix == ".md":
            for m in LINK.finditer(text):
                file, _, anchor = m.group(1).partition("#")
                target = (path.parent / file).resolve() if file else path
                if not target.is_relative_to(ROOT):
                    continue
                if problem := anchor_problem(target, anchor or None):
                    out.append(f"{where(path, text, m.start())}: ]({m.group(1)}): {problem}")
        for m in [*WORDS.finditer(text), *QUOTED.finditer(text)]:
            if problem := section_problem(m.group(1)):
                out.append(f"{where(path, text, m.start())}: {m.group(0)!r}: {problem}")
    return out


def test_the_slug_is_githubs():
    assert slug("Work pools: GPU machines, a shared store") == "work-pools-gpu-machines-a-shared-store"
    assert slug("The demo (make demo)") == "the-demo-make-demo"
    assert slug("bf16 on CPUs with bf16 units (train.mixed_precision: auto)") == \
        "bf16-on-cpus-with-bf16-units-trainmixed_precision-auto"


def test_every_pointer_into_the_docs_resolves():
    broken = broken_pointers()
    assert not broken, "pointers that lead nowhere (fix the pointer's text):\n" + "\n".join(broken)
