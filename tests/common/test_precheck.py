"""The pipeline-level memory estimate runs before the model stage computes and stops the run there."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
from helpers import computed, needs_shared_data, run

from stages.engine.errors import ConfigError

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 16, validation: 4, test: 4}",)


def test_training_that_cannot_fit_stops_before_loading(store_dir, monkeypatch):
    real = psutil.virtual_memory
    tiny = lambda: SimpleNamespace(available=1_000_000)  # noqa: E731  (1 MB of free RAM)
    monkeypatch.setattr(psutil, "virtual_memory", tiny)
    with pytest.raises(ConfigError) as exc:
        run("tiny-imdb", *SMALL, until="model")
    msg = str(exc.value)
    assert "pipeline tiny-imdb: estimated" in msg and "CPU RAM has 1.00 MB free" in msg and "accumulation" in msg
    assert not (store_dir / "model").exists()
    # with room, the same run goes through; once cached, no estimate is made
    monkeypatch.setattr(psutil, "virtual_memory", real)
    assert "model" in computed(run("tiny-imdb", *SMALL, until="model"))
    monkeypatch.setattr(psutil, "virtual_memory", tiny)
    assert computed(run("tiny-imdb", *SMALL, until="model")) == set()


def test_memory_check_false_skips_the_estimate(store_dir, monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 20))  # 1 MiB free
    assert "model" in computed(run("tiny-imdb", *SMALL, "model.memory_check=false", until="model"))


# ---------------------------------------------------------------- every check before anything runs

PLAN_ERRORS = [
    # (entry point args, env, the one line on stderr)
    (["flows.qlora_t5"], {},
     "error: stage tokenize: t5-3b@main is on the Hugging Face hub, which does not answer (or HF_HUB_OFFLINE is "
     "set), and not in its local cache; set tokenize.tokenizer (or model.name) to a local folder or "
     "pkg:PACKAGE/PATH, or run where the hub answers"),
    (["flows.finetune", "tiny-imdb", "--set", "evaluate.metrics=[acuracy]"], {},
     "error: evaluate.metrics acuracy: not one of the project's offline modules (accuracy, f1, rouge, exact_match) nor a local "
     "path, and the hub that would serve it does not answer; did you mean accuracy? list offline modules or the "
     "path of a local `evaluate` module"),
    (["flows.finetune", "tiny-imdb", "--set", "train.select_best={metric: val_rougeL}"], {},
     "error: train.select_best.metric: validation of method classify does not compute val_rougeL; use one "
     "of val_loss, val_accuracy, val_macro_f1"),
    (["flows.finetune", "mine", "--config", "{dir}/mine.yaml"], {},
     "error: {dir}/data/reviews.csv: line 4, column 'sentiment': empty label; give every row its class (or remove "
     "the row)"),
    (["flows.finetune", "clean", "--config", "{dir}/mine.yaml", "--set", "data.text_column=reveiw"], {},
     "error: {dir}/data/clean.csv: no column 'reveiw' (columns: review, sentiment); set data.text_column to one of "
     "them"),
    (["flows.finetune", "tiny-imdb", "--set", "data.text_column=review"], {},
     "error: {shared}/imdb/test.csv.gz: no column 'review' (columns: text, label); set data.text_column to one of "
     "them"),
    (["flows.finetune", "my-chat", "--config", "{dir}/mine.yaml", "--set", "data.messages_column=chat"], {},
     "error: {dir}/data/chats.jsonl: no column 'chat' (columns: conversations); set data.messages_column to the "
     "column holding the conversations"),
    (["flows.finetune", "clean", "--config", "{dir}/mine.yaml", "--set",
      "data.split={mode: shuffle_concat, seed: 1, train: 50, validation: 5, test: 5}"], {},
     "error: data.split asks for 60 rows (train 50 + validation 5 + test 5) but clean.csv has 10; set "
     "data.split.train=8, data.split.validation=1, data.split.test=1, or data.split={mode: source, validation: 0.1, "
     "test: 0.1}"),
    (["flows.finetune", "clean", "--config", "{dir}/mine.yaml", "--set", "data.split.test=0.95"], {},
     "error: data.split.test asks for 10 rows but train has only 10 (clean.csv); lower it or give a fraction "
     "below 1, e.g. data.split.test=0.1"),
    (["flows.finetune", "my-chat", "--config", "{dir}/mine.yaml"], {},
     "error: data.split asks for 50000 rows (train 35000 + validation 5000 + test 10000) but chats.jsonl has 150 "
     "(data.split comes from extends: smol-chat); set data.split.train=120, data.split.validation=15, "
     "data.split.test=15, or data.split={mode: source, validation: 0.1, test: 0.1}"),
]


def sharegpt_rows(n: int) -> str:
    """n ShareGPT conversations (`conversations` of {from, value}, roles human / gpt), as JSONL."""
    import json

    return "".join(json.dumps({"conversations": [
        {"from": "human", "value": f"Is {i} an even number? Answer yes or no."},
        {"from": "gpt", "value": "yes" if i % 2 == 0 else "no"}]}) + "\n" for i in range(n))


@pytest.mark.parametrize("argv,env,line", PLAN_ERRORS, ids=[
    "hub-tokenizer", "metric", "select_best", "label", "text-column", "mirror-text-column", "messages-column",
    "split-too-large", "carve-too-large", "split-inherited"])
def test_plan_time_errors_print_one_line_before_prefect_and_the_store(tmp_path, argv, env, line):
    """Known from the config and its inputs: one line, exit 2, printed once, with no store written (no events,
    refs or artifacts) and Prefect never started (no PREFECT_HOME, no server: PREFECT_API_URL unset)."""
    import subprocess
    import sys

    from helpers import ROOT, SHARED_DATA

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "reviews.csv").write_text("review,sentiment\ngood film,pos\nbad film,neg\nmeh,\nfine,pos\n")
    (tmp_path / "data" / "clean.csv").write_text("review,sentiment\n" + "".join(f"film {i},{'pos' if i % 2 else 'neg'}\n"
                                                                                 for i in range(10)))
    (tmp_path / "data" / "chats.jsonl").write_text(sharegpt_rows(150))
    local = ("text_column: review, label_column: sentiment, subset: null, split: {mode: source, validation: 1, "
             "test: 1}}\n    model: {num_labels: null}\n")
    (tmp_path / "mine.yaml").write_text(
        f"pipelines:\n  mine:\n    extends: tiny-imdb\n    data: {{source: local, path: data/reviews.csv, {local}"
        f"  clean:\n    extends: tiny-imdb\n    data: {{source: local, path: data/clean.csv, {local}"
        "  my-chat:\n    extends: smol-chat\n    data: {source: local, path: data/chats.jsonl, format: messages, "
        "messages_column: conversations, message_fields: {role: from, content: value}, roles: {human: user, "
        "gpt: assistant}}\n")
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    line = line.replace("{shared}", str(SHARED_DATA))
    full = {"PATH": "/usr/bin:/bin", "FINETUNE_STORE": str(tmp_path / "store"), "HF_HUB_OFFLINE": "1",
            "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, line.replace("{dir}", str(tmp_path)), "")
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()


def test_the_sharegpt_pipeline_of_docs_chat_md_runs_and_without_its_split_is_the_line_the_page_shows(tmp_path):
    """docs/chat.md's ShareGPT pipeline (extends smol-chat) on a 150-row file cuts its splits; with the split line
    removed, smol-chat's IMDB-sized split is refused before any stage runs with the line the page prints."""
    import json
    import re
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    page = (ROOT / "docs" / "chat.md").read_text()
    snippet = next(b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if "extends: smol-chat" in b)
    shown = next(b for b in re.findall(r"```\n(error: .*?)\n```", page, re.S) if "extends: smol-chat" in b)
    (tmp_path / "chats.jsonl").write_text(sharegpt_rows(150))
    (tmp_path / "mine.yaml").write_text(snippet)
    (tmp_path / "inherited.yaml").write_text("\n".join(x for x in snippet.splitlines() if "split:" not in x))
    store = tmp_path / "store"
    for config, code in (("inherited.yaml", 2), ("mine.yaml", 0)):
        p = subprocess.run([sys.executable, "-m", "stages", "my-chat", "--config", str(tmp_path / config),
                            "--until", "data"], cwd=tmp_path, env=subprocess_env(store, PYTHONPATH=str(ROOT)),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == code, p.stderr
        if code == 2:
            assert p.stderr.strip() == shown and not store.exists()
    manifest = json.loads(next((store / "data").glob("*/manifest.json")).read_text())
    assert manifest["metrics"]["rows"] == {"train": 121, "validation": 14, "test": 15}
