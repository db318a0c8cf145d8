"""What the upstream hash check costs: before a stage computes, the store checks the sha256 of every file of
its upstream artifacts (Store.check_upstream, through the hash memo). For each stage of a pipeline already in
the store, the check timed cold (a fresh memo: every upstream file read and hashed, as the first computing
stage after a commit pays) and warm (the memo filled: a stat per file), against the stage's own compute time
from its manifest.

    .venv/bin/python bench/upstream_check.py demo            # after `make demo` (FINETUNE_STORE to change store)
    .venv/bin/python bench/upstream_check.py --smoke         # tiny-imdb on 32 reviews, run first (a hit if stored)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import header, parser, row  # noqa: E402

SMOKE = ("tiny-imdb", ["data.subset={train: 32, validation: 8, test: 8}", "train.max_steps=2"])


def main() -> None:
    p = parser(__doc__)
    p.add_argument("pipeline", nargs="?", help="a pipeline the store holds (--smoke: tiny-imdb, run first)")
    args = p.parse_args()
    if not (args.pipeline or args.smoke):
        p.error("give the pipeline to check, e.g. demo (after make demo), or --smoke")

    from stages.engine.fingerprint import HashMemo
    from stages.engine.remote_store import open_store
    from stages.engine.runner import execute
    from stages.engine.units import human_bytes
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    if args.smoke:
        args.pipeline = SMOKE[0]
        cfg = load_pipeline(*SMOKE)
        execute(GRAPH.plan(cfg, open_store()), open_store())
    store = open_store()
    refs = store.refs(args.pipeline)  # what the pipeline last ran, per stage
    if not refs:
        raise SystemExit(f"{args.pipeline}: nothing in store {store.root}; run it first (make demo)")
    print(f"pipeline {args.pipeline}, store {store.root}, load average {os.getloadavg()[0]:.2f}")
    header(["stage", "upstream bytes", "cold check", "warm check", "stage compute", "cold/compute"])
    for stage, key in refs.items():
        manifest = store.read_manifest(stage, key)
        if manifest is None or not manifest.get("upstream"):
            continue
        sk = SimpleNamespace(stage=stage, upstream={u: v["key"] for u, v in manifest["upstream"].items()})
        size = sum(store.size(s, k) for s, k in sk.upstream.items())
        store._hashes = HashMemo(None)  # cold: nothing remembered
        t0 = time.perf_counter()
        store.check_upstream(sk)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.check_upstream(sk)
        warm = time.perf_counter() - t0
        compute = float(manifest.get("duration_s") or 0)
        share = f"{100 * cold / compute:.2f}%" if compute else "-"
        row([stage, human_bytes(size), f"{cold:.3f} s", f"{warm:.4f} s", f"{compute:.1f} s", share])


if __name__ == "__main__":
    main()
