"""A sweep's variants side by side, from what the store holds (no Prefect, no tensors).

compare: one row per variant — the parameters that differ, the evaluation metrics (mean ± sd over seeds),
train time, real tokens/s, footprint, trainable parameters, the stages it shares with other runs of the
sweep — ranked by the sweep's metric; variants not yet run are listed as such. A run whose artifacts exist
only for an earlier code or library version (same parameters all the way up) is shown with those results,
marked `stale`. flows/reports/sweep_outputs.py writes it into the sweep's folder of the store, with a chart.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from flows.reports.formatting import label
from flows.reports.variants import Run, Sweep, short_names
from stages.engine.plan import Plan
from stages.engine.status import changed_params, flatten, lookups
from stages.engine.store import StageKey, Store
from stages.engine.units import human_bytes
from stages.facts import EVALUATES, TRAINS, adapter_metrics, model_metrics, stage_named, train_metrics
from stages.graph import GRAPH
from stages.pipeline.schema import PipelineConfig

DONE, STALE, NOT_RUN = "done", "stale", "not run"


@dataclass
class RunResult:
    label: str
    seed: int | None
    status: str  # done / stale (results of an earlier code or library version) / not run
    metrics: dict[str, float] = field(default_factory=dict)  # SPLIT.METRIC of the evaluate stage
    train_s: float | None = None
    tokens_per_s: float | None = None
    steps: int | None = None
    final_loss: float | None = None
    footprint_bytes: int | None = None
    trainable: int | None = None
    trainable_percent: float | None = None
    shared: list[str] = field(default_factory=list)  # stages whose key another variant of the sweep has too
    keys: dict[str, str] = field(default_factory=dict)  # stage -> key (the artifact shown)
    missing: list[str] = field(default_factory=list)  # stages with no artifact for this config


@dataclass
class VariantResult:
    variant: str
    params: dict[str, Any]  # every key that differs between variants -> this variant's value
    runs: list[RunResult]
    metric: str
    rank: int | None = None

    def values(self, metric: str | None = None) -> list[float]:
        m = metric or self.metric
        return [r.metrics[m] for r in self.runs if r.status != NOT_RUN and m in r.metrics]

    def mean(self, metric: str | None = None) -> float | None:
        v = self.values(metric)
        return statistics.fmean(v) if v else None

    def sd(self, metric: str | None = None) -> float | None:
        v = self.values(metric)
        return statistics.stdev(v) if len(v) > 1 else None

    def status(self) -> str:
        states = {r.status for r in self.runs}
        if states == {DONE}:
            return DONE
        done, stale = (sum(r.status == st for r in self.runs) for st in (DONE, STALE))
        if not done + stale:
            return NOT_RUN
        if NOT_RUN not in states:
            return STALE if not done else f"{done} done, {stale} {STALE}"
        return f"{done + stale} of {len(self.runs)} run" + (f" ({stale} {STALE})" if stale else "")

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "rank": self.rank, "params": self.params, "status": self.status(),
                "n": len(self.values()), "mean": self.mean(), "sd": self.sd(),
                "runs": [asdict(r) for r in self.runs]}


@dataclass
class Comparison:
    sweep: Sweep
    variants: list[VariantResult]  # ranked: best first, variants without results last
    baseline: str  # the sweep's first variant: paired differences are taken against it

    def paired_gap(self, v: VariantResult) -> tuple[float, float | None, int] | None:
        """mean, sd and count of (this variant - baseline) over the seeds both have results for."""
        base = next(x for x in self.variants if x.variant == self.baseline)
        m = self.sweep.config.metric
        b = {r.seed: r.metrics[m] for r in base.runs if r.status != NOT_RUN and m in r.metrics}
        d = [r.metrics[m] - b[r.seed] for r in v.runs if r.status != NOT_RUN and m in r.metrics and r.seed in b]
        if v is base or not d:
            return None
        return statistics.fmean(d), (statistics.stdev(d) if len(d) > 1 else None), len(d)

    def to_json(self) -> dict[str, Any]:
        c = self.sweep.config
        return {"sweep": c.name, "pipeline": c.pipeline, "description": c.description, "metric": c.metric,
                "mode": c.mode, "seeds": c.seeds, "baseline": self.baseline,
                "variants": [{**v.to_json(), "vs_baseline": self.paired_gap(v)} for v in self.variants]}


# ---------------------------------------------------------------- reading the store


def evaluate_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The evaluate stage's metrics as {SPLIT.METRIC: number} (the confusion matrix and other lists left out)."""
    splits = (metrics or {}).get("splits") or {}
    return {f"{split}.{k}": v for split, values in splits.items() if isinstance(values, dict)
            for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class Finder:
    """Finds, for a planned key that is not in the store, an artifact made from the same parameters all the
    way up (only code or library versions differ): the results a variant had before the code changed."""

    def __init__(self, store: Store):
        self.store = store
        self.by_stage: dict[str, list[tuple[str, dict]]] = {}
        for stage, key, _ in store.entries():
            if (m := store.read_manifest(stage, key)) is not None:
                self.by_stage.setdefault(stage, []).append((key, m))

    def stale_match(self, stage: str, planned: dict[str, StageKey]) -> str | None:
        best = None
        for key, m in self.by_stage.get(stage, []):
            if self._same_params(stage, key, m, planned) and (best is None or m.get("finished_at", "") > best[0]):
                best = (m.get("finished_at", ""), key)
        return best[1] if best else None

    def _same_params(self, stage: str, key: str, m: dict, planned: dict[str, StageKey]) -> bool:
        inputs = m.get("key_inputs") or {}
        old = inputs.get("params") or {}
        # a field added to the schema since (absent from the old key) is taken to have kept its default's behaviour
        old_fields = flatten(old)
        changed = changed_params(old, planned[stage].params)
        if any(f == c or f.startswith(c + ".") for c in changed for f in old_fields):
            return False
        for up, up_key in (inputs.get("upstream") or {}).items():
            um = self.store.read_manifest(up, up_key)
            if up not in planned or um is None or not self._same_params(up, up_key, um, planned):
                return False
        return True


def artifacts(plan: Plan, store: Store, finder: Finder) -> dict[str, tuple[str, dict]]:
    """stage -> (key, manifest) of the artifact each stage has for this config: its current key when the hit
    rule reuses it, else one made from the same parameters by earlier code (stale); a stage with neither is
    left out."""
    planned = {i.name: i.key for i in plan.items}
    found = lookups(plan, store)
    out = {}
    for stage in planned:
        key = planned[stage].key if found[stage].hit else finder.stale_match(stage, planned)
        if key is not None:
            out[stage] = (key, store.read_manifest(stage, key) or {})
    return out


def run_result(run: Run, plan: Plan, store: Store, finder: Finder, shared_keys: Counter) -> RunResult:
    res = RunResult(label=run.label, seed=run.seed, status=NOT_RUN)
    planned = {i.name: i.key for i in plan.items}
    found = artifacts(plan, store, finder)
    res.keys = {stage: key for stage, (key, _) in found.items()}
    res.missing = [stage for stage in planned if stage not in found]
    manifests = {stage: m for stage, (_, m) in found.items()}
    res.shared = [s for s, sk in planned.items() if shared_keys.get((s, sk.key), 0) > 1]
    stages = plan.graph.stages
    evaluates, trains = stage_named(stages, EVALUATES), stage_named(stages, TRAINS)
    if evaluates is not None and evaluates in manifests:
        res.status = DONE if res.keys[evaluates] == planned[evaluates].key else STALE
        res.metrics = evaluate_metrics(manifests[evaluates].get("metrics"))
    if trains is not None and trains in manifests:
        tm = train_metrics(stages, manifests)
        res.train_s, res.tokens_per_s = manifests[trains].get("duration_s"), tm.get("tokens_per_s")
        res.steps, res.final_loss = tm.get("steps"), tm.get("final_loss")
    am, mm = adapter_metrics(stages, manifests), model_metrics(stages, manifests)
    res.footprint_bytes = am.get("footprint_bytes") or mm.get("footprint_bytes")
    res.trainable, res.trainable_percent = am.get("trainable"), am.get("percent")
    return res


def param_value(cfg: PipelineConfig, dotted: str) -> Any:
    value: Any = cfg.model_dump(mode="json")
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def compare(sw: Sweep, store: Store) -> Comparison:
    finder = Finder(store)
    full = {r.label: GRAPH.plan(r.cfg, store, pinned=False) for r in sw.runs}
    plans = {label: {p.name: p.key for p in pl.items} for label, pl in full.items()}
    # a stage is shared when another *variant* has its key (a variant's seeds share more among themselves)
    shared = Counter(k for name in sw.variants() for k in {(sk.stage, sk.key) for r in sw.runs if r.variant == name
                                                            for sk in plans[r.label].values()})
    keys = list(dict.fromkeys(k for r in sw.runs for k in r.params))
    variants: list[VariantResult] = []
    for name in sw.variants():
        runs = [r for r in sw.runs if r.variant == name]
        variants.append(VariantResult(name, {k: param_value(runs[0].cfg, k) for k in keys},
                                      [run_result(r, full[r.label], store, finder, shared) for r in runs], sw.config.metric))
    baseline = variants[0].variant
    sign = -1 if sw.config.mode == "max" else 1
    ranked = sorted(variants, key=lambda v: (v.mean() is None, sign * (v.mean() or 0)))
    for i, v in enumerate(ranked):
        v.rank = i + 1 if v.mean() is not None else None
    return Comparison(sw, ranked, baseline)


# ---------------------------------------------------------------- rendering


def pm(mean: float | None, sd: float | None, pct: bool) -> str:
    if mean is None:
        return "-"
    scale, unit = (100, "%") if pct else (1, "")
    text = f"{scale * mean:.1f}{unit}" if pct else f"{mean:.4g}"
    return text + (f" ± {scale * sd:.1f}" if pct and sd is not None else f" ± {sd:.2g}" if sd is not None else "")


def _gap(gap: tuple[float, float | None, int] | None, pct: bool) -> str:
    """A paired difference: +6.6 ± 1.2 points (shares), +0.012 ± 0.003 (others)."""
    if gap is None:
        return "-"
    mean, sd, _ = gap
    if pct:
        return f"{100 * mean:+.1f}" + (f" ± {100 * sd:.1f}" if sd is not None else "") + " points"
    return f"{mean:+.4g}" + (f" ± {sd:.2g}" if sd is not None else "")


def is_share(metric: str) -> bool:
    return metric.rsplit(".", 1)[-1] in ("accuracy", "macro_f1", "f1", "precision", "recall")


def _avg(runs: list[RunResult], attr: str) -> float | None:
    v = [getattr(r, attr) for r in runs if getattr(r, attr) is not None]
    return statistics.fmean(v) if v else None


def table_rows(c: Comparison) -> list[dict[str, Any]]:
    """One dict per variant, ranked: what the text table, the CSV summary and the Prefect table artifact show."""
    m = c.sweep.config.metric
    others = sorted({k for v in c.variants for r in v.runs for k in r.metrics} - {m})
    names = short_names(list(c.variants[0].params)) if c.variants else {}
    rows = []
    for v in c.variants:
        gap = c.paired_gap(v)
        pct = is_share(m)
        row: dict[str, Any] = {"rank": v.rank or "-", **{names[k]: label(val) for k, val in v.params.items()},
                               "seeds": f"{len(v.values())}/{len(v.runs)}" if c.sweep.config.seeds else
                               len(v.values()),
                               m: pm(v.mean(), v.sd(), pct)}
        if len(c.variants) > 1:
            row["vs baseline"] = ("baseline" if v.variant == c.baseline else _gap(gap, pct))
        for k in others:
            if k.rsplit(".", 1)[-1] in ("examples", "loss", "perplexity", "tokens"):
                continue
            row[k] = pm(v.mean(k), None, is_share(k))
        train_s, tps = _avg(v.runs, "train_s"), _avg(v.runs, "tokens_per_s")
        row["train s"] = f"{train_s:.0f}" if train_s is not None else "-"
        row["real tokens/s"] = f"{tps:.0f}" if tps is not None else "-"
        fp = _avg(v.runs, "footprint_bytes")
        row["footprint"] = human_bytes(fp) if fp else "-"
        tr = v.runs[0].trainable
        row["trainable"] = f"{tr:,} ({v.runs[0].trainable_percent:.2f}%)" if tr and v.runs[0].trainable_percent \
            else (f"{tr:,}" if tr else "-")
        shared = sorted(set.intersection(*(set(r.shared) for r in v.runs)), key=_stage_order)
        row["shared"] = ",".join(shared) or "-"
        row["status"] = v.status()
        rows.append(row)
    return rows


def _stage_order(stage: str) -> int:
    order = GRAPH.names
    return order.index(stage) if stage in order else len(order)


def render(c: Comparison) -> str:
    """The comparison as a markdown table (it reads in a terminal and pastes into a README)."""
    cfg = c.sweep.config
    rows = table_rows(c)
    head = (f"sweep {cfg.name}: {cfg.description or cfg.pipeline}; ranked by {cfg.metric} ({cfg.mode})"
            + (f", mean ± sd over seeds {', '.join(map(str, cfg.seeds))}" if cfg.seeds else ""))
    if not rows:
        return head
    cols = list(rows[0])
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in cols) + " |" for r in rows]
    gaps = [(v, g) for v in c.variants if (g := c.paired_gap(v))]
    if gaps:
        lines.append("")
        pct = is_share(cfg.metric)
        for v, g in gaps:
            lines.append(f"{v.variant} - {c.baseline}: {_gap(g, pct)} ({cfg.metric}, paired by seed, n={g[2]})")
    return "\n".join(lines)


def runs_csv(c: Comparison) -> str:
    """One line per run (variant x seed), every metric."""
    metrics = sorted({k for v in c.variants for r in v.runs for k in r.metrics})
    params = list(c.variants[0].params) if c.variants else []
    cols = ["variant", *params, "seed", "status", *metrics, "train_s", "tokens_per_s", "steps", "final_loss",
            "footprint_bytes", "trainable", "shared"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for v in c.variants:
        for r in v.runs:
            w.writerow([v.variant, *(json.dumps(v.params[p]) if isinstance(v.params[p], dict | list) else
                                     v.params[p] for p in params), r.seed, r.status,
                        *(r.metrics.get(m, "") for m in metrics), r.train_s, r.tokens_per_s, r.steps, r.final_loss,
                        r.footprint_bytes, r.trainable, " ".join(r.shared)])
    return buf.getvalue()
