"""gc keeps what a user would call a result (issue 47): every child of a finished sweep and a `--set` variant
stay through `inspect gc --force`, though neither is a pipeline of the file nor the pipeline's last run (its
ref), until the user drops them by name (`--drop SWEEP`, `--drop NAME@ID`) or by age (`--older-than`). The
dry run lists what it keeps and what it would remove, grouped by pipeline and sweep, with sizes.

One store for the module: the two children of an ad-hoc sweep `lrs` (the plain runner under FINETUNE_SWEEP, as
the sweep flow runs its children; tests/flows/test_sweep.py runs one through Prefect) and then a `--set` variant
of the same pipeline, the last run (refs/tiny-imdb.json holds its keys, none of the sweep's train or evaluate).
Each test that removes works on its own copy of that store."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta

import pytest
from helpers import needs_shared_data, run_pipeline

from flows.inspect import main
from flows.reports.variants import adhoc_sweep, save_definition
from stages.engine.runs import SWEEP_ENV
from stages.engine.status import CACHED, lookups
from stages.engine.store import Store
from stages.engine.units import human_bytes
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline

pytestmark = needs_shared_data

SETS = ["data.subset={train: 16, validation: 4, test: 8}", "train.max_steps=2"]
VARIANT = [*SETS, "train.lr=5e-3"]
OWN = ("train", "evaluate")  # what each run has alone; data, tokenize, model and adapters all four share


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("gc-results") / "store"
    store = Store(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_STORE", str(root))
        sweep = adhoc_sweep("tiny-imdb", ["train.lr=1e-3,1e-2"], SETS, name="lrs")
        save_definition(sweep, store)  # what `finetune sweep ... --name lrs` keeps, for `compare --sweep lrs`
        mp.setenv(SWEEP_ENV, "lrs")
        children = [{o.stage: o.key for o in run_pipeline(r.cfg, store, until="evaluate")} for r in sweep.runs]
        mp.delenv(SWEEP_ENV)
        variant = {o.stage: o.key for o in run_pipeline(load_pipeline("tiny-imdb", VARIANT), store, until="evaluate")}
    assert store.refs("tiny-imdb") == variant  # the last run: the sweep's own artifacts are in no ref
    return root, children, variant


@pytest.fixture
def store(ran, tmp_path, monkeypatch):
    """A copy of the module's store, for a test that removes from it."""
    root = tmp_path / "store"
    shutil.copytree(ran[0], root)
    monkeypatch.setenv("FINETUNE_STORE", str(root))
    return Store(root)


def inspect(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def variant_cached(store: Store) -> bool:
    found = lookups(GRAPH.plan(load_pipeline("tiny-imdb", VARIANT), store, pinned=False), store)
    return all(found[s].hit and found[s].why == CACHED for s in ("data", "tokenize", "model", "adapters", *OWN))


def test_gc_force_keeps_every_child_of_a_sweep_and_a_set_variant(ran, store, capsys):
    _, children, variant = ran
    rc, out, _ = inspect(capsys, "gc", "--force", "--min-age", "0")
    assert rc == 0 and "nothing to remove: every artifact is kept" in out, out
    assert {(s, k) for s, k, _ in store.entries()} >= {sk for keys in [*children, variant] for sk in keys.items()}
    rc, out, _ = inspect(capsys, "compare", "--sweep", "lrs")
    assert rc == 0 and out.count("| done |") == 2 and "not run" not in out, out
    assert variant_cached(store)

    # what it keeps, by sweep and pipeline, with the artifact counts and sizes and the --drop that forgets each
    sizes = {sk: store.size(*sk) for keys in [*children, variant] for sk in keys.items()}
    in_sweep = {sk for keys in children for sk in keys.items()}
    assert len(in_sweep) == 4 + 2 * len(OWN)
    rc, out, _ = inspect(capsys, "gc", "--json")
    kept = json.loads(out)["kept"]
    sweep = [k for k in kept if k["group"] == "sweep lrs"]
    assert [(k["artifacts"], k["drop"][:4]) for k in sweep] == [(6, "lrs@")] * 2
    (mine,) = [k for k in kept if k["group"] == "pipeline tiny-imdb" and k["what"].startswith("variant ")]
    assert mine["what"] == "variant " + " ".join(VARIANT) and mine["drop"].startswith("tiny-imdb@")
    assert (mine["artifacts"], mine["size_bytes"]) == (6, sum(sizes[sk] for sk in variant.items()))

    rc, out, _ = inspect(capsys, "gc")
    lines = out.splitlines()
    assert lines[1].startswith(f"keeps {len(sizes)} artifacts, {human_bytes(sum(sizes.values()))}"), out
    row = next(ln for ln in lines if ln.startswith("sweep lrs (2 runs) "))
    assert row.split()[4:7] == [str(len(in_sweep)), *human_bytes(sum(sizes[sk] for sk in in_sweep)).split()]
    assert row.endswith("--drop lrs")
    assert any(ln.startswith("  variant data.subset=") and ln.endswith(f"--drop {mine['drop']}") for ln in lines)


def test_drop_a_sweep_then_its_own_artifacts_go_and_what_others_share_stays(ran, store, capsys):
    _, children, variant = ran
    own = {(s, k) for keys in children for s, k in keys.items() if s in OWN}
    rc, out, _ = inspect(capsys, "gc", "--drop", "lrs", "--min-age", "0")  # dry run: grouped under the sweep
    lines = out.splitlines()
    head = lines.index("would remove:")
    assert lines[head + 2] == f"sweep lrs: {len(own)}, {human_bytes(sum(store.size(*sk) for sk in own))}", out
    listed = {(ln.split()[1], ln.split()[2]) for ln in lines[head + 3:head + 3 + len(own)]}
    assert listed == {(s, k[:12]) for s, k in own} and all(ln.endswith("dropped") for ln in lines[head + 3:head + 3 + len(own)])
    assert "gc --force --drop lrs" in lines[-1]
    assert not any(ln.startswith("sweep lrs (") for ln in lines[:head])  # no longer among what it keeps

    rc, out, _ = inspect(capsys, "gc", "--force", "--drop", "lrs", "--min-age", "0")
    assert rc == 0 and f"removed {len(own)} of {len(own)}" in out, out
    assert all(store.problems(*sk) == ["not in store"] for sk in own)
    assert [r["sweep"] for _, r in store.results()] == [None]  # the sweep's records went with it
    rc, out, _ = inspect(capsys, "compare", "--sweep", "lrs")
    assert rc == 1 and out.count("| not run |") == 2
    assert variant_cached(store)  # the stages it shared with the sweep stay: the --set variant keeps them

    # one result by the NAME@ID the dry run shows: what of it the file's tiny-imdb does not reach goes too
    rc, out, _ = inspect(capsys, "gc", "--json")
    (handle,) = [k["drop"] for k in json.loads(out)["kept"] if k["what"].startswith("variant ")]
    rc, out, _ = inspect(capsys, "gc", "--force", "--drop", handle, "--min-age", "0", "--json")
    current = {(i.key.stage, i.key.key) for i in GRAPH.plan(load_pipeline("tiny-imdb"), store, pinned=False).items}
    assert {(g["stage"], g["key"]) for g in json.loads(out)["items"] if g["removed"]} == set(variant.items()) - current
    assert store.results() == [] and {s for s, _ in set(variant.items()) & current} == {"model", "adapters"}

    rc, _, err = inspect(capsys, "gc", "--drop", "lrs")
    assert rc == 2 and err.strip().splitlines() == [
        f"error: --drop lrs: no sweep, pipeline or result of that name on store {store} (sweeps: none; "
        "pipelines: tiny-imdb; a result's NAME@ID is in gc's dry run)"]

    # a damaged record stops gc (what it keeps would be a guess): one line, nothing removed
    (store.root / "results" / "0123456789ab.json").write_text('{"id": "0123456789ab", "keys": []}')
    before = sorted(store.root.rglob("*"))
    rc, _, err = inspect(capsys, "gc", "--force", "--min-age", "0")
    assert rc == 2 and err.strip().splitlines() == [
        f"error: store {store}: results/0123456789ab.json is not a result record (pipeline: Field required); "
        "delete it (gc then no longer keeps what that run made) or restore it"]
    assert sorted(store.root.rglob("*")) == before


def test_older_than_forgets_the_results_last_made_before_that_age(ran, store, capsys):
    _, children, variant = ran
    long_ago = (datetime.now(UTC) - timedelta(days=40)).isoformat()
    for rid, record in store.results():  # the sweep's children as if they had run 40 days ago
        if record["sweep"] == "lrs":
            store.write_result(rid, {**record, "updated": long_ago})
    own = {(s, k) for keys in children for s, k in keys.items() if s in OWN}

    rc, out, _ = inspect(capsys, "gc", "--older-than", "60d", "--min-age", "0", "--json")
    assert json.loads(out)["items"] == []
    rc, out, _ = inspect(capsys, "gc", "--older-than", "30d", "--min-age", "0", "--json")
    items = json.loads(out)["items"]
    assert {(g["stage"], g["key"]) for g in items} == own
    assert {(g["group"], g["note"]) for g in items} == {("sweep lrs", "older than --older-than")}
    rc, out, _ = inspect(capsys, "gc", "--older-than", "30d", "--min-age", "0")
    assert "finetune inspect gc --force --older-than 30d --min-age 0" in out.splitlines()[-1]

    rc, out, _ = inspect(capsys, "gc", "--force", "--older-than", "4w", "--min-age", "0")
    assert rc == 0 and f"removed {len(own)} of {len(own)}" in out
    assert [r["sweep"] for _, r in store.results()] == [None] and variant_cached(store)

    rc, _, err = inspect(capsys, "gc", "--older-than", "30 days")
    assert rc == 2 and err.strip() == "error: --older-than 30 days: write a number and a unit, e.g. 30d, 12h, 90m, 2w"
