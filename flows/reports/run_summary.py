"""The short summary `make demo` prints at the end, read from the store (no model is loaded, no Prefect):
each stage computed or cached with its time, test accuracy, footprint, trainable parameters, and where
the artifacts are.

    python -m flows.summary PIPELINE [--set ...]              print the summary of the pipeline's artifacts
    python -m flows.summary PIPELINE --if-cached [--set ...]  when every stage is already in the store:
        run the pipeline through the plain runner (every stage a store hit, logged as `cached`) and print
        the summary, exit 0; otherwise exit 3 and write nothing, so the caller runs the Prefect flow.

Why --if-cached: the Prefect flow starts a temporary Prefect server on every run (~10 s with an
existing PREFECT_HOME, 24-30 s on a fresh one, on 2 CPU cores: docs/results.md#the-demo-make-demo), which alone would
make a fully cached `make demo` take 4-10x longer. A cached run
changes nothing, so it does not need the orchestrator; a run with anything to compute goes through
the flow as usual.

Status per stage comes from the store's events log: the latest outcome recorded for that stage's key.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from stages.engine.cli import guarded, parser
from stages.engine.config import store_root
from stages.engine.plan import Plan
from stages.engine.remote_store import open_store
from stages.engine.runner import execute
from stages.engine.status import lookups
from stages.engine.store import Outcome, Store
from stages.engine.units import human_bytes
from stages.facts import (
    EVALUATES,
    SHIPS,
    TRAINS,
    ExportMetrics,
    adapter_metrics,
    evaluate_metrics,
    export_metrics,
    model_metrics,
    stage_named,
    train_metrics,
)
from stages.graph import GRAPH, graph_for
from stages.pipeline.schema import PipelineConfig

NOT_CACHED = 3


def stage_rows(plan: Plan, store: Store) -> list[dict[str, Any]]:
    """One row per stage: key, artifact path, whether the store has a hit for it, its last outcome and times."""
    last: dict[tuple[Any, Any], dict] = {}
    for ev in store.events():
        if ev.get("pipeline") == plan.cfg.name:
            last[(ev.get("stage"), ev.get("key"))] = ev
    found = lookups(plan, store)
    rows = []
    for item in plan.items:
        sk = item.key
        present = found[item.name].hit
        manifest = store.read_manifest(sk.stage, sk.key) if present else None
        ev = last.get((sk.stage, sk.key), {})
        rows.append({"stage": sk.stage, "key": sk.key, "path": store.artifact_dir(sk.stage, sk.key),
                     "present": present, "manifest": manifest or {},
                     "status": ev.get("event", "cached") if present else "missing",
                     "event_time": ev.get("time"), "duration_s": (manifest or {}).get("duration_s")})
    return rows


def outcome_row(o: Outcome) -> dict[str, Any]:
    """A stage_rows row for an outcome of this run."""
    return {"stage": o.stage, "key": o.key, "path": o.path, "present": True, "manifest": o.manifest,
            "status": "computed" if o.computed else "cached", "event_time": None,
            "duration_s": o.manifest.get("duration_s")}


def export_contents(facts: ExportMetrics) -> str:
    """What the export folder holds, from its manifest's facts: what sits at the top, and beside it."""
    from stages.formats import FORMATS

    beside = "".join(f" + {f.folder}/" for f in FORMATS.values() if f.folder and f.name in facts)
    if facts.get("method") == "full":
        return "finetuned model" + beside + " + model card"
    if facts.get("layout", facts.get("format")) == "merged":  # "format" in exports made before the rename
        return "merged model + adapter/" + beside + " + model card"
    return "exported adapter" + (" + merged/" if facts.get("merged") else "") + beside + " + model card"


def render(cfg: PipelineConfig, rows: list[dict[str, Any]], wall_s: float | None = None, ran: bool = False) -> str:
    """The summary. `ran`: the rows are this run's outcomes; otherwise they were read from the store, and the
    status column is each artifact's last recorded outcome (nothing was computed by this command)."""
    by = {r["stage"]: r for r in rows}
    stages = graph_for(cfg).stages
    manifests = {name: r.get("manifest") for name, r in by.items()}
    lines = [f"== {cfg.name} summary: {cfg.description}", "",
             f"  {'stage':<10} {'status' if ran else 'last run':<9} {'stage time':>10}  {'key':<12}  artifact"]
    for r in rows:
        status = {"recomputed": "computed"}.get(r["status"], r["status"])
        took = f"{r['duration_s']:.1f}s" if isinstance(r["duration_s"], int | float) else "-"
        if status == "cached":
            took = f"({took})"  # the time it took when computed, not this run
        lines.append(f"  {r['stage']:<10} {status:<9} {took:>10}  {r['key'][:12]}  {r['path']}")
    computed = [r for r in rows if r["status"] in ("computed", "recomputed")]
    stage_s = f"{sum(r['duration_s'] or 0 for r in computed):.0f} s of stage time"
    lines.append((f"  computed this run: {len(computed)} of {len(rows)} stages, {stage_s}" if ran else
                  f"  read from the store (nothing run): {sum(r['present'] for r in rows)} of {len(rows)} stages "
                  f"present, {len(computed)} computed when last run, {stage_s}")
                 + (f"; summary step {wall_s:.1f} s" if wall_s is not None else ""))
    lines.append("")

    em = evaluate_metrics(stages, manifests)
    ev = em.get("splits") or {}
    for split, m in ev.items():
        if "accuracy" in m:
            lines.append(f"  {split} accuracy: {100 * m['accuracy']:.1f}% on {m['examples']} held-out examples "
                         f"(macro-F1 {m['macro_f1']:.3f}, confusion [true][pred] {m.get('confusion_matrix')})")
        else:
            shown = {k: round(v, 4) for k, v in m.items() if isinstance(v, float)}
            lines.append(f"  {split}: {shown}")
    for split, m in (em.get("baseline") or {}).items():  # evaluate.baseline: untuned vs tuned
        tuned = ev.get(split, {})
        pairs = [f"{k} {v:.4f} -> {tuned[k]:.4f}" for k, v in m.items()
                 if isinstance(v, float) and isinstance(tuned.get(k), float) and not k.startswith("generated")]
        lines.append(f"  {split}, untuned -> tuned: {', '.join(pairs)}")
    mm, am, tm = model_metrics(stages, manifests), adapter_metrics(stages, manifests), train_metrics(stages, manifests)
    if mm:
        lines.append(f"  model: {cfg.model.name} ({mm.get('model_class')}, quantization {mm.get('quantization')}), "
                     f"{mm.get('parameters', 0):,} parameters, footprint {human_bytes(mm.get('footprint_bytes', 0))}"
                     + (f" + adapters = {human_bytes(am['footprint_bytes'])}" if am.get("footprint_bytes") else ""))
    if am:
        what = (f"LoRA r={cfg.adapters.r} on {', '.join(am.get('lora_targets', []))}"
                + (f" + {', '.join(cfg.adapters.modules_to_save)}" if cfg.adapters.modules_to_save else "")
                if am.get("method") == "lora" else "full finetune")
        lines.append(f"  trainable: {am.get('trainable', 0):,} of {am.get('total', 0):,} parameters "
                     f"({am.get('percent', 0):.2f}%), {what}")
    if tm:
        val = (tm.get("validation") or [{}])[-1]
        lines.append(f"  training: {tm.get('examples')} examples, {tm.get('steps')} steps of {tm.get('effective_batch')} "
                     f"(micro-batch {tm.get('micro_batch_size')} x accumulation {tm.get('gradient_accumulation_steps')}), "
                     f"loss {tm.get('first_loss', 0):.3f} -> {tm.get('final_loss', 0):.3f}, "
                     f"{tm.get('tokens_per_s', 0):.0f} real tokens/s"
                     + (f", validation accuracy {100 * val['val_accuracy']:.1f}%" if "val_accuracy" in val else ""))
        if best := tm.get("best"):  # train.select_best: the artifact holds the best validation's weights
            stopped = tm.get("stopped", "")
            lines.append(f"  best: {best['metric']} {best['value']:.4f} at step {best['step']} of {tm.get('steps')} "
                         f"(weights kept in trained/, the last step's in last/)"
                         + (f"; {stopped}" if stopped.startswith("early stopping") else ""))
    lines.append("")
    lines.append(f"  store: {store_root()}")
    for role, what in ((SHIPS, export_contents(export_metrics(stages, manifests))),
                       (TRAINS, "trained weights, loss.png, metrics.jsonl"), (EVALUATES, "metrics.json, predictions.jsonl")):
        if (stage := stage_named(stages, role)) in by and by[stage]["present"]:
            lines.append(f"  {what + ':':<42} {by[stage]['path']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m flows.summary") -> int:
    p = parser(prog)
    p.add_argument("--if-cached", action="store_true",
                   help="only when every stage is in the store: run it without Prefect and print the summary; "
                        f"else exit {NOT_CACHED}")
    args = p.parse_args(argv)

    def go() -> int:
        t0 = time.perf_counter()
        store = open_store()
        plan = GRAPH.plan(GRAPH.load(args), store, verify=args.verify, pinned=False)
        cfg = plan.cfg
        rows, ran = stage_rows(plan, store), False
        if args.if_cached:
            if not all(r["present"] for r in rows):
                missing = [r["stage"] for r in rows if not r["present"]]
                print(f"{cfg.name}: not all cached ({', '.join(missing)} to compute); running the flow",
                      file=sys.stderr)
                return NOT_CACHED
            print(f"{cfg.name}: every stage is in the store; reusing them without starting Prefect", flush=True)
            # all store hits (logged), nothing computed: the rows are this run's outcomes
            rows, ran = [outcome_row(o) for o in execute(plan, store)], True
        print(render(cfg, rows, time.perf_counter() - t0, ran))
        return 0

    return guarded(go)

