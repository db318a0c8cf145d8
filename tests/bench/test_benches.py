"""Every bench (bench/*.py) at its smoke size, `python bench/X.py --smoke`, in a process of its own on a fresh store:
it exits 0 and prints its tables, header and rows, each row's label as the full run names it (figures are parsed,
never compared with numbers). Also: `--help` on every bench answers before torch is imported; a missing optional
dependency is one line naming its extra, exit 2; and a bench without a smoke test here fails the suite."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, needs_shared_data

BENCH = ROOT / "bench"
BENCHES = sorted(p.name for p in BENCH.glob("*.py") if p.name != "benchlib.py")
TRL = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                         reason="TRL is not installed (the bench extra: pip install -e '.[bench]')")

Table = tuple[list[str], list[list[str]]]

# The installed llama_cpp, except that loading the file named by $CRASH_ON kills the process with $CRASH_SIGNAL
# (as tests/stages/test_export_gguf.py has it): what llama.cpp's AMX kernels do on a VM that advertises AMX.
FAULTY_LLAMA_CPP = """
import os, signal, sys
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
import llama_cpp as _real

class Llama(_real.Llama):
    def __init__(self, model_path, **kw):
        if os.path.basename(model_path) == os.environ["CRASH_ON"]:
            os.kill(os.getpid(), getattr(signal, os.environ["CRASH_SIGNAL"]))
        super().__init__(model_path=model_path, **kw)

_real.Llama = Llama
"""


def bench(name: str, *args: str, store: Path | None = None, env: dict[str, str] | None = None,
          timeout: int = 540) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            **({"FINETUNE_STORE": str(store)} if store else {}), **(env or {})}
    return subprocess.run([sys.executable, str(BENCH / name), *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """One store for the smokes that run tiny-imdb on the same settings (their first stages computed once: the
    file's tests run in one process, in order)."""
    return tmp_path_factory.mktemp("bench-smokes") / "store"


def smoke(name: str, tmp_path: Path, *args: str, store: Path | None = None) -> str:
    """The bench's --smoke run on a fresh store (or `store`): its stdout, after checking it ended well."""
    p = bench(name, "--smoke", *args, store=store or tmp_path / "store")
    assert p.returncode == 0, f"{name} --smoke: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p.stdout


def tables(out: str) -> list[Table]:
    """The markdown tables in `out`: (header cells, rows of cells); each row has the header's width."""
    found, lines = [], out.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()) and \
                (i == 0 or not lines[i - 1].startswith("|")):
            head = cells(line)
            rows = []
            for r in lines[i + 2:]:
                if not r.startswith("|"):
                    break
                rows.append(cells(r))
                assert len(rows[-1]) == len(head), f"a row of {len(rows[-1])} cells under {len(head)}: {r}"
            found.append((head, rows))
    return found


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(out: str, first: str) -> Table:
    """The table whose first header cell starts with `first`."""
    match = [t for t in tables(out) if t[0][0].startswith(first)]
    assert match, f"no table headed {first!r} in:\n{out[-3000:]}"
    return match[0]


def number(cell: str) -> float:
    """A cell's figure: '1,234', '0.52 s', '1.10x', '4.0%', '3/8' (-> 3)."""
    m = re.match(r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?", cell.replace(" ", ""))
    assert m, f"not a number: {cell!r}"
    return float(m.group().replace(",", ""))


def column(t: Table, name: str) -> list[str]:
    return [r[t[0].index(name)] for r in t[1]]


def labels(t: Table) -> list[str]:
    return [r[0] for r in t[1]]


# ---------------------------------------------------------------- one smoke test per bench


@needs_shared_data
@pytest.mark.slow
@pytest.mark.cluster
def test_cached_rerun_smoke(tmp_path, shared):  # three flows.finetune/Prefect processes, each with its temporary server
    out = smoke("cached_rerun.py", tmp_path, store=shared)
    t = table(out, "run (tiny-imdb")
    assert labels(t) == ["cached pipeline run", "7-task no-op flow"]
    assert number(column(t, "vs no-op")[1]) == 1.0 and number(column(t, "vs no-op")[0]) > 0


@needs_shared_data
@pytest.mark.slow
def test_faults_smoke(tmp_path):  # five `python -m stages` processes
    out = smoke("faults.py", tmp_path)
    t = table(out, "stage")
    assert [r[:2] for r in t[1]] == [["train", "SIGTERM"]]
    r = dict(zip(t[0], t[1][0], strict=True))
    assert r["traceback"] == "no" and r["verify"] == "ok" and r["rerun"].startswith("0: computed")


@pytest.mark.slow
def test_gguf_load_smoke(tmp_path):  # ~30 CPU-s: transformers reads a 49k-token GGUF tokenizer
    t = table(smoke("gguf_load.py", tmp_path), "part")
    assert labels(t) == ["config", "tokenizer", "model"]
    assert all(number(c) >= 0 for r in t[1] for c in r[1:])


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


@needs_shared_data
@pytest.mark.slow
def test_predict_generation_smoke(tmp_path):  # ~30 CPU-s: a GGUF export, then the bench twice
    """Then again (the export cached) with llama.cpp killed by SIGILL on loading the q8_0 file, what its AMX kernels
    do on a VM that advertises AMX (tests/stages/test_export_gguf.py): that row says so, the others are measured."""
    paths = ["predict (torch), one at a time", "predict (torch), batched", "--runtime gguf (f16, llama.cpp)",
             "--runtime gguf-q8_0 (llama.cpp)"]
    out = smoke("predict_generation.py", tmp_path)
    t = table(out, "threads")
    assert [r[1] for r in t[1]] == paths and column(t, "best s")[3] != "failed", out[-3000:]

    (tmp_path / "faulty" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "faulty" / "llama_cpp" / "__init__.py").write_text(FAULTY_LLAMA_CPP)
    p = bench("predict_generation.py", "--smoke", store=tmp_path / "store",
              env={"PYTHONPATH": str(tmp_path / "faulty"), "CRASH_ON": "model-q8_0.gguf", "CRASH_SIGNAL": "SIGILL"})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr[-3000:]
    t = table(p.stdout, "threads")
    assert [r[1] for r in t[1]] == paths
    assert [c == "failed" for c in column(t, "best s")] == [False, False, False, True]
    assert "SIGILL" in t[1][3][-1]


def test_predict_seq2seq_smoke(tmp_path):
    t = table(smoke("predict_seq2seq.py", tmp_path), "path")
    assert labels(t) == ["torch batched (8, KV cache)", "torch one at a time (KV cache)", "ONNX fp32 (8, no KV cache)",
                         "ONNX int8 (8, no KV cache)"]
    assert column(t, "texts as torch batched")[0] == "4/4"


@needs_shared_data
@pytest.mark.slow
@pytest.mark.cluster
def test_reproduce_accumulation_smoke(tmp_path):  # a Prefect sweep of three child runs
    t = table(smoke("reproduce_accumulation.py", tmp_path), "")
    assert len(t[1]) == 3


@needs_shared_data
@pytest.mark.slow
def test_run_overhead_smoke(tmp_path):  # ~25 CPU-s: two processes that import torch, transformers, datasets, peft
    t = table(smoke("run_overhead.py", tmp_path), "")
    assert t[0][1:] == ["before", "now", "saved"] and len(t[1]) == 3


@needs_shared_data
@pytest.mark.slow
@pytest.mark.cluster
def test_scale_out_smoke(tmp_path):  # a Prefect server, moto's S3 server and two workers
    out = smoke("scale_out.py", tmp_path, "--work", str(tmp_path / "work"))
    assert len(table(out, "")[1]) >= 2
    assert len(table(out, "CPU seconds (median)")[1]) == 4


@TRL
@needs_shared_data
@pytest.mark.slow
def test_sft_smoke(tmp_path):  # ~30 CPU-s: TRL's trainer built four times
    out = smoke("sft.py", tmp_path)
    assert re.search(r"tokenization: \d+ of \d+ rows differ", out) and "first-step loss" in out
    t = table(out, "variant")
    assert labels(t) == ["TRL unpacked", "ours unpacked", "TRL packed", "ours packed"]


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
    missing = [b for b in BENCHES if f"test_{Path(b).stem}_smoke" not in globals()]
    assert not missing, f"benches without a smoke test in {Path(__file__).name}: {', '.join(missing)}"
    assert len(BENCHES) >= 20  # the glob found them
