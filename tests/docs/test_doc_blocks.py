"""The shell and YAML blocks of README.md and docs/*.md run as tests (markers: tests/docs/blocks.py and
docs/stages.md#the-docs-blocks-are-tests), and every test file, bench file and setting a doc names exists, so a
renamed file, flag or setting fails here, not for a reader.

Each doc's blocks run in order in a folder of their own that looks like a checkout (links to this one's
packages, .venv and pipeline.yaml, and ../shared beside it), with `finetune` and `python` the venv's, against one
temporary store where `python -m stages tiny-imdb` ran first; nothing touches artifacts/ or .prefect/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import yaml
from blocks import (
    Block,
    MarkerError,
    blocks,
    commands,
    inline_errors,
    missing_paths,
    output_problem,
    problem,
    run_block,
    run_commands,
    skip_reason,
    unknown_settings,
    yaml_problems,
)
from helpers import ROOT, SHARED_DATA, needs_shared_data

from stages.pipeline import reference
from stages.pipeline.schema import PipelineConfig

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = ROOT / "docs" / "changes.md"  # what earlier releases named: old settings and paths, by design
LINKED = (".venv", "stages", "flows", "bench", "tests", "pipeline.yaml", "pyproject.toml", "Makefile", "setup.py")


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


def by_doc(kind: str) -> list:
    """One test per doc that has blocks of this kind (its blocks run in order: a later one may read an earlier's
    files or store)."""
    out = []
    for doc in DOCS:
        bs = [b for b in blocks(doc) if not b.marker.skip and (kind == "shell" and (b.shell or b.marker.output_of)
                                                             or kind == "yaml" and b.lang == "yaml")]
        if bs or kind == "shell" and inline_errors(doc.read_text()):
            out.append(pytest.param(doc, id=str(doc.relative_to(ROOT))))
    return out


# ------------------------------------------------------------------ the files the docs assume a reader has


def reviews(n: int, start: int = 12470) -> pd.DataFrame:
    df = pd.read_csv(SHARED_DATA / "imdb" / "test.csv.gz", keep_default_na=False).iloc[start:start + n]
    return df.reset_index(drop=True)


def write_doc_files(doc: Path, folder: Path) -> None:
    """What a doc says the reader has beside its commands: configuration.md's reviews.csv (3 string classes),
    export.md's (a `review` column), chat.md's chats.jsonl (150 ShareGPT conversations). Real IMDB reviews."""
    if doc.name == "configuration.md":
        df = reviews(60)
        pd.DataFrame({"text": df["text"].str[:300], "sentiment": [("neg", "mixed", "pos")[i % 3] for i in
                                                                    range(len(df))]}).to_csv(folder / "reviews.csv",
                                                                                             index=False)
    if doc.name == "export.md":  # `predict --file reviews.csv --text-column review`
        pd.DataFrame({"review": reviews(12)["text"].str[:300]}).to_csv(folder / "reviews.csv", index=False)
    if doc.name == "chat.md":
        df = reviews(150)
        rows = [{"conversations": [{"from": "human", "value": t[:200] + "\n\nPositive or negative?"},
                                   {"from": "gpt", "value": ("negative", "positive")[label]}]}
                for t, label in zip(df["text"], df["label"], strict=True)]
        (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        # the unknown-role example: a file in the default `messages` format whose line 7 has a 'bot' turn
        turns = [[{"role": "user", "content": t[:200]}, {"role": "assistant", "content": "fine"}] for t in df["text"][:10]]
        turns[6].append({"role": "bot", "content": "2+2?"})
        (folder / "messages").mkdir()
        (folder / "messages" / "chats.jsonl").write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> dict:
    """The store every doc's blocks share (tiny-imdb run once) and the environment their commands get."""
    base = tmp_path_factory.mktemp("doc-blocks")
    env = dict(os.environ)
    env.update(FINETUNE_STORE=str(base / "store"), PREFECT_HOME=str(base / "prefect"), PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", FINETUNE_PROGRESS="off",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, "-m", "stages", "tiny-imdb"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {"base": base, "env": env}


def checkout(base: Path, doc: Path) -> Path:
    """A folder that looks like this checkout for the doc's commands, ../shared beside it."""
    folder = base / doc.stem / "checkout"
    if not folder.exists():
        folder.mkdir(parents=True)
        for name in LINKED:
            (folder / name).symlink_to(ROOT / name)
        (folder.parent / "shared").symlink_to(SHARED_DATA.parent)
        write_doc_files(doc, folder)
    return folder


# ------------------------------------------------------------------ the blocks


def test_every_marker_reads_and_every_block_is_run_or_skipped_with_its_reason():
    """Markers parse (a skip without its reason, an unknown directive or a replace of text the block lacks is an
    error), and the count of blocks by what the suite does with them is printed."""
    counts: Counter = Counter()
    reasons: Counter = Counter()
    for b in all_blocks():
        if b.shell:
            b.runnable_text()  # a replace that matches nothing raises
            if b.marker.skip:
                counts["shell blocks skipped"] += 1
                reasons[b.marker.skip] += 1
            else:
                counts["shell blocks run"] += 1
                for c in commands(b):
                    if why := skip_reason(b, c):
                        counts["commands skipped in blocks that run"] += 1
                        reasons[why] += 1
                    else:
                        counts["commands run"] += 1
                counts["commands compared with their output"] += sum(1 for c in commands(b) if c.expected.strip())
        elif b.lang == "yaml":
            counts["yaml blocks " + ("compared with pipeline.yaml" if b.marker.excerpt is not None else "loaded and planned")] += 1
        elif b.marker.output_of:
            counts["output blocks compared with what their command prints"] += 1
        elif b.marker.skip:
            counts["output blocks not compared"] += 1
            reasons[b.marker.skip] += 1
    counts["error lines in prose compared (`CMD` prints `error: ...`)"] = sum(len(inline_errors(d.read_text()))
                                                                             for d in DOCS)
    print("\n" + "\n".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print("skipped, by reason:\n" + "\n".join(f"  {n} x {r}" for r, n in reasons.most_common()))
    assert counts["shell blocks run"] and counts["yaml blocks loaded and planned"]


def test_an_error_line_a_doc_shows_is_one_the_code_prints():
    """Every untagged block that shows an `error: ...` line says which command prints it (`output of`) or why it
    is not compared (`skip — REASON`)."""
    loose = [b.where for b in all_blocks() if not b.lang and b.text.lstrip().startswith("error:")
             and not b.marker.output_of and not b.marker.skip]
    assert not loose, ("error lines no test compares with the code's: put <!-- test: output of 'CMD' --> (or "
                       "<!-- test: skip — REASON -->) above each: " + ", ".join(loose))


@needs_shared_data
@pytest.mark.parametrize("doc", by_doc("shell"))
def test_the_shell_blocks_run_as_the_doc_says(doc, scratch):
    folder = checkout(scratch["base"], doc)
    problems, ran, skipped = [], 0, 0
    for b in blocks(doc):
        if b.marker.skip:
            continue
        if b.lang == "yaml" and b.marker.file:  # a pipeline file the next commands use
            (folder / b.marker.file).write_text(b.text + "\n")
        elif b.shell:
            p, r, s = run_block(b, folder, scratch["env"])
            problems += p
            ran, skipped = ran + r, skipped + s
        elif b.marker.output_of:
            if p := output_problem(b, folder, scratch["env"]):
                problems.append(p)
            ran += 1
    if inline := inline_errors(doc.read_text()):
        for c, (rc, out) in zip(inline, run_commands(inline, folder, scratch["env"], 300), strict=True):
            if p := problem(c, rc, out):
                problems.append(f"{doc.name}: {p}")
        ran += len(inline)
    print(f"{doc.name}: {ran} commands run, {skipped} skipped by their marker")
    assert not problems, "\n\n".join(problems)


@needs_shared_data
@pytest.mark.parametrize("doc", by_doc("yaml"))
def test_the_yaml_blocks_load_and_plan(doc, scratch, monkeypatch):
    monkeypatch.setenv("FINETUNE_STORE", scratch["env"]["FINETUNE_STORE"])
    folder = checkout(scratch["base"], doc)
    problems = [p for b in blocks(doc) if b.lang == "yaml" and not b.marker.skip
                for p in yaml_problems(b, folder, ROOT / "pipeline.yaml")]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ names a doc mentions


def known_settings() -> set[str]:
    """Every setting of the schema, and the keys of its mappings that name splits (data.subset.train)."""
    rows = reference.rows(PipelineConfig, "")
    return {n for n, _ in rows} | {f"data.subset.{s}" for s in ("train", "validation", "test")}


def test_every_test_and_bench_file_a_doc_names_exists():
    missing = [p for doc in DOCS if doc != HISTORY
               for p in missing_paths(doc.read_text(), ROOT, str(doc.relative_to(ROOT)))]
    assert not missing, "\n".join(missing)


def test_every_setting_a_doc_names_is_in_the_schema():
    known = known_settings()
    unknown = [p for doc in DOCS if doc != HISTORY
               for p in unknown_settings(doc.read_text(), known, str(doc.relative_to(ROOT)))]
    assert not unknown, "\n".join(unknown)


def test_the_pipeline_table_lists_every_pipeline_of_pipeline_yaml():
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("| pipeline | what |", 1)[1].split("\n\n", 1)[0]
    listed = {name for row in table.splitlines() if row.startswith("| `")
              for name in re.findall(r"`([\w-]+)`", row.split("|")[1])}
    names = set(yaml.safe_load((ROOT / "pipeline.yaml").read_text())["pipelines"])
    assert not names - listed, f"docs/configuration.md's pipeline table lacks {sorted(names - listed)}: add a row"
    assert not listed - names, f"docs/configuration.md's pipeline table lists {sorted(listed - names)}: gone"


# ------------------------------------------------------------------ the runner itself


def test_a_renamed_test_file_test_or_bench_a_doc_names_is_reported_with_where_it_went():
    text = ("Run `pytest -s tests/stages/test_batching.py` and\n"
            "`tests/stages/test_train.py::test_no_such_test`, then `bench/no_such_bench.py`.\n")
    assert missing_paths(text, ROOT, "doc.md") == [
        "doc.md:1: tests/stages/test_batching.py does not exist; it is tests/common/test_batching.py now",
        "doc.md:2: tests/stages/test_train.py has no test test_no_such_test",
        "doc.md:2: bench/no_such_bench.py does not exist"]


def test_a_renamed_setting_a_doc_names_is_reported_and_files_and_code_are_not_settings():
    text = "Set `train.max_stepz` and `export.gguf_types`; `stages/train.py`, `model.safetensors`, " \
           "`model.generate(**batch)`.\n```python\nmodel.eval_mode = 1\n```\n`data.subset.train`\n"
    assert unknown_settings(text, known_settings(), "doc.md") == [
        "doc.md:1: train.max_stepz is no setting; did you mean train.max_steps?"]


def test_a_marker_without_a_reason_or_unknown_is_refused():
    for marker, says in [("skip", "a skip says why"), ("run it please", "unknown test marker")]:
        with pytest.raises(MarkerError, match=says):
            blocks(Path("doc.md"), f"<!-- test: {marker} -->\n```bash\necho hi\n```\n")
    b = blocks(Path("doc.md"), "<!-- test: replace 'demo' 'tiny-imdb' -->\n```bash\nfinetune run bloom\n```\n")[0]
    with pytest.raises(MarkerError, match="replace 'demo': not in the block"):
        b.runnable_text()


def test_a_command_that_fails_or_prints_another_line_than_the_doc_fails_the_block(tmp_path):
    doc = Path("doc.md")
    text = ("<!-- test: skip 'rm ' — never -->\n```bash\nexport X=1\necho ok $X   # a comment\nrm -rf /nothing\n"
            "sh -c 'exit 3'\n```\n\n```console\n$ echo error: one \\\n    line\nerror: one line\n"
            "$ echo error: another line\nerror: the doc's line\n```\n")
    bash, console = blocks(doc, text)
    problems, ran, skipped = run_block(bash, tmp_path, dict(os.environ))
    assert (ran, skipped) == (3, 1) and len(problems) == 1 and "`sh -c 'exit 3'` exited 3" in problems[0]
    problems, ran, _ = run_block(console, tmp_path, dict(os.environ))
    assert ran == 2 and len(problems) == 1 and "`echo error: another line` printed" in problems[0]
    assert problem(commands(bash)[0], 1, "Traceback (most recent call last):\n  boom") is not None


def test_a_yaml_block_the_loader_refuses_or_that_is_not_pipeline_yaml_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    text = ("<!-- test: file mine.yaml -->\n```yaml\npipelines:\n  mine: {extends: tiny-imdb, train: {lr: 2}}\n```\n\n"
            "<!-- test: excerpt of pipeline.yaml pipelines.tiny-imdb -->\n```yaml\ntrain: {lr: 1.0e-3, epochs: 3}\n```\n"
            "\n```yaml\nsweeps:\n  s: {pipeline: tiny-imdb, grid: {train.lrr: [1, 2]}}\n```\n")
    own, excerpt, sweep = blocks(Path("doc.md"), text)
    [p] = yaml_problems(own, tmp_path, ROOT / "pipeline.yaml")
    assert p.startswith("doc.md:2: mine.yaml: ") and "train.lr" in p
    assert yaml_problems(excerpt, tmp_path, ROOT / "pipeline.yaml") == [
        "doc.md:8: pipeline.yaml pipelines.tiny-imdb: train.epochs: not in the file"]
    [p] = yaml_problems(sweep, tmp_path, ROOT / "pipeline.yaml")
    assert p.startswith("doc.md:12: sweep s: ") and "lrr" in p
