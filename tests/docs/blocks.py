"""The docs' commands as tests: the fenced blocks of README.md and docs/*.md, their `<!-- test: ... -->` markers,
and the names a doc mentions (test and bench files, settings). docs/stages.md#the-docs-blocks-are-tests says what
a marker may say; tests/docs/test_doc_blocks.py runs them.

A marker is an HTML comment (invisible on GitHub) on the lines right above a fence, one directive each:

    <!-- test: skip — REASON -->                  the block is not run (a GPU, the hub, a server, an hour)
    <!-- test: skip 'CMD' 'CMD' — REASON -->      those commands of the block (by how they start) are not run
    <!-- test: replace 'OLD' 'NEW' -->            the block runs with OLD replaced by NEW (a tiny pipeline, say)
    <!-- test: file NAME -->                      a YAML block is the file NAME in the doc's folder, and every
                                                  pipeline and sweep it defines is loaded and planned
    <!-- test: excerpt of pipeline.yaml PLACE --> a YAML block is part of pipeline.yaml (at the dotted PLACE:
                                                  pipelines.smol-chat), value for value
    <!-- test: output of 'CMD' -->                an untagged block is what CMD prints (error lines compared)
    <!-- test: not settings 'NAME' — WHY -->      anywhere in a doc: dotted names that are not settings
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SHELL = ("bash", "sh", "console", "shell")
FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")
REASON = re.compile(r"\s+(?:—|--)\s+(.+)$")
DONE = "@@doc-block-rc="


class MarkerError(ValueError):
    """A marker the runner cannot read: its line and what is wrong."""


@dataclass
class Marker:
    skip: str | None = None                      # the whole block, with its reason
    skip_commands: dict[str, str] = field(default_factory=dict)   # how a command starts -> why it is not run
    replace: list[tuple[str, str]] = field(default_factory=list)
    file: str | None = None
    excerpt: str | None = None                   # the dotted place in pipeline.yaml ("" the top)
    output_of: str | None = None


@dataclass
class Block:
    doc: Path
    line: int          # the fence's line, 1-based
    lang: str
    text: str
    marker: Marker

    @property
    def where(self) -> str:
        return f"{self.doc.name}:{self.line}"

    @property
    def shell(self) -> bool:
        return self.lang in SHELL

    def runnable_text(self) -> str:
        text = self.text
        for old, new in self.marker.replace:
            if old not in text:
                raise MarkerError(f"{self.where}: replace {old!r}: not in the block")
            text = text.replace(old, new)
        return text


def parse_marker(lines: list[tuple[int, str]], doc: Path) -> Marker:
    m = Marker()
    for n, body in lines:
        where = f"{doc.name}:{n}"
        reason = None
        if r := REASON.search(body):
            reason, body = r.group(1).strip(), body[:r.start()]
        try:
            words = shlex.split(body)
        except ValueError as e:
            raise MarkerError(f"{where}: <!-- test: {body} -->: {e}") from None
        if not words:
            raise MarkerError(f"{where}: an empty test marker")
        verb, args = words[0], words[1:]
        if verb == "skip":
            if not reason:
                raise MarkerError(f"{where}: a skip says why: <!-- test: skip — REASON -->")
            if args:
                m.skip_commands.update(dict.fromkeys(args, reason))
            else:
                m.skip = reason
        elif verb == "replace" and len(args) == 2:
            m.replace.append((args[0], args[1]))
        elif verb == "file" and len(args) == 1:
            m.file = args[0]
        elif verb == "excerpt" and args[:2] == ["of", "pipeline.yaml"] and len(args) in (2, 3):
            m.excerpt = args[2] if len(args) == 3 else ""
        elif verb == "output" and args[:1] == ["of"] and len(args) == 2:
            m.output_of = args[1]
        elif verb == "not" and args[:1] == ["settings"]:
            pass  # for the names check, read from the whole doc (NOT_SETTINGS_MARKER)
        else:
            raise MarkerError(f"{where}: unknown test marker {body!r}: skip — REASON, skip 'CMD' — REASON, "
                              "replace 'OLD' 'NEW', file NAME, excerpt of pipeline.yaml [PLACE], output of 'CMD'")
    return m


def blocks(doc: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a markdown file, with the marker right above it."""
    lines = (doc.read_text() if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence = i, m.group(2)
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        above, k = [], start - 1
        while k >= 0 and (mm := MARKER.match(lines[k])):
            above.insert(0, (k + 1, mm.group(1)))
            k -= 1
        indent = len(m.group(1))
        body = "\n".join(ln[indent:] for ln in lines[start + 1:j])
        out.append(Block(doc, start + 1, m.group(3).lower(), body, parse_marker(above, doc)))
        i = j + 1
    return out


# ------------------------------------------------------------------ shell blocks


@dataclass
class Command:
    text: str          # as run (continuation lines joined by bash itself)
    expected: str      # what a console block shows it prints ("" for none)


def commands(block: Block) -> list[Command]:
    """The commands of a shell block: a console block's `$ ` lines (the lines after one are its output), or a
    bash block's lines, a line ending in `\\` continued; comment lines dropped."""
    text = block.runnable_text()
    out: list[Command] = []
    lines = text.splitlines()
    console = block.lang == "console"
    i = 0
    while i < len(lines):
        line = lines[i]
        if console and not line.startswith("$ "):
            if out:
                out[-1].expected += line + "\n"
            i += 1
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        cmd = [line[2:] if console else line]
        while cmd[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd.append(lines[i])
        out.append(Command("\n".join(cmd), ""))
        i += 1
    return out


def skip_reason(block: Block, cmd: Command) -> str | None:
    """Why the block's marker skips this command (None: it runs)."""
    return next((why for start, why in block.marker.skip_commands.items() if cmd.text.lstrip().startswith(start)),
                None)


def squeeze(text: str) -> str:
    return " ".join(text.split())


def shows(expected: str, output: str) -> bool:
    """The output holds what the doc shows, whitespace aside; `...` or `…` in the doc stand for any text."""
    pattern = ".*?".join(re.escape(part) for part in re.split(r"\.\.\.|…", squeeze(expected)))
    return re.search(pattern, squeeze(output)) is not None


# `CMD` prints `error: ...` in a doc's prose (a line wrapped anywhere)
INLINE = re.compile(r"`((?:finetune|python) [^`]+)`\s+prints\s+`(error: [^`]+)`")


def inline_errors(text: str) -> list[Command]:
    """The error lines a doc's prose says a command prints, as commands with their expected output."""
    return [Command(squeeze(m.group(1)), m.group(2)) for m in INLINE.finditer(text)]


def run_commands(cmds: list[Command], cwd: Path, env: dict[str, str], timeout: float) -> list[tuple[int, str]]:
    """Each command in one bash (exports carry over), as a user types them: (exit code, output) of each; a
    path in the folder (or a folder under it) printed as its file name, as a doc shows it."""
    script = ["exec 2>&1"]
    start = time.time()
    for c in cmds:
        script += [c.text, f'echo "{DONE}$? $(date +%s.%N)"']
    res = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    folders = "|".join(re.escape(str(f)) for f in {cwd, cwd.resolve()})
    out = re.sub(rf"(?:{folders})(/[\w.-]+)*/", "", res.stdout)
    parts = re.split(rf"{re.escape(DONE)}(\d+) ([\d.]+)\n", out)
    results = [(int(parts[k + 1]), parts[k]) for k in range(0, len(parts) - 1, 3)]
    if os.environ.get("DOC_BLOCKS_TIMES"):  # seconds per command, to size the suite
        ends = [start, *(float(parts[k + 2]) for k in range(0, len(parts) - 1, 3))]
        for c, a, b in zip(cmds, ends, ends[1:], strict=False):
            print(f"{b - a:6.1f}s  {c.text.splitlines()[0][:100]}")
    if len(results) < len(cmds):  # bash itself ended early (`exit`, a syntax error)
        results.append((res.returncode, parts[-1]))
    return results


def problem(cmd: Command, rc: int, output: str) -> str | None:
    """Why a command did not do what its doc says (None when it did). A command whose doc shows it printing
    something must print that (whitespace aside; an `error:` line included); any other must not fail: exit 0,
    or 1 (status and compare: something is not cached) without an error or a traceback."""
    short = output.strip()[-1500:]
    if "Traceback (most recent call last)" in output:
        return f"`{cmd.text}` printed a traceback:\n{short}"
    if cmd.expected.strip():
        if not shows(cmd.expected, output):
            return f"`{cmd.text}` printed\n{short}\nnot what the doc shows:\n{cmd.expected.strip()}"
        return None
    if rc not in (0, 1) or (rc == 1 and re.search(r"(?m)^(error|Error|\S+Error):", output)):
        return f"`{cmd.text}` exited {rc}:\n{short}"
    return None


def run_block(block: Block, cwd: Path, env: dict[str, str], timeout: float = 300) -> tuple[list[str], int, int]:
    """(problems, commands run, commands skipped) of a shell block."""
    cmds = commands(block)
    todo = [c for c in cmds if not skip_reason(block, c)]
    if not todo:
        return [], 0, len(cmds)
    results = run_commands(todo, cwd, env, timeout)
    problems = []
    for c, (rc, out) in zip(todo, results, strict=False):
        if p := problem(c, rc, out):
            problems.append(f"{block.where}: {p}")
    if len(results) < len(todo):
        problems.append(f"{block.where}: the block ended before `{todo[len(results)].text}`")
    return problems, len(todo), len(cmds) - len(todo)


def output_problem(block: Block, cwd: Path, env: dict[str, str], timeout: float = 300) -> str | None:
    """An untagged block marked `output of 'CMD'`: CMD, run, prints the block (an error line: that line)."""
    assert block.marker.output_of
    cmd = Command(block.marker.output_of, block.text)
    rc, out = run_commands([cmd], cwd, env, timeout)[0]
    if p := problem(cmd, rc, out):
        return f"{block.where}: {p}"
    if block.text.lstrip().startswith("error:") and rc != 2:
        return f"{block.where}: `{cmd.text}` exited {rc}, not 2 (bad input)"
    return None


# ------------------------------------------------------------------ YAML blocks


def contains(whole: object, part: object, at: str = "") -> list[str]:
    """Where `part` is not `whole` (a mapping: each of its keys, recursively)."""
    if isinstance(part, dict):
        if not isinstance(whole, dict):
            return [f"{at or 'the top'}: a mapping in the doc, {whole!r} in the file"]
        out = []
        for k, v in part.items():
            if k not in whole:
                out.append(f"{at}{k}: not in the file")
            else:
                out += contains(whole[k], v, f"{at}{k}.")
        return out
    return [] if whole == part else [f"{at.rstrip('.')}: {part!r} in the doc, {whole!r} in the file"]


def yaml_problems(block: Block, folder: Path, project_file: Path) -> list[str]:
    """A YAML block: an excerpt equal to the project's file, or a pipeline file whose pipelines load and plan
    and whose sweeps load (every variant validated), through the real loader, nothing trained."""
    from stages.engine.config import own_names
    from stages.engine.errors import FinetuneError
    from stages.engine.remote_store import open_store
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_doc, load_pipeline, load_sweep

    doc = yaml.safe_load(block.text)
    if block.marker.excerpt is None and "pipelines" not in doc and "defaults" not in doc:
        return sweep_problems(block, doc, project_file)
    if block.marker.excerpt is not None:
        whole = yaml.safe_load(project_file.read_text())
        for key in filter(None, block.marker.excerpt.split(".")):
            whole = whole.get(key) if isinstance(whole, dict) else None
        return [f"{block.where}: pipeline.yaml {block.marker.excerpt}: {p}" for p in contains(whole, doc)]
    name = block.marker.file or "doc-block.yaml"
    path = folder / name
    path.write_text(block.text + "\n")
    out = []
    try:
        pipelines = own_names(path)
        sweeps = list((load_doc(path).get("sweeps") or {}).keys() & (doc.get("sweeps") or {}).keys())
        cwd = Path.cwd()
        os.chdir(folder)
        try:
            for p in pipelines:
                GRAPH.plan(load_pipeline(p, path=path), open_store())
            for s in sweeps:
                load_sweep(s, path)
        finally:
            os.chdir(cwd)
    except FinetuneError as e:
        out.append(f"{block.where}: {name}: {e}")
    return out


def sweep_problems(block: Block, doc: dict, project_file: Path) -> list[str]:
    """A block of sweeps alone: each validated as a sweep of pipeline.yaml (its base pipeline, and every variant's
    config loaded and checked as a run's)."""
    from flows.reports.variants import expand
    from stages.engine.errors import FinetuneError
    from stages.pipeline.loading import load_doc, validate_sweep

    project = load_doc(project_file)
    out = []
    for name, body in (doc.get("sweeps") or {}).items():
        try:
            expand(validate_sweep(name, body, f"sweeps.{name}", project), project_file)
        except FinetuneError as e:
            out.append(f"{block.where}: sweep {name}: {e}")
    return out


# ------------------------------------------------------------------ names a doc mentions

PATH = re.compile(r"(?<![\w/.-])((?:tests|bench)/[\w/.-]*\w)(?:::(\w+))?")
SECTIONS = ("data", "tokenize", "model", "quantization", "adapters", "train", "evaluate", "export", "tracking")
SETTING = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?![\w(-])")
# dotted words that are not settings: files, and attributes in prose about code
NOT_SETTINGS = re.compile(r"\.(py|md|json|jsonl|yaml|yml|safetensors|onnx|gguf|arrow|csv|png|txt|jinja|bin)$|"
                          r"^model\.(generate|eval|config)(\.|$)|^export\.py$")


def code_spans(text: str) -> str:
    """The text without its python blocks (code, not settings or paths of the project)."""
    return re.sub(r"(?ms)^\s*```python\n.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), text)


def missing_paths(text: str, root: Path, where: str) -> list[str]:
    """Every tests/... or bench/... path (and tests/...::name) the text names that does not exist, with the fix."""
    out = []
    for m in PATH.finditer(text):
        path, name = m.group(1), m.group(2)
        if path == "bench/out" or path.startswith("bench/out/"):  # where a bench writes, not a file of the project
            continue
        line = text.count("\n", 0, m.start()) + 1
        target = root / path
        if not target.exists():
            moved = sorted(str(p.relative_to(root)) for p in (root / path.split("/")[0]).rglob(Path(path).name))
            out.append(f"{where}:{line}: {path} does not exist" + (f"; it is {moved[0]} now" if moved else ""))
        elif name and target.is_file() and not re.search(rf"(?m)^\s*(async )?def {name}\(", target.read_text()):
            out.append(f"{where}:{line}: {path} has no test {name}")
    return out


NOT_SETTINGS_MARKER = re.compile(r"<!--\s*test:\s*not settings\s+(.*?)\s*-->")


def unknown_settings(text: str, known: set[str], where: str) -> list[str]:
    """Every setting name (section.field...) the text names that the schema does not have, with the nearest;
    names a `<!-- test: not settings 'NAME' ... -->` in the text lists are not settings (MLflow's metric names)."""
    import difflib

    out = []
    known = known | {n for m in NOT_SETTINGS_MARKER.finditer(text) for n in shlex.split(REASON.sub("", m.group(1)))}
    text = code_spans(text)
    for m in SETTING.finditer(text):
        name = m.group(1)
        if NOT_SETTINGS.search(name) or name in known:
            continue
        line = text.count("\n", 0, m.start()) + 1
        near = difflib.get_close_matches(name, known, n=1)
        out.append(f"{where}:{line}: {name} is no setting" + (f"; did you mean {near[0]}?" if near else ""))
    return out
