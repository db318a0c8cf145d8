"""Two pipeline configs side by side (no Prefect, no tensors): which stages they share and which differ and
why (`changed params: train.lr`, `changed upstream: train`), param by param and metric by metric from the
store, the way `dvc params diff` / `dvc metrics diff` read. `finetune inspect diff A B`.
"""

from __future__ import annotations

from typing import Any

from flows.reports.comparison import Finder, artifacts, evaluate_metrics
from flows.reports.formatting import label
from stages.engine.plan import Plan
from stages.engine.status import changed_params, flatten, lookups, why_changed
from stages.engine.store import Store
from stages.facts import EVALUATES, TRAINS
from stages.graph import GRAPH
from stages.pipeline.schema import PipelineConfig


def diff(a: PipelineConfig, b: PipelineConfig, store: Store) -> dict[str, Any]:
    """Stages shared or differing (and why), parameters and metrics that differ, from the store."""
    plan_a, plan_b = GRAPH.plan(a, store, pinned=False), GRAPH.plan(b, store, pinned=False)
    pa, pb = {p.name: p.key for p in plan_a.items}, {p.name: p.key for p in plan_b.items}
    hit_a, hit_b = lookups(plan_a, store), lookups(plan_b, store)
    stages = []
    for name, ka in pa.items():
        kb = pb[name]
        why = [] if ka.key == kb.key else why_changed({**ka.key_inputs(), "code_objects": list(ka.code_objects)}, kb)
        stages.append({"stage": name, "shared": ka.key == kb.key, "a": ka.key, "b": kb.key, "why": why,
                       "a_in_store": hit_a[name].hit, "b_in_store": hit_b[name].hit})
    params = _changed(_sections(a), _sections(b))
    finder = Finder(store)
    ma, mb = _stored_metrics(plan_a, store, finder), _stored_metrics(plan_b, store, finder)
    metrics = []
    for k in sorted(ma.keys() | mb.keys()):
        (va, sa), (vb, sb) = ma.get(k, (None, False)), mb.get(k, (None, False))
        if va == vb and va is not None and not k.startswith(("evaluate.", "train.final")):
            continue  # the same number from a shared stage
        metrics.append({"metric": k, "a": va, "b": vb, "a_stale": sa, "b_stale": sb,
                        "change": vb - va if isinstance(va, int | float) and isinstance(vb, int | float) else None})
    return {"a": {"pipeline": a.name, "overrides": a.overrides}, "b": {"pipeline": b.name, "overrides": b.overrides},
            "stages": stages, "params": params, "metrics": metrics}


def _changed(sa: dict[str, Any], sb: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per differing field, at the level where the two differ in kind: `model.from_config` null on one
    side and a mapping on the other is one row showing both values, not a `None -> None` row plus one
    `None -> 32` row per key. A field one side does not have is `set: false` there (shown as `-`)."""
    da, db = flatten(sa), flatten(sb)
    rows: dict[str, dict[str, Any]] = {}
    for k in changed_params(sa, sb):
        parts = k.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        at = next((p for p in prefixes if p in da or p in db), k)  # the shallowest leaf of either side
        if at not in rows:
            (va, a_set), (vb, b_set) = _value(sa, at), _value(sb, at)
            rows[at] = {"param": at, "a": va, "b": vb, "a_set": a_set, "b_set": b_set}
    return [rows[k] for k in sorted(rows)]


def _value(sections: dict[str, Any], dotted: str) -> tuple[Any, bool]:
    """The value at a dotted field and whether it is there at all."""
    value: Any = sections
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None, False
        value = value[part]
    return value, True


def _sections(cfg: PipelineConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json", exclude={"name", "description", "extends", "overrides"})


def _stored_metrics(plan: Plan, store: Store, finder: Finder) -> dict[str, tuple[float, bool]]:
    """metric -> (value, stale): the evaluating stage's and a few of the training stage's (stages/facts.py),
    from the artifacts this config has."""
    out: dict[str, tuple[float, bool]] = {}
    for stage, (key, m) in artifacts(plan, store, finder).items():
        metrics, stale = m.get("metrics") or {}, key != plan[stage].key.key
        role = plan.graph[stage].role
        if role == EVALUATES:
            out.update({f"{stage}.{k}": (v, stale) for k, v in evaluate_metrics(metrics).items()})
        elif role == TRAINS:
            out.update({f"{stage}.{k}": (metrics[k], stale) for k in ("final_loss", "steps", "tokens_per_s",
                                                                      "train_seconds")
                        if isinstance(metrics.get(k), int | float)})
    return out


def render_diff(d: dict[str, Any]) -> str:
    def side(s: dict[str, Any]) -> str:
        return s["pipeline"] + "".join(f" --set {o}" for o in s["overrides"])

    lines = [f"A: {side(d['a'])}", f"B: {side(d['b'])}", "", "stages:"]
    for s in d["stages"]:
        state = f"shared    {s['a'][:12]}" if s["shared"] else f"differs   {s['a'][:12]} -> {s['b'][:12]}"
        lines.append(f"  {s['stage']:<9} {state}")
        lines += [f"              {w}" for w in s["why"]]
    lines += ["", "params:" if d["params"] else "params: identical"]
    shown = lambda p, side: label(p[side]) if p[f"{side}_set"] else "-"  # noqa: E731
    lines += [f"  {p['param']:<40} {shown(p, 'a'):>14} -> {shown(p, 'b')}" for p in d["params"]]
    lines += ["", "metrics (from the store; - = not run, * = stale: made by earlier code):" if d["metrics"]
              else "metrics: none in the store"]
    for m in d["metrics"]:
        va, vb = ("-" if v is None else label(v) + ("*" if stale else "")
                  for v, stale in ((m["a"], m["a_stale"]), (m["b"], m["b_stale"])))
        change = f"  ({m['change']:+.4g})" if m["change"] is not None else ""
        lines.append(f"  {m['metric']:<40} {va:>14} -> {vb}{change}")
    return "\n".join(lines)
