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
     "error: --set train.select_best.metric: validation of model.task seq_cls does not compute val_rougeL; use one "
     "of val_loss, val_accuracy, val_macro_f1"),
    (["flows.finetune", "mine", "--config", "{dir}/mine.yaml"], {},
     "error: {dir}/data/reviews.csv: line 4, column 'sentiment': empty label; give every row its class (or remove "
     "the row)"),
]


@pytest.mark.parametrize("argv,env,line", PLAN_ERRORS, ids=["hub-tokenizer", "metric", "select_best", "label"])
def test_plan_time_errors_print_one_line_before_prefect_and_the_store(tmp_path, argv, env, line):
    """Known from the config and its inputs: one line, exit 2, printed once, with no store written (no events,
    refs or artifacts) and Prefect never started (no PREFECT_HOME, no server: PREFECT_API_URL unset)."""
    import subprocess
    import sys

    from helpers import ROOT

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "reviews.csv").write_text("review,sentiment\ngood film,pos\nbad film,neg\nmeh,\nfine,pos\n")
    (tmp_path / "mine.yaml").write_text("pipelines:\n  mine:\n    extends: tiny-imdb\n    data: {source: local, path: "
                                        "data/reviews.csv, text_column: review, label_column: sentiment, subset: null, "
                                        "split: {mode: source, validation: 1, test: 1}}\n    model: {num_labels: null}\n")
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    full = {"PATH": "/usr/bin:/bin", "FINETUNE_STORE": str(tmp_path / "store"), "HF_HUB_OFFLINE": "1",
            "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, line.replace("{dir}", str(tmp_path)), "")
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()
