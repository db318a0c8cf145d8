"""What a method is: *what is learned*, one class that owns everything that differs between ways of training,
so the stages and the training loop hold no method branches. A method says

    settings    its config section (`method:` in pipeline.yaml), a pydantic class validated next to it
    head        the model-side facts (stages/models/heads.py): Auto class, PEFT task type, generation
    data        the columns it needs of the data (read by the data stage at plan time and when it computes)
    features    how a split's rows become features: any columns (the tokenize stage writes them all)
    collate     a micro-batch of rows -> named tensors and its loss units (rows, target tokens, pairs...)
    prepare     what happens to a micro-batch before its step (identity; where a rollout would enter)
    step        a micro-batch's loss *summed* over its units, the units, and named stats (sums too)
    stages      the stages it adds to the pipeline's graph (a reference model's log-probs...), and which
                core stages read them
    check       its settings against the rest of the pipeline, at plan time
    validation  what the validation pass during training computes (val_loss, val_accuracy, val_rouge*...)
    evaluation  what the evaluate stage computes on a split, and its predictions
    inference   how an exported model answers new text (`finetune predict`), and the card's usage lines

Loss normalisation: a step returns a sum; the training loop (stages/train.py) divides by the units of the whole
accumulation window, across processes, so k micro-batches x 1 equals 1 x k exactly.

A method's module is imported at plan time (the data stage's column checks, the evaluate stage's metric
modules), which imports no tensor library: torch and the helpers built on it are imported in the methods that
compute. Adding a method is one module: docs/methods.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from stages.engine.errors import ConfigError, MissingInputError
from stages.methods import metrics
from stages.models.heads import Head, head_named
from stages.pipeline.schema import MethodConfig, TokenizeConfig
from stages.text.tokens import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from stages.engine.stage import Stage
    from stages.training.batching import Batch, Rows


@dataclass(frozen=True)
class Features:
    """A tokenized split: its columns (input_ids and whatever else the method needs, one list per column), the
    untruncated lengths of the inputs and, where there are targets, of the targets (for the manifest's length
    statistics); `template`: the chat template the rows were rendered with (shipped with the export)."""

    columns: dict[str, list[Any]]
    lengths: list[int]
    target_lengths: list[int] | None = None
    template: str | None = None


@dataclass(frozen=True)
class MethodData:
    """The columns a method needs of its data (the data stage reads this, not the method's class: the code
    fingerprint follows a class whole, so a change to how a method trains reruns tokenize onwards, not data)."""

    classifies: bool = False  # a label column in every split; classes, label names, num_labels
    needs_target: bool = False  # a target column in every split
    source_target: bool = True  # when data.target_column is null, the source's default (billsum: summary)
    chats: bool = False  # conversations (data.format messages / alpaca) rendered with a chat template
    text: bool = True  # a text column (data.text_column) in every split
    columns: tuple[str, ...] = ()  # more columns, read under their own names (a pair's chosen and rejected)

    def required_columns(self, d: Any, target_column: str | None) -> dict[str, str | None]:
        """{setting: column} the data stage needs in every split (a None column: the setting is missing)."""
        need: dict[str, str | None] = {"data.text_column": d.text_column} if self.text else {}
        need.update({f"the column {c}": c for c in self.columns})
        if self.classifies:
            need["data.label_column"] = d.label_column
        if self.needs_target:
            need["data.target_column"] = target_column
        return need

    def target_column(self, d: Any, source_default: str | None) -> str | None:
        """The target column: data.target_column, else the source's when this method takes one."""
        return d.target_column or (source_default if self.source_target else None)


@dataclass
class StepOutput:
    """A micro-batch's step: the loss summed over its units, and named stats, each a sum over the same units
    (the loop reports stat / units of the window: a mean)."""

    loss_sum: torch.Tensor
    units: int
    stats: dict[str, float] = field(default_factory=dict)


class Method:
    """What every method has; the built-in ones (stages/methods/classify.py, seq2seq.py, sft.py) fill it in."""

    name: ClassVar[str]
    settings: ClassVar[type[MethodConfig]] = MethodConfig  # its `method:` section
    data: ClassVar[MethodData] = MethodData()
    predicts: ClassVar[str]  # "labels" (class ids) or "texts": what the evaluate modules score
    default_metrics: ClassVar[tuple[str, ...]]  # `evaluate.metrics` when the pipeline leaves it null
    validation_metrics: ClassVar[tuple[str, ...]] = ("loss",)  # val_<name> its validation pass computes
    examples: ClassVar[list[str]]  # the texts the card's usage snippet runs on
    chat_examples: ClassVar[list[list[dict[str, str]]]] = []  # the conversations it runs on (a chat export)
    packs: ClassVar[bool] = False  # tokenize.packing may pack its train rows (stages/text/packing.py)
    summary: ClassVar[str] = ""  # one line for `finetune methods`

    def __init__(self, values: MethodConfig | None = None):
        self.s = values if values is not None else self.settings(name=self.name)  # its settings' values

    def bound(self, values: MethodConfig) -> Method:
        """This method with a pipeline's settings (`cfg.method`), as the stages that run it use it."""
        return type(self)(values)

    @property
    def head(self) -> Head:
        return head_named(self.settings.head)

    # ---------------------------------------------------------------- the graph and plan time
    def stages(self) -> list[Stage]:
        """The stages this method adds to the core ones (none for the built-in methods)."""
        return []

    def upstream(self) -> dict[str, tuple[str, ...]]:
        """{core stage: added stages it reads} (e.g. train reading a reference stage)."""
        return {}

    def check(self, cfg: Any) -> None:
        """Its settings against the whole pipeline, at plan time (one ConfigError naming the field and fix)."""
        if cfg.tokenize.packing and not self.packs:
            raise ConfigError(f"tokenize.packing: packs the rows of method sft, and the method is {self.name}; "
                              "set tokenize.packing: false")
        sb = cfg.train.select_best
        if sb is not None and sb.metric.removeprefix("val_") not in self.validation_metrics:
            raise ConfigError(f"train.select_best.metric: validation of method {self.name} does not compute "
                              f"{sb.metric}; use one of {', '.join('val_' + n for n in self.validation_metrics)}")

    # ---------------------------------------------------------------- model
    def configure(self, config: Any, m: Any) -> None:
        """Set what this method needs on the transformers config before the model is built."""
        self.head.configure(config, m)

    # ---------------------------------------------------------------- features (the tokenize stage)
    def features(self, tok: Any, table: Any, t: TokenizeConfig, desc: str, model: str) -> Features:
        """A data split's features (`table`: the data stage's Arrow table of it; `model`: model.name, for
        messages)."""
        from stages.text.tokens import bare_ids

        texts = [t.prefix + x for x in table.column("text").to_pylist()]
        return self.token_features(tok, bare_ids(tok, texts, t.batch_size, desc), table, t, desc)

    def token_features(self, tok: Any, bare: list[list[int]], table: Any, t: TokenizeConfig, desc: str) -> Features:
        """Features given the bare token ids of the split's texts (stages/text/tokens.py bare_ids)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- training
    def label_tensor(self, rows: list[dict]) -> torch.Tensor:
        """A micro-batch's labels: token ids padded with IGNORE_INDEX (ignored by the loss)."""
        import torch

        lw = max(len(r["labels"]) for r in rows)
        labels = torch.full((len(rows), lw), IGNORE_INDEX, dtype=torch.long)
        for i, r in enumerate(rows):
            labels[i, :len(r["labels"])] = torch.as_tensor(r["labels"], dtype=torch.long)
        return labels

    def loss_units(self, tensors: dict[str, torch.Tensor]) -> int:
        """What the loss is averaged over: the target tokens."""
        return int((tensors["labels"] != IGNORE_INDEX).sum())

    def collate(self, rows: list[dict], pad_id: int) -> Batch:
        """Rows padded to the longest (stages/training/batching.py pad_tokens), their labels and loss units."""
        from stages.training.batching import Batch, pad_tokens

        tensors, real, padded = pad_tokens(rows, pad_id)
        tensors["labels"] = self.label_tensor(rows)
        return Batch(tensors, self.loss_units(tensors), real, padded)

    def prepare(self, model: torch.nn.Module, batch: Batch, step: int) -> Batch:
        """A micro-batch made ready for its step (on the device): as it is."""
        return batch

    def step(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        """The loss of a micro-batch, summed (not averaged) over its loss units."""
        raise NotImplementedError

    def summed_over(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                    device: torch.device) -> tuple[float, int]:
        """(summed loss, loss units) over the rows `order` names, batch_size at a time."""
        loss_sum, units = 0.0, 0
        for i in range(0, len(order), batch_size):
            out = self.step(model, self.collate(rows.get(order[i:i + batch_size]), pad_id).to(device))
            loss_sum += float(out.loss_sum)
            units += out.units
        return loss_sum, units

    # ---------------------------------------------------------------- validation during training
    def validate(self, model: torch.nn.Module, rows: Rows, pad_id: int, batch_size: int, device: torch.device,
                 metric: str | None = None, tokenizer: Any = None) -> dict[str, float]:
        """Validation: the mean loss (per loss unit) and what this method adds, accumulated as counts batch by
        batch (memory does not grow with the split). `metric` (select_best's, e.g. val_macro_f1, val_rougeL)
        adds the scores of the evaluate stage's module for it (`tokenizer`: to decode generated texts)."""
        import torch

        was_training = model.training
        model.eval()
        order = sorted(range(len(rows)), key=lambda i: rows.lengths[i])
        module = metrics.VALIDATION_MODULES.get((metric or "").removeprefix("val_"))
        try:
            with torch.no_grad():
                return self.validation_pass(model, rows, order, pad_id, batch_size, device, module, tokenizer)
        finally:
            model.train(was_training)

    def validation_pass(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                        device: torch.device, module: str | None, tok: Any) -> dict[str, float]:
        loss_sum, units = self.summed_over(model, rows, order, pad_id, batch_size, device)
        return {"val_loss": round(loss_sum / max(units, 1), 6)}

    # ---------------------------------------------------------------- evaluation and inference
    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        """generate() kwargs from an `evaluate` section ({} for a method that does not generate)."""
        from stages.models.inference import generation_kwargs

        return generation_kwargs(e, tok, model)

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: logging.Logger,
                 targets: Callable[[], list[str] | None]) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        """(metrics, predictions, references) of a tokenized split's rows; predictions None when there is
        nothing to predict (perplexity). `targets()`: the data stage's target texts, None without them."""
        raise MissingInputError(f"{desc}: method {self.name} has no evaluation")

    def prompt_ids(self, tok: Any, ids: list[list[int]]) -> list[list[int]]:
        """New texts' tokenized ids (as the tokenize stage tokenizes) -> what the model is given."""
        return ids

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: dict[str, Any] | None, device: Any, log: logging.Logger) -> list[dict[str, Any]]:
        """One record per text, in order."""
        raise NotImplementedError

    def usage_lines(self, fmt: str) -> list[str]:
        """The card's snippet after `batch = tok(...)`: running the model and printing its answers."""
        raise NotImplementedError
