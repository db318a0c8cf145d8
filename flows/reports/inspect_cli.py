"""`finetune inspect` (`python -m flows.inspect`): the artifact store read without running anything (Prefect
is not imported, no stage runs).

    finetune inspect status PIPELINE [--set train.lr=1e-4] [--json]
    finetune inspect show PIPELINE STAGE       the stage's manifest (JSON)
    finetune inspect path PIPELINE STAGE       the stage's artifact folder
    finetune inspect verify [PIPELINE] [--quarantine] [--json]   every file against its manifest's sha256
    finetune inspect gc [--force] [--drop NAME] [--older-than AGE] [--current-only] [--min-age MINUTES] [--json]
    finetune inspect compare --sweep NAME | PIPELINE --grid KEY=V1,V2 [--set ...] [--json | --csv]
    finetune inspect diff A [B] [--set KEY=VALUE (B)] [--set-a KEY=VALUE (A)] [--json]
    finetune inspect runs [PIPELINE] [--sweep NAME] [--json | --csv]

`status` lists each stage's current key and whether it is cached, stale (an artifact of an earlier
config/code/library exists; the lines under it say what changed, in `dvc status` words) or missing.
Exit codes: status 0 when every stage is cached, 1 when one is stale or missing; show/path 1 when the
stage has no artifact; 2 for a bad pipeline name, stage or --set. `gc` lists what it keeps (the file's current
keys, every result a user ran: sweeps' children, --set variants; stages/engine/results.py) by pipeline and sweep,
and what no longer reaches (dry run), and removes that with --force. `compare` ranks a sweep's variants from the
store (flows/reports/comparison.py; exit 1 while a run has no results for the current code); `diff` says which stages
two configs share, which differ and why, and their params and metrics side by side (exit 1 when a stage
differs). `runs` lists every run the store saw (flows/reports/runs.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from flows.reports import comparison, config_diff, runs
from flows.reports.formatting import local_time, number, render_table
from flows.reports.variants import add_sweep_args, from_args
from stages.engine.cli import add_config_option, guarded
from stages.engine.commands import command
from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.remote_store import open_store
from stages.engine.status import CACHED, MISSING, Garbage, Kept, StageStatus, find, gc, pipeline_status
from stages.engine.store import Store
from stages.engine.units import human_bytes
from stages.graph import GRAPH
from stages.models.memory import free_memory
from stages.pipeline.loading import load_pipeline
from stages.pipeline.schema import PipelineConfig
from stages.training.pipeline_memory import estimate_pipeline, format_estimate


def render_status(pipeline: str, store: Store, statuses: list[StageStatus], run: str | None = None) -> str:
    """The status table; `run`: the command that runs what is not cached (printed when something is not)."""
    rows = [["stage", "status", "key", "size", "created", "metrics"]]
    notes: dict[int, list[str]] = {}
    for s in statuses:
        key = s.key[:12] if s.status != "stale" else f"{s.key[:12]} (have {(s.artifact_key or '')[:12]})"
        metrics = " ".join(f"{k}={number(v)}" for k, v in s.metrics.items())
        rows.append([s.stage, s.status, key, human_bytes(s.size_bytes), local_time(s.created), metrics])
        if s.reasons and s.status != CACHED:
            notes[len(rows) - 1] = s.reasons
    table = render_table(rows).splitlines()
    out = [f"pipeline {pipeline}   store {store}", table[0]]
    for i, line in enumerate(table[1:], start=1):
        out.append(line)
        out.extend(f"    {reason}" for reason in notes.get(i, []))
    stale = sum(s.status != CACHED for s in statuses)
    out.append(f"{len(statuses) - stale} of {len(statuses)} stages cached" +
               (f"; {stale} would run" if stale else "; nothing to run"))
    if stale and run:
        out.append(f"run: {run}")
    return "\n".join(out)


def run_command(args: argparse.Namespace) -> str:
    """The command that runs the pipeline these inspect arguments name, as the user gave them."""
    return command("run", args.pipeline, config=args.config, overrides=args.overrides)


def build_parser(prog: str = "python -m flows.inspect") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Inspect the artifact store of "
                                "pipeline.yaml's pipelines without running anything.")
    sub = p.add_subparsers(dest="command", required=True)

    def pipeline_args(sp: argparse.ArgumentParser, stage: bool) -> None:
        sp.add_argument("pipeline", help="a pipeline name from pipeline.yaml")
        if stage:
            sp.add_argument("stage", help="a stage name (data, tokenize, model, adapters, train, ...)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="the config override the run used, e.g. --set train.lr=1e-4 (repeatable)")
        add_config_option(sp)

    st = sub.add_parser("status", help="each stage: key, cached/stale/missing and why, size, created, metrics")
    pipeline_args(st, stage=False)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    sh = sub.add_parser("show", help="print a stage's manifest")
    pipeline_args(sh, stage=True)
    pa = sub.add_parser("path", help="print a stage's artifact folder")
    pipeline_args(pa, stage=True)
    g = sub.add_parser("gc", help="artifacts that no pipeline's current keys and no result reach (dry run "
                       "unless --force); lists what it keeps, by pipeline and sweep")
    g.add_argument("--force", "-f", action="store_true", help="remove them (default: only list)")
    g.add_argument("--drop", action="append", default=[], metavar="NAME", help="forget results (repeatable): a "
                   "sweep's name (every child of it), a pipeline's (its last run and its own runs, --set variants "
                   "included), or one result's NAME@ID from the dry run. By default gc keeps, besides the current "
                   "keys of the file's pipelines, every result: each child of every sweep, each --set variant, "
                   "the pipelines of your own files, whatever file gc is given")
    g.add_argument("--older-than", metavar="AGE", help="forget the results last made longer ago than "
                   "AGE (30d, 12h, 90m, 2w); the file's current keys are kept whatever their age")
    g.add_argument("--current-only", action="store_true", help="keep only the current keys of the file's "
                   "pipelines (what earlier releases did; --keep-refs was the opposite)")
    g.add_argument("--min-age", type=float, default=10.0, metavar="MINUTES", help="keep artifacts committed and "
                   "work written less than this many minutes ago (default 10; a live run's keys are always kept)")
    add_config_option(g)
    g.add_argument("--json", action="store_true", help="machine-readable output")
    ve = sub.add_parser("verify", help="every file of every artifact (or of PIPELINE's current keys) against its "
                        "manifest's sha256; exit 1 when any is corrupt")
    ve.add_argument("pipeline", nargs="?", help="only this pipeline's current artifacts (default: the whole store)")
    ve.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the config override the run used (repeatable)")
    ve.add_argument("--quarantine", action="store_true", help="move each corrupt artifact to .quarantine/ (the "
                    "next run recomputes it)")
    add_config_option(ve)
    ve.add_argument("--json", action="store_true", help="machine-readable output")
    me = sub.add_parser("memory", help="the pipeline's training memory estimated from the model config alone "
                        "(no weights are loaded)")
    pipeline_args(me, stage=False)
    co = sub.add_parser("compare", help="a sweep's variants side by side, ranked by its metric (`--sweep NAME`, "
                        "or PIPELINE --grid ...)")
    co.add_argument("pipeline", nargs="?", help="an ad-hoc sweep's pipeline (with --grid)")
    co.add_argument("--sweep", help="a sweep of pipeline.yaml (sweeps:)")
    add_sweep_args(co)
    fmt = co.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable output (variants and their runs)")
    fmt.add_argument("--csv", action="store_true", help="one CSV line per run (variant x seed)")
    di = sub.add_parser("diff", help="two configs: shared and differing stages and why, params, metrics")
    di.add_argument("a", help="pipeline A")
    di.add_argument("b", nargs="?", help="pipeline B (default: A)")
    di.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of B, e.g. --set train.lr=1e-4 (repeatable)")
    di.add_argument("--set-a", dest="overrides_a", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of A (repeatable)")
    add_config_option(di)
    di.add_argument("--json", action="store_true", help="machine-readable output")
    ru = sub.add_parser("runs", help="every run the store saw: when, pipeline, --set, stages, metrics, train time")
    ru.add_argument("pipeline", nargs="?", help="only this pipeline's runs")
    ru.add_argument("--sweep", help="only the runs of this sweep")
    add_config_option(ru)  # accepted like everywhere; the store, not the file, holds the runs
    fmt = ru.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable output")
    fmt.add_argument("--csv", action="store_true", help="one CSV line per run")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m flows.inspect") -> int:
    args = build_parser(prog).parse_args(argv)
    store = open_store()

    def go() -> int:
        if args.command == "gc":
            return cmd_gc(args, store)
        if args.command == "verify":
            return cmd_verify(args, store)
        if args.command == "compare":
            return cmd_compare(args, store)
        if args.command == "diff":
            return cmd_diff(args, store)
        if args.command == "runs":
            print(runs.report(store, args.pipeline, args.sweep, args.json, args.csv))
            return 0
        cfg = load_pipeline(args.pipeline, args.overrides, args.config)
        if args.command == "memory":
            return cmd_memory(cfg)
        statuses = pipeline_status(GRAPH.plan(cfg, store, pinned=False), store)
        if args.command == "status":
            if args.json:
                print(json.dumps({"pipeline": cfg.name, "store": str(store),
                                  "stages": [s.to_json() for s in statuses]}, indent=2))
            else:
                print(render_status(cfg.name, store, statuses, run_command(args)))
            return 0 if all(s.status == CACHED for s in statuses) else 1
        s = find(statuses, args.stage)
        if s.status == MISSING:
            print(f"{s.stage}: {'; '.join(s.reasons)} (key {s.key[:12]}); run the pipeline first: "
                  f"{run_command(args)}", file=sys.stderr)
            return 1
        if s.status != CACHED:
            print(f"note: {s.stage} is stale ({'; '.join(s.reasons)}); showing the artifact it would replace",
                  file=sys.stderr)
        if args.command == "path":  # a folder here: on a shared store, downloaded into the local cache
            print(store.materialize(s.stage, s.artifact_key or s.key) or s.path)
        else:
            print(json.dumps(store.read_manifest(s.stage, s.artifact_key or s.key), indent=2, sort_keys=True))
        return 0

    return guarded(go)


def cmd_memory(cfg: PipelineConfig) -> int:
    est = estimate_pipeline(cfg)
    free, device = free_memory()
    print(f"pipeline {cfg.name}: {cfg.model.name}, quantization {cfg.quantization.mode}, "
          f"adapters {cfg.adapters.method}")
    print(format_estimate(est))
    print(f"  free on {device}: {human_bytes(free)} -> {'fits' if est.total <= free else 'does NOT fit'}")
    return 0


def cmd_compare(args: argparse.Namespace, store: Store) -> int:
    """Exit 0 when every run of the sweep has results for the current code, 1 otherwise."""
    if bool(args.sweep) == bool(args.pipeline):
        raise ConfigError("compare: give --sweep NAME, or PIPELINE --grid KEY=V1,V2 (an ad-hoc sweep)")
    if args.sweep and (args.grid or args.seeds):
        raise ConfigError("compare --sweep NAME takes its variants from pipeline.yaml; drop --grid/--seeds")
    if args.pipeline and not (args.grid or args.seeds):
        raise ConfigError(f"compare {args.pipeline}: give --grid KEY=V1,V2 (or --sweep NAME)")
    sw = from_args(args, args.sweep or args.pipeline)
    c = comparison.compare(sw, store)
    print(json.dumps(c.to_json(), indent=2, default=str) if args.json else
          comparison.runs_csv(c).rstrip() if args.csv else comparison.render(c))
    return 0 if all(v.status() == comparison.DONE for v in c.variants) else 1


def cmd_diff(args: argparse.Namespace, store: Store) -> int:
    """Exit 0 when every stage is shared, 1 when some differ."""
    a = load_pipeline(args.a, args.overrides_a, args.config)
    b = load_pipeline(args.b or args.a, args.overrides, args.config)
    d = config_diff.diff(a, b, store)
    print(json.dumps(d, indent=2, default=str) if args.json else config_diff.render_diff(d))
    return 0 if all(s["shared"] for s in d["stages"]) else 1


def cmd_verify(args: argparse.Namespace, store: Store) -> int:
    if not store.exists():
        raise MissingInputError(f"store {store} does not exist; set FINETUNE_STORE or run a pipeline first")
    if args.pipeline:
        plan = GRAPH.plan(load_pipeline(args.pipeline, args.overrides, args.config), store, pinned=False)
        present = {(s, k) for s, k, _ in store.entries()}
        items = [(i.key.stage, i.key.key) for i in plan.items if (i.key.stage, i.key.key) in present]
    else:
        items = [(s, k) for s, k, _ in store.entries()]
    bad = {(s, k): p for s, k in items if (p := store.problems(s, k, verify=True))}
    moved = {sk: store.quarantine(*sk) for sk in bad} if args.quarantine else {}
    if args.json:
        print(json.dumps({"store": str(store), "verified": len(items), "corrupt": [
            {"stage": s, "key": k, "problems": p, "quarantined": moved.get((s, k))} for (s, k), p in bad.items()]},
            indent=2))
        return 1 if bad else 0
    if not bad:
        print(f"store {store}: {len(items)} artifacts verified, every file matches its manifest")
        return 0
    rows = [["stage", "key", "problem", "quarantine" if args.quarantine else "size"]]
    for (s, k), p in bad.items():
        where = (f"moved to {moved[s, k]}" if moved.get((s, k)) else "in use by a run; kept") if args.quarantine \
            else human_bytes(store.size(s, k))
        rows.append([s, k[:12], "; ".join(p[:3]) + (f" (+{len(p) - 3} more)" if len(p) > 3 else ""), where])
    print(render_table(rows))
    quarantine = command("inspect", "verify", *([args.pipeline] if args.pipeline else []), "--quarantine",
                         config=args.config, overrides=args.overrides)
    print(f"{len(bad)} of {len(items)} artifacts corrupt" + ("" if args.quarantine else
          f"; {quarantine} moves them aside, or rerun with --verify "
          f"to recompute them"))
    return 1


AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def age(text: str) -> float:
    """`--older-than 30d` -> seconds (s, m, h, d, w)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise ConfigError(f"--older-than {text}: write a number and a unit, e.g. 30d, 12h, 90m, 2w")
    return float(m.group(1)) * AGE_UNITS[m.group(2)]


def cmd_gc(args: argparse.Namespace, store: Store) -> int:
    kept: list[Kept] = []
    older_than = None if args.older_than is None else age(args.older_than)
    garbage = gc(store, GRAPH, args.config, force=args.force, keep_refs=not args.current_only,
                 min_age_s=args.min_age * 60, drop=args.drop, older_than_s=older_than, kept=kept)
    total = sum(g.size_bytes for g in garbage)
    if args.json:
        print(json.dumps({"store": str(store), "dry_run": not args.force, "total_bytes": total,
                          "items": [g.__dict__ for g in garbage], "kept": [k.to_json() for k in kept]}, indent=2))
        return 0
    print(f"store {store}")
    print(render_kept(kept))
    if not garbage:
        print("nothing to remove: every artifact is kept")
        return 0
    print(("removed:" if args.force else "would remove:") + "\n" + render_garbage(garbage, args.force))
    # the dry run's selection, repeated in the command it prints
    selection = [*(a for n in args.drop for a in ("--drop", n)), *(["--current-only"] if args.current_only else []),
                 *(["--older-than", args.older_than] if args.older_than is not None else []),
                 *(["--min-age", f"{args.min_age:g}"] if args.min_age != 10.0 else [])]
    if args.force:
        freed = sum(g.size_bytes for g in garbage if g.removed)
        print(f"removed {sum(g.removed for g in garbage)} of {len(garbage)}, {human_bytes(freed)} freed")
    else:
        print(f"{len(garbage)} unreachable or invalid, {human_bytes(total)}; dry run: nothing removed "
              f"({command('inspect', 'gc', '--force', *selection, config=args.config)} to remove)")
    return 0


def render_kept(kept: list[Kept]) -> str:
    """What gc keeps, by pipeline and sweep: each group's artifacts and bytes (an artifact two groups share counts
    in each, once in the total), a pipeline's reasons one per line, a sweep's results as one line. What holds
    no artifact here (a pipeline of the file never run) is left out."""
    groups: dict[str, list[Kept]] = {}
    for k in kept:
        if k.held:
            groups.setdefault(k.group, []).append(k)
    rows = [["kept", "artifacts", "size", "last made", "drop with"]]
    for name, ks in groups.items():
        held = {sk: n for k in ks for sk, n in k.held.items()}
        kind, _, label = name.partition(" ")
        drop = label if any(k.drop for k in ks) and kind in ("sweep", "pipeline") else ""
        last = max((k.updated for k in ks if k.updated), default=None)
        rows.append([name + (f" ({len(ks)} runs)" if kind == "sweep" else ""), str(len(held)),
                     human_bytes(sum(held.values())), local_time(last) if kind == "sweep" else "",
                     f"--drop {drop}" if drop else ""])
        if kind == "pipeline":
            rows += [[f"  {k.what}", str(len(k.held)), human_bytes(k.size_bytes),
                      local_time(k.updated) if k.updated else "",
                      f"--drop {k.drop}" if k.drop and k.drop != drop else ""] for k in ks]
    everything = {sk: n for k in kept for sk, n in k.held.items()}
    return (f"keeps {len(everything)} artifacts, {human_bytes(sum(everything.values()))}: the file's current "
            f"configs, every result until dropped by name or age, live runs\n" + render_table(rows))


def render_garbage(garbage: list[Garbage], force: bool) -> str:
    """The items, grouped by what they belonged to, each group under a line with its count and bytes."""
    order: dict[str, list[Garbage]] = {}
    for g in garbage:
        order.setdefault(g.group, []).append(g)
    rows = [["kind", "stage", "key", "size", "result" if force else "note"]]
    heads: dict[int, str] = {}
    for group, items in order.items():
        heads[len(rows)] = f"{group}: {len(items)}, {human_bytes(sum(g.size_bytes for g in items))}"
        rows += [[g.kind, g.stage, g.key[:12], human_bytes(g.size_bytes),
                  ("removed" if g.removed else g.note) if force else g.note] for g in items]
    table = render_table(rows).splitlines()
    out = ["  " + table[0]]
    for i, line in enumerate(table[1:], start=1):
        if i in heads:
            out.append(heads[i])
        out.append("  " + line)
    return "\n".join(out)
