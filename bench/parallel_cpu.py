"""The project's CPU-parallel work with joblib against the serial path, on real data, in one run:

    ROUGE         100 real billsum bills x 20 predictions each (2,000 pairs; each prediction is the bill's
                  first 20, 25, ... 115 words after its title section) scored by the shipped `evaluate` module
    tarball       aclImdb_v1.tar.gz with the 50,000 real IMDB reviews (built from the mirror's CSVs and its
                  file index, once, under --work): decompressed by one thread while another walks the tar;
                  also against the reader before issue 15 (tarfile.extractfile per member, one thread)
    folder        the same 50,000 files extracted: read by joblib threads
    hashing       sha256 of those 50,000 files (stages.engine.fingerprint.sha256_many), no memo reuse

Each row checks that both paths give identical results and prints the speedup:

    nice -n 19 .venv/bin/python bench/parallel_cpu.py [--jobs N] [--work DIR] [--repeat K]
    .venv/bin/python bench/parallel_cpu.py --smoke   # 5 bills, 400 reviews, 2 workers, once, a temporary --work
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, row  # noqa: E402


def cli() -> argparse.ArgumentParser:
    p = parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=None, help="parallel workers (default: the available cores)")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / ".bench" / "parallel_cpu",
                   help="where the built tarball and its extracted folder are kept between runs")
    p.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is shown")
    return p


if __name__ == "__main__":
    cli().parse_args()  # --help and a bad flag answered before the heavy imports below

from stages.engine.fingerprint import HashMemo, sha256_many  # noqa: E402
from stages.engine.parallel import available_cores, n_jobs  # noqa: E402
from stages.methods import metrics  # noqa: E402
from stages.sources import aclimdb  # noqa: E402

MIRROR = ROOT.parent / "shared" / "data"


def build_tarball(out: Path, reviews: int | None = None) -> Path:
    """aclImdb_v1.tar.gz (train/test x pos/neg, the original file names) from the mirror's 50k reviews (`reviews`:
    a seeded sample of them)."""
    import pandas as pd

    path = out / "aclImdb_v1.tar.gz"
    if path.is_file():
        return path
    out.mkdir(parents=True, exist_ok=True)
    index = pd.read_csv(MIRROR / "imdb" / "imdb_file_index.csv.gz")
    if reviews:
        index = index.sample(n=reviews, random_state=0)
    texts = {s: pd.read_csv(MIRROR / "imdb" / f"{s}.csv.gz", keep_default_na=False)["text"].tolist()
             for s in ("train", "test")}
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for row in index.itertuples():
            data = texts[row.csv_file.split(".")[0]][row.row].encode()
            info = tarfile.TarInfo(row.orig_file)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(path)
    return path


def extract(tarball: Path, out: Path) -> Path:
    folder = out / "aclImdb"
    if not (folder / "train" / "pos").is_dir():
        with tarfile.open(tarball) as tar:
            tar.extractall(out, filter="data")
    return folder


def tarball_before(path: Path) -> list[tuple[str, str, str, str]]:
    """The members as the data stage read them before issue 15: extractfile per member, one thread."""
    out = []
    with tarfile.open(path) as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 4 and parts[1] in ("train", "test") and parts[2] in ("pos", "neg"):
                out.append((parts[1], parts[2], parts[3], tar.extractfile(m).read().decode("utf-8")))
    return out


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def same_frames(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].equals(b[k]) for k in a)


def main(argv: list[str] | None = None) -> int:
    args = cli().parse_args(argv)
    bill_count, reviews = 100, None
    if args.smoke:  # every row on a few items: 5 bills x 20 predictions, 400 reviews
        args.jobs, args.repeat, bill_count, reviews = 2, 1, 5, 400
        args.work = Path(tempfile.mkdtemp(prefix="parallel-cpu-smoke-"))
    jobs = n_jobs(args.jobs)
    if jobs < 2:
        print("only one core available: nothing to compare (set --jobs 2)")
        return 1

    bills = [json.loads(ln) for ln in
             (MIRROR / "billsum" / "billsum_us_train_sample100.jsonl").read_text().splitlines()][:bill_count]
    preds, refs = [], []
    for b in bills:
        words = b["text"].split("SEC. 2.", 1)[-1].split()
        for k in range(20):
            preds.append(" ".join(words[: 20 + 5 * k]))
            refs.append(b["summary"])
    tarball = build_tarball(args.work, reviews)
    folder = extract(tarball, args.work)
    files = sorted(folder.rglob("*.txt"))

    rows = []

    def measure(task: str, items: str, serial: Callable[[], Any], parallel: Callable[[], Any],
                same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> None:
        t1, r1 = timed(serial, args.repeat)
        tn, rn = timed(parallel, args.repeat)
        rows.append((task, items, t1, tn, t1 / tn, same(r1, rn)))
        print(f"  {task}: serial {t1:.2f} s, {jobs} workers {tn:.2f} s", flush=True)

    measure("ROUGE-1/2/L/Lsum (evaluate module)", f"{len(preds):,} pairs",
            lambda: metrics.rouge(preds, refs, jobs=1), lambda: metrics.rouge(preds, refs, jobs=jobs))
    n = f"{reviews or 50_000:,} reviews"
    measure("read aclImdb_v1.tar.gz", n, lambda: aclimdb.read_tarball(tarball, jobs=1),
            lambda: aclimdb.read_tarball(tarball, jobs=jobs), same_frames)
    measure("tar members: before issue 15 -> now", n, lambda: tarball_before(tarball),
            lambda: aclimdb._read_tar_members(tarball, jobs=jobs))
    measure("read aclImdb/ folder", f"{len(files):,} files", lambda: aclimdb.read_folder(folder, jobs=1),
            lambda: aclimdb.read_folder(folder, jobs=jobs), same_frames)
    measure("sha256 of input files", f"{len(files):,} files", lambda: sha256_many(files, HashMemo(), jobs=1),
            lambda: sha256_many(files, HashMemo(), jobs=jobs))

    print(f"\n{available_cores()} cores available, {jobs} workers; best of {args.repeat}; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    header(["work", "items", "serial", "joblib", "speedup", "identical"], "-::::-")
    for task, items, t1, tn, speedup, same in rows:
        row([task, items, f"{t1:.2f} s", f"{tn:.2f} s", f"{speedup:.2f}x", "yes" if same else "NO"])
    if os.environ.get("BENCH_CLEAN") or args.smoke:
        shutil.rmtree(args.work)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
