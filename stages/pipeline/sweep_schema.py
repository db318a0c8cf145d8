"""The schema of one entry of pipeline.yaml's `sweeps:` (re-exported by stages/pipeline/schema.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.engine.names import Name


class SweepConfig(BaseModel):
    """One entry of `sweeps:` in pipeline.yaml: variants of a base pipeline run through the same store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = Field(..., description="the sweep's name, its key under `sweeps:` (set by the loader): `finetune "
                      "sweep NAME`, deployment sweep/NAME, UI artifact sweep-NAME, folder sweeps/NAME of the store")
    description: str = Field("", description="one line shown with the comparison")
    pipeline: str = Field(..., description="the base pipeline (a name under `pipelines:`) every variant starts from")
    set: dict[str, Any] = Field(default_factory=dict, description="overrides applied to every variant, "
                                "{dotted.key: value} as `--set` takes them (e.g. data.subset, tokenize.max_length)")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="dotted key -> list of values; the "
                                       "variants are the product of the lists, first key slowest")
    variants: list[dict[str, Any]] = Field(default_factory=list, description="explicit variants instead of a grid, "
                                           "each a mapping {dotted.key: value} of its overrides")
    seeds: list[int] = Field(default_factory=list, description="repeat every variant once per seed, as train.seed "
                             "(which also draws the training data's order); compare then shows mean ± sd and the "
                             "number of seeds. Empty: one run per variant with the pipeline's seed")
    metric: str = Field("test.accuracy", description="what ranks the variants: SPLIT.METRIC of the evaluate stage's "
                        "metrics, e.g. test.accuracy, test.macro_f1, validation.rougeL")
    mode: Literal["max", "min"] = Field("max", description="max: the highest metric ranks first; min: the lowest "
                                        "(a loss)")

    @model_validator(mode="after")
    def _shape(self) -> SweepConfig:
        if self.grid and self.variants:
            raise ValueError("give either grid (a product of values) or variants (explicit overrides), not both")
        keys = [*self.set, *self.grid, *(k for v in self.variants for k in v)]
        if bad := [k for k in keys if len(k.split(".")) < 2 or not all(k.split("."))]:
            raise ValueError(f"override key(s) {bad} must be dotted SECTION.FIELD, e.g. train.lr")
        if empty := [k for k, values in self.grid.items() if not values]:
            raise ValueError(f"grid {empty}: give at least one value")
        if self.seeds and "train.seed" in keys:
            raise ValueError("train.seed is set by seeds; remove it from set/grid/variants")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds}: each seed once")
        if len(self.metric.split(".")) != 2 or not all(self.metric.split(".")):
            raise ValueError(f"metric '{self.metric}': write SPLIT.METRIC, e.g. test.accuracy")
        return self
