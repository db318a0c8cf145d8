"""README.md stays a map of the code: its Layout block lists every package and module under flows/ and
stages/ (a folder listed without children covers what is inside it), and nothing that is gone."""

from __future__ import annotations

import re

from helpers import ROOT

ENTRY = re.compile(r"(?<![\w/`.-])([A-Za-z_]\w*\.py|[A-Za-z_]\w*/)(?=\s|$)")


def layout_map(readme: str) -> tuple[set[str], set[str]]:
    """(modules, folders) named in the ``` block under `## Layout`, as paths from the repository root."""
    section = readme.split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1]
    modules, folders, stack = set(), set(), []  # stack: (indent, folder)
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        for i, name in enumerate(ENTRY.findall(line)):
            path = parent + name
            if name.endswith("/"):
                folders.add(path)
                if i == 0:
                    stack.append((indent, path))
            else:
                modules.add(path)
    return modules, folders


def test_the_layout_map_is_the_tree():
    modules, folders = layout_map((ROOT / "README.md").read_text())
    leaf_folders = {f for f in folders if not any(m.startswith(f) for m in modules | (folders - {f}))}
    tree = {str(p.relative_to(ROOT)) for pkg in ("flows", "stages") for p in (ROOT / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}
    expected = {p for p in tree if not p.endswith("/__init__.py") and not any(p.startswith(f) for f in leaf_folders)}
    listed = {m for m in modules if m.startswith(("flows/", "stages/"))}
    assert not expected - listed, f"README.md's Layout lacks {sorted(expected - listed)}: add a line for each"
    assert not listed - tree, f"README.md's Layout lists {sorted(listed - tree)}, which no longer exist"
    gone = {f for f in folders if f.startswith(("flows/", "stages/")) and not (ROOT / f).is_dir()}
    assert not gone, f"README.md's Layout lists folders that no longer exist: {sorted(gone)}"


def test_the_readme_fits_on_a_few_screens():
    shown = [ln for ln in (ROOT / "README.md").read_text().splitlines() if not ln.startswith("<!-- test:")]
    assert len(shown) <= 200  # the rest lives in docs/; a test marker (tests/docs/blocks.py) is not shown
