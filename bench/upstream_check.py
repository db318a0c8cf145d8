"""What the upstream hash check costs: before a stage computes, the store checks the sha256 of every file of
its upstream artifacts (Store.check_upstream, through the hash memo). For each stage of a pipeline already in
the store, the check timed cold (a fresh memo: every upstream file read and hashed, as the first computing
stage after a commit pays) and warm (the memo filled: a stat per file), against the stage's own compute time
from its manifest.

    .venv/bin/python bench/upstream_check.py demo            # after `make demo` (FINETUNE_STORE to change store)
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

from stages.engine.fingerprint import HashMemo
from stages.engine.remote_store import open_store
from stages.engine.units import human_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pipeline")
    args = p.parse_args()
    store = open_store().local
    refs = store.refs(args.pipeline)  # what the pipeline last ran, per stage
    if not refs:
        raise SystemExit(f"{args.pipeline}: nothing in store {store.root}; run it first (make demo)")
    print(f"pipeline {args.pipeline}, store {store.root}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'stage':10} {'upstream bytes':>14} {'cold check':>11} {'warm check':>11} {'stage compute':>14} "
          f"{'cold/compute':>13}")
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
        print(f"{stage:10} {human_bytes(size):>14} {cold:10.3f}s {warm:10.4f}s {compute:13.1f}s {share:>13}")


if __name__ == "__main__":
    main()
