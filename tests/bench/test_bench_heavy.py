"""The bench smokes of a minute and more (a Prefect sweep, a Prefect server with moto and two workers, TRL's trainer,
a 49k-token GGUF tokenizer, five stopped runs): as tests/bench/test_benches.py, in a file of their own so that the
suite's two workers (one file each at a time) share the smokes."""

from __future__ import annotations

import re

import pytest
from helpers import needs_shared_data
from smokes import TRL, labels, number, smoke, table


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


@needs_shared_data
@pytest.mark.slow
@pytest.mark.cluster
def test_reproduce_accumulation_smoke(tmp_path, prefect_server):  # a Prefect sweep of three child runs
    # on the worker's Prefect server: no temporary server started for it (~7 CPU-s; the flows' own tests have those)
    t = table(smoke("reproduce_accumulation.py", tmp_path, env={"PREFECT_API_URL": prefect_server}), "")
    assert len(t[1]) == 3


@needs_shared_data
@pytest.mark.slow
@pytest.mark.cluster
def test_scale_out_smoke(tmp_path, prefect_server):  # moto's S3 server and two workers, on the worker's Prefect server
    out = smoke("scale_out.py", tmp_path, "--work", str(tmp_path / "work"), "--api", prefect_server)
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
