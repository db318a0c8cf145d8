"""The code fingerprint covers everything a stage runs, proved by execution.

The small pipelines (a classifier fully finetuned; a seq2seq model with LoRA, and with 4-bit QLoRA and a merged
export) run with
each stage body under a profiler that records every project function called and every project module-level
name the called code loads (`LOAD_GLOBAL`, `module.attr`). Each one must be covered by that stage's code
fingerprint. Then every recorded object is edited, in memory, and the stages that ran it must get a new key;
editing code that no stage can reach (the inspector, serve, the command line …) must change no key.
"""

from __future__ import annotations

import ast
import dis
import importlib
import logging
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import BILLSUM, IMDB, ROOT, needs_shared_data, plan, run_pipeline

from stages.engine import store as store_module
from stages.engine.codegraph import CodeGraph
from stages.engine.fingerprint import code_fingerprint
from stages.engine.stage import code_roots
from stages.engine.status import why_changed
from stages.engine.store import Store
from stages.graph import GRAPH, graph_for
from stages.pipeline.loading import load_pipeline

PROJECT_DIRS = tuple(str(ROOT / p) + "/" for p in ("stages", "flows"))
T5_4BIT = ("quantization.mode=4bit", "model.from_config.d_model=64", "model.from_config.d_kv=16",
           "model.from_config.d_ff=128", "evaluate.max_examples=4", "export.merge=true")
RUNS = {
    "classifier-full": ("tiny-imdb", IMDB),
    "seq2seq-lora": ("tiny-billsum", BILLSUM),
    "seq2seq-qlora-4bit": ("tiny-billsum", (*BILLSUM, *T5_4BIT)),
}
# each run's own graph: the core stages, their roots holding the pipeline's method (stages/graph.py)
RUN_GRAPHS = {run: graph_for(load_pipeline(pipeline, list(sets))) for run, (pipeline, sets) in RUNS.items()}


# ---------------------------------------------------------------- an independent view of the source


def module_name(filename: str) -> str:
    rel = Path(filename).resolve().relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


_TREES: dict[str, ast.Module] = {}


def tree(module: str) -> ast.Module:
    if module not in _TREES:
        path = ROOT.joinpath(*module.split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        _TREES[module] = ast.parse(path.read_text())
    return _TREES[module]


def top_level_name(module: str, line: int) -> str | None:
    """The name bound by the top-level statement that holds `line` (decorators included)."""
    for stmt in tree(module).body:
        first = min([stmt.lineno, *[d.lineno for d in getattr(stmt, "decorator_list", [])]])
        if first <= line <= (stmt.end_lineno or stmt.lineno):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                return stmt.name
            if isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                return next(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            return None
    return None


def origin(module: str, name: str) -> tuple[str, str] | None:
    """Where a module-level name of a project module is defined, following `from x import name`."""
    for stmt in tree(module).body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    if stmt.module.split(".")[0] not in ("stages", "flows"):
                        return None
                    return origin(stmt.module, alias.name)
        if isinstance(stmt, ast.Import):
            if any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
                return None  # a module
    return module, name


# ---------------------------------------------------------------- the tracer


class Tracer:
    """Records project code objects called (with the globals they ran in) on every thread."""

    def __init__(self) -> None:
        self.calls: dict[types.CodeType, dict] = {}

    def _profile(self, frame, event, arg):  # noqa: ANN001
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(PROJECT_DIRS) and code not in self.calls:
                self.calls[code] = frame.f_globals

    def __enter__(self) -> Tracer:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def objects(self) -> set[str]:
        """"module.name" of every top-level object that ran, and of every module-level name it loads."""
        out: set[str] = set()
        for code, f_globals in self.calls.items():
            module = module_name(code.co_filename)
            name = top_level_name(module, code.co_firstlineno)
            if name is not None:
                out.add(f"{module}.{name}")
            out |= loaded_names(code, f_globals)
        return out


def loaded_names(code: types.CodeType, f_globals: dict) -> set[str]:
    """Project module-level names a code object (and the code nested in it) loads: `X` and `module.X`."""
    out: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        instructions = list(dis.get_instructions(c))
        for i, ins in enumerate(instructions):
            if ins.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or ins.argval not in f_globals:
                continue
            value = f_globals[ins.argval]
            if isinstance(value, types.ModuleType):
                nxt = instructions[i + 1] if i + 1 < len(instructions) else None
                if value.__name__.split(".")[0] in ("stages", "flows") and nxt is not None \
                        and nxt.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                    hit = defined_at(value.__name__, nxt.argval, getattr(value, nxt.argval, None))
                    if hit:
                        out.add(hit)
                continue
            hit = defined_at(f_globals["__name__"], ins.argval, value)
            if hit:
                out.add(hit)
    return out


def defined_at(module: str, name: str, value: object) -> str | None:
    if module.split(".")[0] not in ("stages", "flows") or isinstance(value, types.ModuleType):
        return None
    if isinstance(value, types.FunctionType | type):
        home = getattr(value, "__module__", "") or ""
        if home.split(".")[0] not in ("stages", "flows"):
            return None
        return f"{home}.{value.__qualname__.split('.')[0]}"
    where = origin(module, name)
    return f"{where[0]}.{where[1]}" if where else None


# ---------------------------------------------------------------- running the pipelines traced


def traced_graph(seen: dict[str, set[str]], run: str) -> list:
    def wrap(st):
        def body(ctx):
            # The store's work hook (publish a checkpoint to a shared store) is the runner's, like the log
            # handlers below: where a resumable state is copied to never changes what the stage computes.
            hook = store_module._work_saved.set(None)
            try:
                with Tracer() as t:
                    try:
                        return st.body(ctx)
                    finally:
                        seen.setdefault(st.name, set()).update(t.objects())
            finally:
                store_module._work_saved.reset(hook)
        return replace(st, body=body)
    return [wrap(st) for st in RUN_GRAPHS[run]]


@contextmanager
def without_flow_log_handlers() -> Iterator[None]:
    """Detach the log handlers a flow module installs on the stage logger (a flow run, as an earlier
    test in this worker may have, adds Prefect's API handler with the `InPrefectRun` filter). Where a stage's
    log records go is set by whoever runs it, never part of what it computes; traced, it would show up as
    flows code run by every stage."""
    stage_log = logging.getLogger("finetune")
    saved = stage_log.handlers[:]
    for handler in saved:
        if any(type(f).__module__.split(".")[0] == "flows" for f in handler.filters):
            stage_log.removeHandler(handler)
    try:
        yield
    finally:
        stage_log.handlers[:] = saved


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """run -> stage -> objects the stage ran (its body, and the function choosing its input files)."""
    out: dict[str, dict[str, set[str]]] = {}
    for st in GRAPH:  # the graph names its bodies lazily: their modules' import is not what a stage runs
        importlib.import_module(st.body.__module__)
    with without_flow_log_handlers():
        for run, (pipeline, sets) in RUNS.items():
            cfg = load_pipeline(pipeline, list(sets))
            seen: dict[str, set[str]] = {}
            for st in RUN_GRAPHS[run]:
                with Tracer() as t:
                    st.inputs(cfg)
                seen.setdefault(st.name, set()).update(t.objects())
            run_pipeline(cfg, Store(tmp_path_factory.mktemp(run)), traced_graph(seen, run))
            out[run] = seen
    return out


def covered(stage_objects: list[str]) -> set[str]:
    return {o.rsplit(":", 1)[0] for o in stage_objects}


def is_covered(obj: str, objects: set[str]) -> bool:
    module = obj.rsplit(".", 1)[0]
    return obj in objects or f"{module}.<module>" in objects


@needs_shared_data
def test_every_function_and_value_a_stage_runs_is_in_its_key(traces):
    missing = []
    for run, (pipeline, sets) in RUNS.items():
        cfg = load_pipeline(pipeline, list(sets))
        planned = {p.stage.name: covered(p.key.code_objects) for p in plan(cfg, None, graph_for(cfg))}
        for stage, objects in traces[run].items():
            missing += [f"{run}/{stage}: {o}" for o in sorted(objects) if not is_covered(o, planned[stage])]
    assert sum(len(o) for t in traces.values() for o in t.values()) > 100  # the tracer saw the stages run
    assert not missing, "code a stage ran but its key does not cover:\n" + "\n".join(missing)


# ---------------------------------------------------------------- mutations


def mutated_source(module: str, name: str) -> str:
    return _mutate(SOURCES[module], name)


def _mutate(source: str, name: str) -> str:
    """The source with top-level object `name` changed (a statement added to a function or class, a value
    wrapped in an expression that keeps it), everything else as it was."""
    t = ast.parse(source)
    for stmt in t.body:
        names = [stmt.name] if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else \
            [n.id for tg in getattr(stmt, "targets", [getattr(stmt, "target", None)]) if tg is not None
             for n in ast.walk(tg) if isinstance(n, ast.Name)]
        if name in names:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                stmt.body.append(ast.Pass())
            else:
                stmt.value = ast.IfExp(test=ast.Constant(True), body=stmt.value, orelse=ast.Constant(None))
            return ast.unparse(ast.fix_missing_locations(t))
    raise AssertionError(f"{name}: not found at top level")


def _read_sources() -> dict[str, str]:
    """Every project module's text, read once: the mutation tests see one version of the tree."""
    files = [*ROOT.glob("stages/**/*.py"), *ROOT.glob("flows/**/*.py")]
    return {module_name(str(p)): p.read_text() for p in files}


SOURCES = _read_sources()


BASE_GRAPH = CodeGraph(ROOT, SOURCES)


def edited_graph(changed: dict[str, str]) -> CodeGraph:
    """A graph of the tree with `changed` modules' text, reusing what the unedited graph already worked out
    for every other module. Exact for the mutations here, which keep each module's names and imports: no
    other module resolves a name differently (test_seeded_graphs_agree_with_fresh_ones checks a sample)."""
    graph = CodeGraph(ROOT, {**SOURCES, **changed})
    graph._modules = {m: info for m, info in BASE_GRAPH._modules.items() if m not in changed}
    graph._objects = {k: v for k, v in BASE_GRAPH._objects.items() if k[0] not in changed}
    return graph


def stage_codes(changed: dict[str, str], stages: set[str] | None = None, fresh: bool = False) -> dict[str, str]:
    graph = CodeGraph(ROOT, {**SOURCES, **changed}) if fresh or not changed else edited_graph(changed)
    return {f"{run}/{st.name}": code_fingerprint(code_roots(st), graph if changed else BASE_GRAPH)[0]
            for run, g in RUN_GRAPHS.items() for st in g if stages is None or f"{run}/{st.name}" in stages}


@needs_shared_data
def test_editing_anything_a_stage_ran_changes_that_stages_key(traces):
    base = stage_codes({})
    ran: dict[str, set[str]] = {}  # object -> stages that ran it
    for run, seen in traces.items():
        for stage, objects in seen.items():
            for o in objects:
                ran.setdefault(o, set()).add(f"{run}/{stage}")
    unchanged = []
    for module in sorted({o.rsplit(".", 1)[0] for o in ran}):
        # the round trip through ast.unparse alone changes no key: only the edit does
        assert stage_codes({module: ast.unparse(ast.parse(SOURCES[module]))}) == base, module
    for obj, stages in sorted(ran.items()):
        module, name = obj.rsplit(".", 1)
        after = stage_codes({module: mutated_source(module, name)}, stages)
        unchanged += [f"{obj} (run by {s})" for s in sorted(stages) if after[s] == base[s]]
    assert len(ran) > 60
    assert not unchanged, "edits that left a key unchanged:\n" + "\n".join(unchanged)


def test_seeded_graphs_agree_with_fresh_ones():
    stage_codes({})  # the unedited graph, worked out
    objects = sorted({o for g in RUN_GRAPHS.values() for st in g
                      for o in covered(code_fingerprint(code_roots(st), BASE_GRAPH)[1])})
    sample = [o for o in objects[::max(1, len(objects) // 12)] if not o.endswith((".<module>", ".<preamble>"))]
    assert len(sample) >= 8
    for obj in sample:
        module, name = obj.rsplit(".", 1)
        edit = {module: mutated_source(module, name)}
        assert stage_codes(edit) == stage_codes(edit, fresh=True), obj


def test_editing_code_no_stage_reaches_changes_no_key():
    base = stage_codes({})
    graph = CodeGraph(ROOT, SOURCES)
    reachable = set().union(*(covered(code_fingerprint(code_roots(st), graph)[1]) for g in RUN_GRAPHS.values()
                              for st in g))
    outside: dict[str, list[str]] = {}  # module -> its functions and classes no stage can reach
    for module in sorted(SOURCES):
        if f"{module}.<module>" in reachable:
            continue
        for stmt in ast.parse(SOURCES[module]).body:
            if isinstance(stmt, ast.FunctionDef | ast.ClassDef) and f"{module}.{stmt.name}" not in reachable:
                outside.setdefault(module, []).append(stmt.name)
    assert "main" in outside["flows.reports.inspect_cli"] and "gc" in outside["stages.engine.status"]
    changed = []
    for module, names in outside.items():  # every unreachable function of a module edited at once
        source = SOURCES[module]
        for name in names:
            source = _mutate(source, name)
        if stage_codes({module: source}) != base:
            changed.append(f"{module} ({', '.join(names)})")
    assert not changed, "editing code no stage reaches changed a key: " + "; ".join(changed)


def test_status_names_the_changed_object():
    cfg = load_pipeline("tiny-imdb", list(IMDB))
    train = next(p for p in plan(cfg) if p.stage.name == "train")
    source = SOURCES["stages.training.batching"].replace("MEGA_CHUNK = 50", "MEGA_CHUNK = 64")
    code, objects = code_fingerprint(code_roots(train.stage), CodeGraph(ROOT, {"stages.training.batching": source}))
    old_inputs = {**train.key.key_inputs(), "code_objects": list(train.key.code_objects)}
    new_key = replace(train.key, code=code, code_objects=tuple(objects))
    assert new_key.key != train.key.key
    assert why_changed(old_inputs, new_key) == ["changed code: stages.training.batching.MEGA_CHUNK (modified)"]
