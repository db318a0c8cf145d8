"""Every bench (bench/*.py) at its smoke size, `python bench/X.py --smoke`, in a process of its own on a fresh store:
it exits 0 and prints its tables, header and rows, each row's label as the full run names it (figures are parsed,
never compared with numbers). Also: `--help` on every bench answers before torch is imported; a missing optional
dependency is one line naming its extra, exit 2; and a bench without a smoke test here or in test_bench_heavy.py
(the smokes of a minute and more, a file of their own so that the suite's two workers share them) fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAULTY_LLAMA_CPP, ROOT, needs_shared_data
from smokes import BENCH, BENCHES, bench, column, labels, number, smoke, table, tables


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """One store for the smokes that run tiny-imdb on the same settings (their first stages computed once: the
    file's tests run in one process, in order)."""
    return tmp_path_factory.mktemp("bench-smokes") / "store"


# ---------------------------------------------------------------- one smoke test per bench


@needs_shared_data
@pytest.mark.slow
@pytest.mark.cluster
def test_cached_rerun_smoke(tmp_path, shared):  # three flows.finetune/Prefect processes, each with its temporary server
    out = smoke("cached_rerun.py", tmp_path, store=shared)
    t = table(out, "run (tiny-imdb")
    assert labels(t) == ["cached pipeline run", "7-task no-op flow"]
    assert number(column(t, "vs no-op")[1]) == 1.0 and number(column(t, "vs no-op")[0]) > 0


def test_memory_table_smoke(tmp_path):
    out = smoke("memory_table.py", tmp_path)
    t = table(out, "configuration")
    assert labels(t) == ["base (fp32)", "NF4 + double quant (fp16 load: wo fp32)", "QLoRA r=32 on v,o + lm_head",
                         "NF4 incl. wo (bf16 compute)", "QLoRA incl. wo", "NF4, bf16 load (transformers 5: wo bf16)"]
    footprints = [number(c) for c in column(t, "footprint (bytes)")]
    assert footprints[1] < footprints[0]  # NF4 is smaller than fp32, even on a tiny T5
    assert "NF4 reduction" in out


@needs_shared_data
def test_packing_smoke(tmp_path):
    t = table(smoke("packing.py", tmp_path), "variant")
    assert labels(t) == ["unpacked, length-grouped", "unpacked, random order", "packed"]
    assert len({r[1] for r in t[1]}) == 1  # the same real tokens in every variant


@needs_shared_data
def test_parallel_cpu_smoke(tmp_path):
    t = table(smoke("parallel_cpu.py", tmp_path), "work")
    assert len(t[1]) == 5 and column(t, "identical") == ["yes"] * 5


@needs_shared_data
def test_plan_overhead_smoke(tmp_path):
    out = smoke("plan_overhead.py", tmp_path)
    t = table(out, "run")
    assert len(t[1]) == 3 and len(set(column(t, "model key"))) == 1
    assert "keys equal: True" in out


@needs_shared_data
def test_precision_imdb90_smoke(tmp_path):
    out = smoke("precision_imdb90.py", tmp_path)
    t = table(out, "precision")
    assert labels(t) == ["fp32", "bf16"] and number(column(t, "vs fp32 (CPU)")[0]) == 1.0
    assert "projection (not a measurement)" in out


@needs_shared_data
@pytest.mark.slow
def test_predict_smoke(tmp_path, shared):  # ~20 CPU-s: three fresh processes time the start-up
    out = smoke("predict.py", tmp_path, store=shared)
    t = table(out, "threads")
    assert [r[1] for r in t[1]] == ["pipeline() defaults", "pipeline(batch_size=8)", "finetune predict (torch)",
                                    "ONNX fp32 (--runtime onnx)", "ONNX int8 (--runtime onnx-int8)"]
    assert all(c == "8/8" for c in column(t, "labels as pipeline()")[:3])  # torch paths agree with pipeline()
    assert len(table(out, "start-up")[1]) == 3


@needs_shared_data
def test_predict_batch_smoke(tmp_path, shared):
    out = smoke("predict_batch.py", tmp_path, store=shared)
    t = table(out, "threads")
    assert labels(t) == ["1", "2"] and all(number(c) > 0 for r in t[1] for c in r[1:6])
    assert "profile of one pass" in out


@pytest.fixture(scope="module")
def titles(tmp_path_factory) -> Path:
    """The store of bench/predict_generation.py's smoke export (a tiny llama, hf + gguf), which bench/serve.py's
    smoke serves: computed once, by whichever of the two runs first."""
    return tmp_path_factory.mktemp("bench-titles") / "store"


@needs_shared_data
@pytest.mark.slow
def test_predict_generation_smoke(tmp_path, titles):  # ~30 CPU-s: a GGUF export, then the bench twice
    """Then again (the export cached) with llama.cpp killed by SIGILL on loading the q8_0 file, what its AMX kernels
    do on a VM that advertises AMX (tests/stages/test_export_gguf.py): that row says so, the others are measured."""
    paths = ["predict (torch), one at a time", "predict (torch), batched", "--runtime gguf (f16, llama.cpp)",
             "--runtime gguf-q8_0 (llama.cpp)"]
    out = smoke("predict_generation.py", tmp_path, store=titles)
    t = table(out, "threads")
    assert [r[1] for r in t[1]] == paths and column(t, "best s")[3] != "failed", out[-3000:]

    (tmp_path / "faulty" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "faulty" / "llama_cpp" / "__init__.py").write_text(FAULTY_LLAMA_CPP)
    p = bench("predict_generation.py", "--smoke", store=titles,
              env={"PYTHONPATH": str(tmp_path / "faulty"), "CRASH_ON": "model-q8_0.gguf", "CRASH_SIGNAL": "SIGILL"})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr[-3000:]
    t = table(p.stdout, "threads")
    assert [r[1] for r in t[1]] == paths
    assert [c == "failed" for c in column(t, "best s")] == [False, False, False, True]
    assert "SIGILL" in t[1][3][-1]


@needs_shared_data
@pytest.mark.slow
def test_serve_smoke(tmp_path, titles):  # two servers (torch, llama.cpp) on predict_generation's smoke export
    t = table(smoke("serve.py", tmp_path, store=titles), "runtime")
    assert [r[:2] for r in t[1]] == [[rt, mode] for rt in ("torch (batched generate)", "gguf (f16, llama.cpp)")
                                     for mode in ("one at a time", "concurrent")]
    assert column(t, "answered") == ["8/8"] * 4 and column(t, "identical to one at a time")[1::2] == ["8/8"] * 2
    assert all(number(x) > 0 for x in column(t, "answers/s"))


def test_predict_seq2seq_smoke(tmp_path):
    t = table(smoke("predict_seq2seq.py", tmp_path), "path")
    assert labels(t) == ["torch batched (8, KV cache)", "torch one at a time (KV cache)", "ONNX fp32 (8, no KV cache)",
                         "ONNX int8 (8, no KV cache)"]
    assert column(t, "texts as torch batched")[0] == "4/4"


@needs_shared_data
@pytest.mark.slow
def test_run_overhead_smoke(tmp_path):  # ~25 CPU-s: two processes that import torch, transformers, datasets, peft
    t = table(smoke("run_overhead.py", tmp_path), "")
    assert t[0][1:] == ["before", "now", "saved"] and len(t[1]) == 3


def test_suite_census_smoke(tmp_path):
    out = smoke("suite_census.py", tmp_path)
    assert "pytest exit 0" in out
    kinds = table(out, "processes running")
    assert "pytest" in labels(kinds)
    tests = table(out, "test")
    assert labels(tests) == ["tests/common/test_progress.py::"
                             "test_a_log_that_is_not_a_terminal_gets_lines_never_carriage_returns"]


@needs_shared_data
@pytest.mark.slow
def test_tracking_overhead_smoke(tmp_path, shared):  # an MLflow server and three `python -m stages` processes
    t = table(smoke("tracking_overhead.py", tmp_path, store=shared), "tracking")
    assert labels(t) == ["off", "on", "on / off"]


@needs_shared_data
def test_train_throughput_smoke(tmp_path):
    out = smoke("train_throughput.py", tmp_path)
    t = table(out, "variant")
    assert [(r[0][:3], r[1]) for r in t[1]] == [(v, p) for v in ("(a)", "(b)", "(c)", "(d)") for p in ("fp32", "bf16")]
    for prec in ("fp32", "bf16"):
        assert f"(c) vs (d) in steady state, {prec}" in out
    assert len([h for h, _ in tables(out) if h[0] == "clock"]) == 2


@needs_shared_data
def test_upstream_check_smoke(tmp_path, shared):
    t = table(smoke("upstream_check.py", tmp_path, store=shared), "stage")
    assert set(labels(t)) >= {"tokenize", "train", "evaluate", "export"}


# ---------------------------------------------------------------- every bench: --help, a missing extra, a test


HELP = """
import os, runpy, sys
sys.argv = [sys.argv[1], "--help"]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python bench/X.py` has it
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    print("EXIT", e.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize("name", BENCHES)
def test_help_answers_before_torch_is_imported(name):
    p = subprocess.run([sys.executable, "-c", HELP, str(BENCH / name)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.startswith("usage:") and "--smoke" in p.stdout, p.stdout + p.stderr
    assert p.stdout.strip().endswith("EXIT 0 False"), p.stdout[-500:]


def test_gpu_sh_answers_help_and_runs_nothing(tmp_path):
    """bench/gpu.sh needs a GPU machine: the suite runs its --help only (its bench is train_throughput's smoke)."""
    p = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "OUT": str(tmp_path / "out")})
    assert p.returncode == 0 and "bash bench/gpu.sh prepare" in p.stdout and not p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, module, extra", [("sft.py", "trl", "bench"),
                                                 ("predict_seq2seq.py", "onnxruntime", "onnx"),
                                                 ("predict_generation.py", "llama_cpp", "gguf"),
                                                 ("tracking_overhead.py", "mlflow", "mlflow")])
def test_a_missing_optional_dependency_is_one_line_naming_its_extra(tmp_path, name, module, extra):
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
    p = bench(name, "--smoke", store=tmp_path / "store", env={"PYTHONPATH": str(tmp_path)}, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"needs {module} (the {extra} extra)" in p.stderr and f"pip install -e '.[{extra}]'" in p.stderr


def test_every_bench_has_a_smoke_test():
    defined = "".join(f.read_text() for f in Path(__file__).parent.glob("test_*.py"))
    missing = [b for b in BENCHES if f"def test_{Path(b).stem}_smoke(" not in defined]
    assert not missing, f"benches without a smoke test in tests/bench/: {', '.join(missing)}"
    assert len(BENCHES) >= 20  # the glob found them
