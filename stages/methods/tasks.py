"""The Task registry: one object per `model.task`, owning everything that differs between tasks, so the stages
hold no task branches. A task says

    loading     which transformers Auto class (and PEFT task type) builds it, what its config needs (a head size)
    data        which columns a source must have (labels, targets) and whether its classes have names
    tokens      how a row's labels are built from its text and target (tokenize stage)
    training    how a micro-batch's labels are collated, its loss summed and its loss units counted
    validation  what the validation pass during training computes (val_loss, val_accuracy, val_rouge*...)
    evaluation  what the evaluate stage computes on a split, and its predictions
    inference   how an exported model answers new text (`finetune predict`)
    export      the card's pipeline_tag, usage snippet and example texts; whether a generation config ships

Loss normalisation: each micro-batch's loss is summed, not averaged, and the optimizer step (stages/train.py)
divides by the units (rows, or target tokens) of the whole accumulation window, so k micro-batches x 1 equals
1 x k exactly.

The registry is read at plan time (the data stage's column checks, the evaluate stage's metric modules), which
imports no tensor library: torch and the helpers built on it are imported in the methods that compute.

What the data stage needs of a task (its columns) is a TaskData in TASK_DATA, apart from the classes: the
code fingerprint (stages/engine/codegraph.py) follows a class whole, so a change to how a task tokenizes,
trains or evaluates reruns the tokenize stage onwards but not the data stage.

Adding a task is one subclass here, registered in TASKS, its TaskData in TASK_DATA, plus its name among
`model.task`'s choices in stages/pipeline/schema.py (with the validation metrics it computes):
tests/common/test_tasks.py adds one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from stages.engine.errors import ConfigError, MissingInputError
from stages.methods import metrics
from stages.pipeline.schema import VALIDATION_METRICS, TokenizeConfig
from stages.text.tokens import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from stages.training.batching import Batch, Rows


@dataclass(frozen=True)
class TokenRows:
    """A tokenized split: input ids, labels, and the untruncated lengths of the inputs (causal_lm: prompt +
    target, what tokenize.max_length cuts) and of the targets (None without targets)."""

    input_ids: list[list[int]]
    labels: list[Any]
    lengths: list[int]
    target_lengths: list[int] | None = None
    prompt_lengths: list[int] | None = None  # causal_lm with targets: where each row's answer starts


@dataclass(frozen=True)
class TaskData:
    """The columns a task needs of its data (read by the data stage at plan time and when it computes)."""

    classifies: bool = False  # a label column in every split; classes, label names, num_labels
    needs_target: bool = False  # a target column in every split
    source_target: bool = True  # when data.target_column is null, the source's default (billsum: summary)
    chats: bool = False  # conversations (data.format messages / alpaca) rendered with a chat template

    def required_columns(self, d: Any, target_column: str | None) -> dict[str, str | None]:
        """{setting: column} the data stage needs in every split (a None column: the setting is missing)."""
        need: dict[str, str | None] = {"data.text_column": d.text_column}
        if self.classifies:
            need["data.label_column"] = d.label_column
        if self.needs_target:
            need["data.target_column"] = target_column
        return need

    def target_column(self, d: Any, source_default: str | None) -> str | None:
        """The target column: data.target_column, else the source's when this task takes one."""
        return d.target_column or (source_default if self.source_target else None)


TASK_DATA: dict[str, TaskData] = {
    "seq_cls": TaskData(classifies=True, source_target=False),
    "seq2seq": TaskData(needs_target=True),
    "causal_lm": TaskData(chats=True),  # a target when there is one (prompt -> completion), else language modelling
}


def data_of(name: str) -> TaskData:
    """The columns `model.task` needs."""
    data = TASK_DATA.get(name)
    if data is None:
        raise ConfigError(f"model.task: {name!r} is not one of {', '.join(TASK_DATA)}; set model.task to one of them")
    return data


class Task:
    """What every task has; the subclasses below fill it in."""

    name: ClassVar[str]
    auto_class: ClassVar[str]  # the transformers Auto class that loads the model for this task
    peft_task_type: ClassVar[str]  # peft.TaskType's name
    pipeline_tag: ClassVar[str]  # the Hugging Face pipeline tag on the export's card
    predicts: ClassVar[str]  # "labels" (class ids) or "texts": what the evaluate modules score
    default_metrics: ClassVar[tuple[str, ...]]  # `evaluate.metrics` when the pipeline leaves it null
    examples: ClassVar[list[str]]  # the texts the card's usage snippet runs on
    chat_examples: ClassVar[list[list[dict[str, str]]]] = []  # the conversations it runs on (a chat export)
    generates: ClassVar[bool] = True  # predicts by generation (a generation_config.json ships)
    decoder_only: ClassVar[bool] = False  # prompts padded on the left; the prompt comes back before the answer
    encoder_decoder: ClassVar[bool] = False  # targets run through a decoder of their own length
    packs: ClassVar[bool] = False  # tokenize.packing may pack its train rows (stages/text/packing.py)

    @property
    def auto_peft_class(self) -> str:
        return self.auto_class.replace("AutoModel", "AutoPeftModel")

    @property
    def validation_metrics(self) -> tuple[str, ...]:
        return VALIDATION_METRICS[self.name]

    @property
    def classifies(self) -> bool:
        """A classification head: classes, label names, num_labels (TaskData.classifies)."""
        return data_of(self.name).classifies

    # ---------------------------------------------------------------- model
    def configure(self, config: Any, m: Any) -> None:
        """Set what this task needs on the transformers config before the model is built."""

    # ---------------------------------------------------------------- tokens
    def token_rows(self, tok: Any, bare: list[list[int]], table: Any, t: TokenizeConfig, desc: str) -> TokenRows:
        """A data split's rows, given the bare token ids of their texts (stages/text/tokens.py bare_ids)."""
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

    def loss_units(self, batch: Batch) -> int:
        """What the loss is averaged over: the target tokens."""
        return int((batch.labels != IGNORE_INDEX).sum())

    def summed_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The loss of a micro-batch, summed (not averaged) over its loss units."""
        raise NotImplementedError

    def collate(self, rows: list[dict], pad_id: int) -> Batch:
        from stages.training.batching import collate

        return collate(rows, pad_id, self)

    def summed_over(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                    device: torch.device) -> tuple[float, int]:
        """(summed loss, loss units) over the rows `order` names, batch_size at a time."""
        loss_sum, units = 0.0, 0
        for i in range(0, len(order), batch_size):
            b = self.collate(rows.get(order[i:i + batch_size]), pad_id).to(device)
            loss_sum += float(self.summed_loss(model, b))
            units += self.loss_units(b)
        return loss_sum, units

    # ---------------------------------------------------------------- validation during training
    def validate(self, model: torch.nn.Module, rows: Rows, pad_id: int, batch_size: int, device: torch.device,
                 metric: str | None = None, tokenizer: Any = None) -> dict[str, float]:
        """Validation: the mean loss (per loss unit) and what this task adds, accumulated as counts batch by
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
        raise NotImplementedError

    # ---------------------------------------------------------------- evaluation and inference
    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        """generate() kwargs from an `evaluate` section ({} for a task that does not generate)."""
        from stages.runtimes.inference import generation_kwargs

        return generation_kwargs(e, tok, model)

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: logging.Logger,
                 targets: Callable[[], list[str] | None]) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        """(metrics, predictions, references) of a tokenized split's rows; predictions None when there is
        nothing to predict (perplexity). `targets()`: the data stage's target texts, None without them."""
        raise NotImplementedError

    def prompt_ids(self, tok: Any, ids: list[list[int]]) -> list[list[int]]:
        """New texts' tokenized ids (as the tokenize stage tokenizes) -> what the model is given."""
        return ids

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: dict[str, Any] | None, device: Any, log: logging.Logger) -> list[dict[str, Any]]:
        """One record per text, in order."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the export's card
    def usage_lines(self, fmt: str) -> list[str]:
        """The card's snippet after `batch = tok(...)`: running the model and printing its answers."""
        raise NotImplementedError


class Classification(Task):
    """seq_cls: a classification head on the model; accuracy, macro-F1, a confusion matrix."""

    name = "seq_cls"
    auto_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    pipeline_tag = "text-classification"
    predicts = "labels"
    default_metrics = ("accuracy", "f1")
    examples = ["A wonderful, moving film with a great cast.", "Dull, predictable and far too long."]
    generates = False

    def configure(self, config: Any, m: Any) -> None:
        config.num_labels = m.num_labels or 2

    def token_rows(self, tok: Any, bare: list[list[int]], table: Any, t: TokenizeConfig, desc: str) -> TokenRows:
        from stages.text.tokens import with_specials

        ids, lengths = with_specials(tok, bare, t.max_length)
        return TokenRows(ids, table.column("label").to_pylist(), lengths)

    def label_tensor(self, rows: list[dict]) -> torch.Tensor:
        import torch

        return torch.as_tensor([int(r["labels"]) for r in rows], dtype=torch.long)

    def loss_units(self, batch: Batch) -> int:
        return len(batch)

    def summed_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        import torch.nn.functional as F

        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return F.cross_entropy(logits.float(), batch.labels, reduction="sum")

    def validation_pass(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                        device: torch.device, module: str | None, tok: Any) -> dict[str, float]:
        import torch.nn.functional as F

        loss_sum, correct = 0.0, 0
        preds: list[int] = []
        refs: list[int] = []
        for i in range(0, len(order), batch_size):
            b = self.collate(rows.get(order[i:i + batch_size]), pad_id).to(device)
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
            loss_sum += float(F.cross_entropy(logits, b.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == b.labels).sum())
            preds += logits.argmax(-1).tolist()
            refs += b.labels.tolist()
        out = {"val_loss": round(loss_sum / max(len(rows), 1), 6),
               "val_accuracy": round(correct / max(len(rows), 1), 6)}
        if module is not None:
            out.update({f"val_{k}": round(v, 6) for k, v in metrics.compute([module], preds, refs).items()})
        return out

    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        return {}

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: logging.Logger,
                 targets: Callable[[], list[str] | None]) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        from stages.runtimes.inference import class_logits

        refs = [int(x) for x in rows["labels"]]
        logits = class_logits(model, rows["input_ids"], tok.pad_token_id, batch_size, device, desc, log)
        preds = [int(p) for p in logits.argmax(-1).tolist()]
        num_labels = int(model.config.num_labels)  # type: ignore[union-attr,arg-type]  # a classifier's, set
        return metrics.classification_metrics(preds, refs, num_labels, scores), preds, refs

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: dict[str, Any] | None, device: Any, log: logging.Logger) -> list[dict[str, Any]]:
        from stages.runtimes.inference import class_logits

        probs = class_logits(model, ids, tok.pad_token_id, batch_size, device, "predict", log).softmax(-1)
        names = [model.config.id2label[i] for i in range(probs.shape[-1])]
        out = []
        for p in probs.tolist():
            best = max(range(len(p)), key=p.__getitem__)
            out.append({"label": names[best], "probability": round(p[best], 6),
                        "probabilities": {n: round(v, 6) for n, v in zip(names, p, strict=True)}})
        return out

    def usage_lines(self, fmt: str) -> list[str]:
        return ["with torch.no_grad():", "    probs = model(**batch).logits.softmax(-1)",
                "for text, p in zip(texts, probs):",
                "    print(model.config.id2label[int(p.argmax())], round(float(p.max()), 3), text)"]


class Generation(Task):
    """What the generating tasks share: loss on target tokens, ROUGE on greedy or beam generation."""

    predicts = "texts"
    default_metrics = ("rouge",)

    def token_rows(self, tok: Any, bare: list[list[int]], table: Any, t: TokenizeConfig, desc: str) -> TokenRows:
        from stages.text.tokens import bare_ids, with_specials

        if "target" not in table.column_names:  # language modelling: every token is a label
            ids, lengths = with_specials(tok, bare, t.max_length)
            return TokenRows(ids, ids, lengths)
        bare_targets = bare_ids(tok, table.column("target").to_pylist(), t.batch_size, f"{desc} targets")
        target_ids, target_lengths = with_specials(tok, bare_targets, t.max_target_length)
        return self.with_targets(tok, bare, bare_targets, target_ids, target_lengths, t)

    def with_targets(self, tok: Any, bare: list[list[int]], bare_targets: list[list[int]],
                     target_ids: list[list[int]], target_lengths: list[int], t: TokenizeConfig) -> TokenRows:
        """Rows with targets, given the texts' and targets' bare ids and the targets with their specials."""
        raise NotImplementedError

    def prompts(self, input_ids: list[list[int]], labels: list[list[int]],
                starts: list[int] | None = None) -> list[list[int]]:
        """What generation starts from, for tokenized rows (`starts`: their prompt_length column)."""
        return [list(x) for x in input_ids]

    def validation_pass(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                        device: torch.device, module: str | None, tok: Any) -> dict[str, float]:
        loss_sum, units = self.summed_over(model, rows, order, pad_id, batch_size, device)
        out = {"val_loss": round(loss_sum / max(units, 1), 6)}
        if module is not None:
            out.update({f"val_{k}": round(v, 6) for k, v in
                        self.generation_scores(model, rows, tok, batch_size, device, module).items()})
        return out

    def generation_scores(self, model: torch.nn.Module, rows: Rows, tok: Any, batch_size: int,
                          device: torch.device, module: str) -> dict[str, float]:
        """Greedy generation of each row's target (as many new tokens as its longest target) scored by
        `module` against the decoded targets."""
        from stages.runtimes.inference import decoded_targets, generate, stop_token

        if tok is None:
            raise ValueError("validation by generation needs the tokenizer")
        got = rows.get(list(range(len(rows))))
        labels = [list(r["labels"]) for r in got]
        prompts = self.prompts([list(r["input_ids"]) for r in got], labels)
        refs = decoded_targets(tok, labels)
        longest = max((sum(t != IGNORE_INDEX for t in y) for y in labels), default=1)
        gen = {"max_new_tokens": max(longest, 1), "num_beams": 1, "do_sample": False,
               "eos_token_id": stop_token(tok, model), "pad_token_id": tok.pad_token_id}
        texts, _ = generate(model, prompts, tok, gen, batch_size, device, self.decoder_only, "validation")
        return {k: float(v) for k, v in metrics.compute([module], texts, refs).items()}

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: logging.Logger,
                 targets: Callable[[], list[str] | None]) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        from stages.runtimes.inference import generate

        refs = targets()
        if refs is None:
            return self.untargeted(model, rows, tok, batch_size, device, desc, log), None, []
        prompts = self.prompts(rows["input_ids"], rows["labels"], rows.get("prompt_length"))
        preds, counts = generate(model, prompts, tok, gen, batch_size, device, self.decoder_only, desc, log)
        return ({"examples": len(refs), **metrics.compute(scores, preds, refs),
                 "generated_tokens_mean": sum(counts) / max(len(counts), 1),
                 "generated_tokens_max": max(counts, default=0)}, preds, refs)

    def untargeted(self, model: torch.nn.Module, rows: dict[str, list], tok: Any, batch_size: int,
                   device: torch.device, desc: str, log: logging.Logger) -> dict[str, Any]:
        """What a split without target texts evaluates to."""
        raise MissingInputError(f"{desc}: the data has no target texts for ROUGE; set data.target_column")

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: dict[str, Any] | None, device: Any, log: logging.Logger) -> list[dict[str, Any]]:
        import copy

        from stages.runtimes.inference import generate

        gen = copy.deepcopy(generation["generation_config"])
        gen.update(**(overrides or {}))
        texts, counts = generate(model, ids, tok, {"generation_config": gen, "eos_token_id": gen.eos_token_id},
                                 batch_size, device, self.decoder_only, "predict", log)
        return [{"generated": t, "generated_tokens": n} for t, n in zip(texts, counts, strict=True)]

    def usage_lines(self, fmt: str) -> list[str]:
        gen = ", generation_config=GenerationConfig.from_pretrained(folder)" if fmt == "adapter" else ""
        lines = ["with torch.no_grad():  # generation_config.json: the evaluate stage's settings",
                 f"    out = model.generate(**batch{gen})"]
        if self.decoder_only:
            lines += ["out = out[:, batch[\"input_ids\"].shape[1]:]  # the continuation only"]
        return lines + ["for text in tok.batch_decode(out, skip_special_tokens=True):", "    print(text.strip())"]


class Seq2Seq(Generation):
    """seq2seq: an encoder-decoder generating the target from the text (summarisation); ROUGE."""

    name = "seq2seq"
    auto_class = "AutoModelForSeq2SeqLM"
    peft_task_type = "SEQ_2_SEQ_LM"
    pipeline_tag = "text2text-generation"
    examples = ["This bill amends the Internal Revenue Code to extend the tax credit for small businesses that "
                "hire veterans through 2030."]
    encoder_decoder = True

    def with_targets(self, tok: Any, bare: list[list[int]], bare_targets: list[list[int]],
                     target_ids: list[list[int]], target_lengths: list[int], t: TokenizeConfig) -> TokenRows:
        from stages.text.tokens import with_specials

        ids, lengths = with_specials(tok, bare, t.max_length)
        return TokenRows(ids, target_ids, lengths, target_lengths)

    def summed_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        import torch.nn.functional as F

        # labels make the model build its decoder inputs (shifted right); the loss is computed here, summed
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")


class CausalLM(Generation):
    """causal_lm: a decoder continuing prompt + target, the loss on the target tokens only (ROUGE); without
    targets, plain language modelling (perplexity)."""

    name = "causal_lm"
    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    pipeline_tag = "text-generation"
    examples = ["Once upon a time", "The three things to remember when you cook pasta for a crowd are"]
    chat_examples = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Answer in one sentence."},
                      {"role": "user", "content": "Why is the sky blue on a clear day, and red at sunset?"}]]
    decoder_only = True
    packs = True

    def with_targets(self, tok: Any, bare: list[list[int]], bare_targets: list[list[int]],
                     target_ids: list[list[int]], target_lengths: list[int], t: TokenizeConfig) -> TokenRows:
        from stages.text.tokens import prompt_then_target, with_specials

        prompts, _ = with_specials(tok, bare, None)  # untruncated: prompt_then_target cuts the prompt's head
        ids, labels, lengths, starts = prompt_then_target(tok, prompts, bare_targets, t)  # tokenized once
        return TokenRows(ids, labels, lengths, target_lengths, starts)

    def loss_units(self, batch: Batch) -> int:
        return int((batch.labels[:, 1:] != IGNORE_INDEX).sum())

    def summed_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        import torch.nn.functional as F

        # token t predicts token t+1. Packed rows (stages/text/packing.py): their position ids and no
        # attention mask, from which transformers builds a block-diagonal causal mask (only without a cache)
        if batch.position_ids is None:
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        else:
            out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        logits = out.logits[:, :-1]
        targets = batch.labels[:, 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def prompts(self, input_ids: list[list[int]], labels: list[list[int]],
                starts: list[int] | None = None) -> list[list[int]]:
        from stages.runtimes.inference import prompt_of

        if starts is not None:
            return [list(x)[:n] for x, n in zip(input_ids, starts, strict=True)]
        return [prompt_of(list(x), list(y)) for x, y in zip(input_ids, labels, strict=True)]

    def untargeted(self, model: torch.nn.Module, rows: dict[str, list], tok: Any, batch_size: int,
                   device: torch.device, desc: str, log: logging.Logger) -> dict[str, Any]:
        import torch

        from stages.runtimes.inference import batches

        total, units = 0.0, 0
        lengths = [len(x) for x in rows["input_ids"]]
        for idx in batches(lengths, batch_size, desc, log):
            b = self.collate([{"input_ids": rows["input_ids"][j], "labels": rows["labels"][j]} for j in idx],
                             tok.pad_token_id).to(device)
            total += float(self.summed_loss(model, b))
            units += self.loss_units(b)
        loss = total / max(units, 1)
        return {"examples": len(lengths), "loss": loss, "perplexity": float(torch.tensor(loss).exp()),
                "tokens": units}

    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        """Also stopping at the token that closes an assistant turn under the chat template (what the tokenize
        stage labels in conversations), when it is not the end token already."""
        from stages.runtimes.inference import end_of_turn, generation_kwargs

        kw = generation_kwargs(e, tok, model)
        eot, eos = end_of_turn(tok), kw["eos_token_id"]
        if eot is not None and eot != eos:
            kw["eos_token_id"] = eot if eos is None else [eot, eos]
        return kw

    def prompt_ids(self, tok: Any, ids: list[list[int]]) -> list[list[int]]:
        from stages.models.hf import special_affixes

        _, tail = special_affixes(tok)  # the prompt without its closing special (evaluate's prompt_of)
        return [x[:len(x) - len(tail)] if tail else x for x in ids]


TASKS: dict[str, Task] = {t.name: t for t in (Classification(), Seq2Seq(), CausalLM())}


def task_of(name: str) -> Task:
    """The task `model.task` names."""
    task = TASKS.get(name)
    if task is None:
        raise ConfigError(f"model.task: {name!r} is not one of {', '.join(TASKS)}; set model.task to one of them")
    return task
