"""flows/ names no stage: what differs per stage reaches the reports, the UI and the flow through the graph
(a stage's role, headline, history, tracked files: stages/facts.py, stages/graph.py), so a pipeline whose
graph differs keeps them. Read from the source (ast), nothing run."""

from __future__ import annotations

import ast

from helpers import ROOT

from stages.graph import GRAPH

# A literal that is the same word as a stage and means something else, with why
NOT_A_STAGE = {
    ("flows/reports/predict_cli.py", "export"): "--precision export: the precision the exported model was made in",
    ("flows/reports/openai_api.py", "model"): "the OpenAI API's field naming the served model",
    ("flows/reports/openai_api.py", "data"): "the OpenAI API's list field, and a server-sent event's `data:`",
}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the module's, classes' and functions' docstring nodes (prose, not logic)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def stage_literals(names: set[str]) -> list[str]:
    found = []
    for path in sorted((ROOT / "flows").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and node.value in names and (rel, node.value) not in NOT_A_STAGE:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_flows_write_no_stage_name_as_a_string_literal():
    assert not stage_literals(set(GRAPH.names)), "find the stage by its role or attribute (stages/facts.py)"


def test_the_check_sees_a_stage_name_in_logic():
    """The scan would catch one: it finds the names it is given where flows/ writes them as literals."""
    assert stage_literals({"finetune"})  # the flow's name, written in flows/ as a literal
