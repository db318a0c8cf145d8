"""The schema of pipeline.yaml: one pydantic model per section, mirroring the YAML one to one. Every field
carries its description (the configuration reference in docs/configuration.md is generated from it: `python -m
stages.pipeline.reference`). Fields made with `runtime(...)` do not change outputs and stay out of cache keys.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from stages.engine.names import Name
from stages.pipeline.choices import OneOf, choice_of
from stages.pipeline.sweep_schema import SweepConfig  # noqa: F401  (one entry of `sweeps:`, re-exported)

MAX_EPOCHS = 10_000  # passes over the train split (train.epochs)
MAX_MICRO_BATCH = 65_536  # rows in one forward pass (train.micro_batch_size)
SOURCE_NAMES = OneOf("stages.sources", "SOURCES")  # data.source: a module of stages/sources each
FORMAT_NAMES = OneOf("stages.formats", "FORMATS")  # export.formats: a module of stages/formats each
SECTIONS = ("method", "data", "tokenize", "model", "quantization", "adapters", "train", "evaluate", "export", "tracking")


def runtime(default: Any = None, **kw: Any) -> Any:
    """A field that does not change what a stage produces: excluded from cache keys."""
    return Field(default, json_schema_extra={"runtime": True}, **kw)


def fix(text: str) -> dict[str, Any]:
    """A field's extra: what to do instead of a value above its bound, added to that error's line."""
    return {"fix": text}


def is_runtime(field: FieldInfo) -> bool:
    """A field made with `runtime(...)`: it does not change outputs, so it stays out of cache keys."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("runtime"))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # nan and inf: one clear line

    @model_validator(mode="before")
    @classmethod
    def _boolean_words(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if isinstance(value, bool) and field is not None and (word := choice_of(value, field.annotation)):
                out[name] = word
        return out

    def ignored(self) -> frozenset[str]:
        """Fields this section's other settings leave unread (split.train under mode source)."""
        return frozenset()

    def cache_dict(self) -> dict[str, Any]:
        """The fields that change outputs, as JSON-able data (runtime fields dropped). An ignored field counts
        as its default: a value there changes no key, and the card and the exported pipeline leave it out."""
        out = {}
        ignored = self.ignored()
        for name, field in type(self).model_fields.items():
            if is_runtime(field):
                continue
            value = field.get_default(call_default_factory=True) if name in ignored else getattr(self, name)
            out[name] = value.cache_dict() if isinstance(value, Section) else _jsonable(value)
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class SplitConfig(Section):
    mode: Literal["shuffle_concat", "source"] = Field(
        "source",
        description="shuffle_concat: concatenate every source split, shuffle with `seed`, cut train/validation/test "
        "by counts (the BLOOM article's IMDB split). source: keep the source's train/test, carve validation "
        "(and test, when the source has none) from train with `seed`.",
    )
    seed: int = Field(1, description="seed of the shuffle (shuffle_concat) or of the rows carved from train (source)")
    train: int | None = Field(None, ge=1, description="shuffle_concat: rows of the train split (required there); "
                               "source mode ignores it, and so do keys, the model card and the exported pipeline")
    validation: int | float | None = Field(None, ge=0, description="rows; source mode: a fraction of train when < 1, "
                                           "carved from train")
    test: int | float | None = Field(None, ge=0, description="rows; source mode: a fraction of train when < 1, "
                                     "carved from train only when the source has no test split")

    def ignored(self) -> frozenset[str]:
        return frozenset({"train"}) if self.mode == "source" else frozenset()

    @model_validator(mode="after")
    def _counts(self) -> SplitConfig:
        if self.mode == "shuffle_concat" and (self.train is None or self.validation is None or self.test is None):
            raise ValueError("shuffle_concat needs train, validation and test row counts")
        return self


class DataConfig(Section):
    source: Annotated[str, AfterValidator(SOURCE_NAMES)] = Field(
        "imdb", description="imdb: 50,000 movie reviews, labels 0 negative / 1 positive; billsum: US bills with "
        "their summaries (seq2seq); both from the offline mirror when it has them, else the hub. local: the "
        "file(s) at `path`.")
    path: str | None = runtime(None, description="local: a CSV, TSV or JSONL file (each also .gz), a JSON "
                               "array of objects (.json, `[{\"text\": ..., \"label\": ...}, ...]`), a Parquet file, a "
                               "folder of split files (named `train*`, `validation*`, `test*`), an aclImdb folder "
                               "or aclImdb_v1.tar.gz; relative: to the config file's folder (a "
                               "--set value: to the current directory), made absolute when loaded. Its files' "
                               "content (and their names) is in the data stage's key, not the path: moving the "
                               "file keeps the cache, but for the export stage, whose pipeline file names it")
    hub_id: str | None = Field(None, description="dataset id on the hub; default: the source's own "
                                  "(its module in stages/sources names it)")
    hub_revision: str | None = Field(None, description="branch, tag or commit of the hub dataset; default its "
                                     "main branch")
    mirror: str | None = runtime(None, description="offline mirror laid out like ../shared/data (imdb/, billsum/); "
                                 "$FINETUNE_DATA_MIRROR wins. Its files' content is in the key, not its path.")
    text_column: str = Field("text", description="column holding the input text")
    label_column: str | None = Field("label", description="classify: column of the class of each row: integer "
                                     "ids 0 .. model.num_labels - 1, or names (strings), which map to ids by "
                                     "data.label_names")
    label_names: list[str] | None = Field(None, min_length=2, description="classify: the class names in id order "
                                          "(id i is label_names[i]). null: derived before the run from the data: "
                                          "neg/pos for IMDB and aclImdb, the sorted distinct names of a string "
                                          "label column, none for integer labels. The model's id2label, the "
                                          "export card and predictions.jsonl carry them.")
    target_column: str | None = Field(None, description="seq2seq / sft: column of the target text; default "
                                      "`summary` for billsum")
    format: Literal["columns", "alpaca", "messages", "conversation"] = Field(
        "columns", description="how a row holds its example. columns: text_column (+ label_column or "
        "target_column: prompt/completion). alpaca: `instruction`, optional `input` and `output` columns, "
        "asked and answered as one user and one assistant turn. messages (sft): messages_column holds "
        "a conversation, a list of {role, content} turns (system / user / assistant, multi-turn), rendered with "
        "the chat template (docs/chat.md). conversation (sft): each row's turns written from its columns by "
        "data.conversation")
    messages_column: str = Field("messages", description="messages: the column holding each row's conversation")
    message_fields: dict[str, str] = Field(
        default_factory=lambda: {"role": "role", "content": "content"},
        description="messages: the keys of a turn that hold its role and its text (ShareGPT: {role: from, "
        "content: value})")

    @field_validator("message_fields")
    @classmethod
    def _role_and_content(cls, v: dict[str, str]) -> dict[str, str]:
        if set(v) - {"role", "content"}:
            raise ValueError(f"keys {sorted(set(v) - {'role', 'content'})}: only role and content can be mapped")
        return {"role": "role", "content": "content", **v}

    conversation: dict[Literal["system", "user", "assistant"], str] | None = Field(
        None, description="conversation: the turns of a row as Python format strings over its columns, e.g. "
        "{user: \"{text}\\n\\nPositive or negative?\", assistant: \"{label}\"}; {label} is the class of "
        "the row's data.label_column: label_names[id] for an integer id, a name as it is. user and assistant are "
        "required, system optional")

    @model_validator(mode="after")
    def _conversation_turns(self) -> DataConfig:
        if self.format == "conversation" and not (self.conversation and {"user", "assistant"} <= set(self.conversation)):
            raise ValueError("data.format conversation: set data.conversation with at least user and assistant, "
                             "e.g. {user: \"{text}\", assistant: \"{label}\"}")
        return self

    roles: dict[str, Literal["system", "user", "assistant"]] = Field(
        default_factory=dict, description="messages: other role names mapped to system / user / assistant "
        "(ShareGPT: {human: user, gpt: assistant})")
    split: SplitConfig = Field(SplitConfig(), description="how train / validation / test are made (see data.split.*)")
    subset: dict[Literal["train", "validation", "test"], int] | None = Field(
        None, description="keep only the first N rows of a split after splitting (small CPU runs)")

    @model_validator(mode="after")
    def _local_needs_path(self) -> DataConfig:
        if self.source == "local" and not self.path:
            raise ValueError("source 'local' needs data.path (a CSV/TSV/JSONL/JSON/Parquet file or folder)")
        if self.subset and any(v < 1 for v in self.subset.values()):
            raise ValueError("subset sizes must be >= 1")
        return self


class TokenizeConfig(Section):
    tokenizer: str | None = Field(None, description="hub id, local folder or pkg:PACKAGE/RELATIVE/PATH; default: "
                                  "the model's (model.name, its GGUF file included)")
    max_length: int = Field(1024, ge=8, le=1_000_000, description="tokens per input row, special tokens included; "
                            "longer inputs are truncated (sft: prompt + target, the prompt's head is cut)")
    max_target_length: int | None = Field(None, ge=1, description="seq2seq / sft: tokens per target, longer "
                                          "targets truncated; default max_length")
    prefix: str = Field("", description="text prepended to every input before tokenizing (T5: \"summarize: \")")
    chat_template: str | None = Field(None, description="sft with data.format messages or alpaca: the Jinja "
                                      "chat template the conversations are rendered with. null: the tokenizer's "
                                      "own (its model folder's or GGUF file's); a path to a .jinja file (its "
                                      "content is in the key); else an inline Jinja string")
    loss_on: Literal["auto", "assistant", "completion", "all"] = Field(
        "auto", description="sft: which tokens carry the loss. assistant: every assistant turn (its "
        "closing end-of-turn token included, so the model learns to stop); completion: the target after the "
        "prompt; all: every token. auto: assistant for conversations (messages, alpaca), completion for "
        "prompt/completion, all without a target")
    packing: bool = Field(False, description="sft: concatenate the train split's rows into sequences of up "
                          "to max_length tokens, position ids restarting per row and attention that cannot cross "
                          "rows (validation and test stay one row per sequence)")
    batch_size: int = runtime(1000, ge=1, description="rows per tokenizer call (speed and memory only)")


class ModelConfig(Section):
    name: str = Field(..., description="hub id, local folder, GGUF file, or pkg:PACKAGE/RELATIVE/PATH")
    revision: str | None = Field(None, description="branch, tag or commit of the hub model; default its main branch")
    gguf_file: str | None = Field(None, description="the GGUF file inside the hub repo or folder `name` (when `name` "
                                  "is not itself a .gguf file); its weights are dequantized on load")
    num_labels: int | None = Field(2, ge=2, description="a classifier's number of classes (method classify); null "
                                   "for the other methods, and for classify: inferred (the count of data.label_names, or the largest "
                                   "integer label + 1)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the weights that are not quantized. auto: float32 unquantized (mixed "
        "precision keeps fp32 master weights), quantization.compute_dtype when quantized")
    trust_remote_code: bool = Field(False, description="let transformers run model code shipped with the "
                                    "checkpoint (only for sources you trust)")
    from_config: dict[str, Any] | None = Field(
        None, description="build a randomly initialised model from this transformers config (tests, memory bench)")
    init_seed: int = Field(0, description="seed for random models and newly initialised heads (score, classifier)")
    memory_check: bool = runtime(True, description="stop before loading when the estimated footprint exceeds "
                                 "the device's free memory")


class QuantizationConfig(Section):
    mode: Literal["none", "8bit", "4bit"] = Field(
        "none", description="bitsandbytes quantization of the base model's Linear weights. none: unquantized; "
        "8bit: LLM.int8; 4bit: quant_type with 16/32-bit compute (QLoRA)")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4bit only. nf4: NormalFloat4 (the QLoRA paper's, "
                                               "for normally distributed weights); fp4: 4-bit float")
    double_quant: bool = Field(False, description="4bit only: quantize the per-block scales too (8-bit, ~0.37 "
                               "bits per parameter saved)")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU; resolved before "
        "the keys when quantized, so the model key holds the dtype used")
    skip_modules: list[str] = Field(default_factory=list, description="modules never quantized, besides the heads "
                                    "(score, classifier, lm_head) and tied embeddings")
    quantize_fp32_modules: bool = Field(False, description="also quantize the modules a model keeps in fp32 "
                                        "(T5's wo); smaller, but those layers lose their fp32 precision")


class AdaptersConfig(Section):
    method: Literal["full", "lora"] = Field(
        "full", description="full: every weight of the model is trained; lora: the base is frozen and LoRA "
        "adapters (PEFT) on target_modules are trained, plus modules_to_save")
    r: int = Field(8, ge=1, description="lora: rank of the LoRA matrices A (r x in) and B (out x r)")
    alpha: float = Field(16, gt=0, description="lora: scaling; the adapter's update is multiplied by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora: dropout probability on the adapter's input")
    target_modules: list[str] = Field(default_factory=list, description="lora: names (or name suffixes) of the "
                                      "Linear modules that get adapters, e.g. [q_proj, v_proj]; required for lora")
    modules_to_save: list[str] = Field(default_factory=list, description="lora: modules trained in full and saved "
                                       "with the adapter, e.g. a new head [classifier] or [lm_head]")
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", description="lora: which biases train. none; all: every bias of the model; lora_only: the biases "
        "of the modules that get adapters")
    init_seed: int = Field(0, description="seed for the initial LoRA weights")

    @model_validator(mode="after")
    def _lora_targets(self) -> AdaptersConfig:
        if self.method == "lora" and not self.target_modules:
            raise ValueError("method 'lora' needs target_modules (e.g. [q_proj, v_proj])")
        return self


LOWER_IS_BETTER = ("loss",)


class SelectBest(Section):
    metric: str = Field(..., pattern=r"^val_\w+$", description="validation metric to select on, val_<name>: "
                        "val_loss (mean per row or target token); classify: val_accuracy, val_macro_f1; seq2seq / "
                        "sft: val_rouge1, val_rouge2, val_rougeL, val_rougeLsum, val_exact_match (greedy generation of the "
                        "validation rows, up to tokenize.max_target_length tokens). Checked against the method at "
                        "plan time")
    mode: Literal["max", "min"] | None = Field(None, description="max: higher is better; min: lower is better; "
                                               "null: min for val_loss, max for the others")

    @model_validator(mode="before")
    @classmethod
    def _default_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") is None and isinstance(data.get("metric"), str):
            lower = data["metric"].removeprefix("val_") in LOWER_IS_BETTER
            return {**data, "mode": "min" if lower else "max"}
        return data


class EarlyStopping(Section):
    patience: int = Field(..., ge=1, description="validations in a row without an improvement before training stops")
    min_delta: float = Field(0.0, ge=0, description="an improvement must exceed this (in the metric's units) to "
                             "reset the patience count")


class TrainConfig(Section):
    micro_batch_size: int = Field(1, ge=1, le=MAX_MICRO_BATCH, description="rows per forward/backward pass (a "
                                  "CUDA out-of-memory error halves it and doubles accumulation)",
                                  json_schema_extra=fix("for a larger effective batch, raise "
                                                        "train.gradient_accumulation_steps"))
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-batches per optimizer step; effective "
                                             "batch = micro_batch_size x gradient_accumulation_steps x "
                                             "num_processes x num_machines rows, the loss normalised over all of it")
    epochs: float = Field(1, gt=0, le=MAX_EPOCHS, description="passes over the train split, may be fractional; "
                          "max_steps wins when set", json_schema_extra=fix("for a run of a given length, set "
                                                                           "train.max_steps (optimizer steps)"))
    max_steps: int | None = Field(None, ge=1, description="optimizer steps to train; null: from epochs")
    optimizer: Literal["adam", "adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw_torch", description="adam: torch Adam (the BLOOM article's; weight decay as L2); adamw_torch: "
        "torch AdamW; adamw_8bit: bitsandbytes AdamW with 8-bit states (2 instead of 8 bytes per trainable "
        "parameter); paged_adamw_8bit: the same, paged to CPU memory under GPU memory pressure (non-paged on CPU)")
    lr: float = Field(5e-5, gt=0, lt=1, description="peak learning rate, reached after warmup_steps")
    weight_decay: float = Field(0.0, ge=0, description="weight decay of matrices; biases and norm weights never "
                                "decay")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning rate after warmup_steps of linear warmup: constant; linear decay to 0 "
        "at the last step; cosine decay to 0 at the last step")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup from 0 to lr")
    max_grad_norm: float | None = Field(None, gt=0, description="clip the gradients' global L2 norm to this "
                                        "before each optimizer step; null: no clipping")
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = Field(
        "auto", description="autocast of forward/backward (and of the evaluate stage's forward passes), fp32 "
        "master weights. auto: bf16 on GPUs that have it, fp16 + gradient scaler on older GPUs; on a CPU bf16 "
        "where it has bf16 units (amx_bf16 or avx512_bf16), else fp32; resolved before the keys, which hold the "
        "precision used. no: fp32; fp16: CUDA only; bf16")
    gradient_checkpointing: bool = Field(False, description="recompute activations during backward instead of "
                                         "keeping them: less memory, about one more forward pass of compute")
    group_by_length: bool = Field(True, description="true: seeded effective batches of similar lengths (less "
                                  "padding); false: plain seeded shuffle. Batches are padded to their own longest "
                                  "row either way")
    seed: int = Field(123, description="seed of the batch order, dropout and every other random draw of training")
    checkpoint_every: int = runtime(50, ge=1, description="optimizer steps between resume checkpoints (and at the "
                                    "last step)")
    keep_checkpoints: int = runtime(2, ge=1, description="resume checkpoints kept, the most recent ones")
    log_every: int = runtime(10, ge=1, description="optimizer steps between log lines (with the gradient norm "
                             "before clipping); metrics.jsonl and TensorBoard record every step")
    num_processes: int = Field(1, ge=1, description="processes training together on this machine, one per GPU "
                               "(gloo processes on a CPU-only machine); > 1 (or num_machines > 1) runs the stage "
                               "under `accelerate launch` with DDP. Effective batch = micro_batch_size x "
                               "gradient_accumulation_steps x num_processes x num_machines, so it is in the key")
    num_machines: int = Field(1, ge=1, description="machines training together, num_processes each: every machine "
                              "runs the same pipeline command with its own machine_rank and the same "
                              "main_process_ip / main_process_port (torchrun's rendezvous); part of the global "
                              "batch, so in the key")
    machine_rank: int = runtime(0, ge=0, description="num_machines > 1: this machine's rank, 0 .. num_machines - 1. "
                                "Machine 0 hosts the rendezvous, and its first process alone writes checkpoints "
                                "and the artifact; on the others the run commits nothing and stops after train")
    main_process_ip: str | None = runtime(None, description="num_machines > 1: the address of machine 0, reachable "
                                          "from every machine (required there)")
    main_process_port: int | None = runtime(None, ge=1, le=65535, description="num_processes > 1: the port the "
                                            "processes rendezvous on (machine 0's); default a free one on one "
                                            "machine, required with num_machines > 1")
    accelerate_config: str | None = runtime(None, description="num_processes > 1: an `accelerate config` file "
                                            "(machine settings such as gpu_ids) for accelerate launch; DDP only "
                                            "(distributed_type MULTI_GPU / MULTI_CPU)")
    # training health (stages/training/health.py)
    eval_every: int | None = Field(None, ge=1, description="optimizer steps between validations during training, "
                                   "besides the one at each epoch end; null: epoch ends (and a fractional last "
                                   "epoch's end) only")
    eval_max_examples: int | None = Field(None, ge=1, description="validate on the first N rows of the validation "
                                          "split during training; null: all of it")
    select_best: SelectBest | None = Field(None, description="keep the weights of the best validation so far: the "
                                           "artifact's trained/ holds them, last/ the last step's; null: the last "
                                           "weights are the artifact's")
    early_stopping: EarlyStopping | None = Field(None, description="stop when select_best.metric has not improved for "
                                                 "`patience` validations; needs select_best; null: train every step")
    divergence_factor: float | None = runtime(10.0, gt=1, description="stop with a DivergenceError (exit 2, "
                                              "nothing committed, the work folder kept) when the loss averaged over "
                                              "the last 256 rows exceeds this many times its level: the median of "
                                              "that average before, or the first step's loss when lower (averages "
                                              "under 0.5 exempt); null: only a non-finite loss or gradient norm "
                                              "stops training")
    max_skipped_steps: int = runtime(25, ge=1, description="fp16 grad scaler: optimizer steps it may skip in a row "
                                     "(gradient overflow, counted and logged) before training counts as diverged")

    @model_validator(mode="after")
    def _early_stopping_watches_select_best(self) -> TrainConfig:
        if self.early_stopping is not None and self.select_best is None:
            raise ValueError("early_stopping watches select_best.metric: set train.select_best "
                             "(e.g. {metric: val_loss}) too")
        return self

    @model_validator(mode="after")
    def _machines_meet_at_one_address(self) -> TrainConfig:
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank {self.machine_rank} is not below num_machines {self.num_machines}: "
                             f"number the machines 0 .. {self.num_machines - 1}")
        if self.num_machines > 1 and (self.main_process_ip is None or self.main_process_port is None):
            raise ValueError("num_machines > 1 needs train.main_process_ip (machine 0's address, reachable from "
                             "every machine) and train.main_process_port (the same on every machine)")
        return self


class EvaluateConfig(Section):
    splits: list[Literal["train", "validation", "test"]] = Field(
        default_factory=lambda: ["test"],  # type: ignore[arg-type]  # mypy reads ["test"] as list[str]
        min_length=1, description="splits to evaluate, each in metrics.json")
    batch_size: int = Field(8, ge=1, description="rows per forward / generate call (in the key: padding and "
                            "batched beam search can change generated text at float precision)")
    max_examples: int | None = Field(None, ge=1, description="evaluate only the first N rows of each split")
    num_beams: int = Field(1, ge=1, description="1: greedy decoding; more: beam search (seq2seq, sft)")
    max_new_tokens: int = Field(128, ge=1, description="generation limit per example")
    length_penalty: float = Field(1.0, description="beam search only: > 1 favours longer, < 1 shorter outputs")
    log_examples: int = runtime(3, ge=0, description="predictions shown in the log per split")
    metrics: list[str] | None = Field(None, min_length=1, description="`evaluate` metric modules, each by name or "
                                      "path: accuracy, f1 (macro-F1), rouge (ROUGE-1/2/L/Lsum), exact_match (a "
                                      "short answer's first words equal the reference, both normalised) are the "
                                      "project's offline modules (stages/methods/metric_modules); a path is a local `evaluate` "
                                      "module (its file's content is in the key); any other name is loaded from "
                                      "the Hugging Face hub (online only). null: the task's: [accuracy, f1] for "
                                      "classify, [rouge] for generation")
    baseline: bool = Field(False, description="also evaluate the untuned model (LoRA switched off, or a full "
                           "finetune's base) on the same rows with the same settings: metrics.json's numbers "
                           "beside the zero-shot ones (baseline_metrics.json, baseline_predictions.jsonl), in the "
                           "summary as baseline vs tuned")


class ExportConfig(Section):
    layout: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="LoRA: what sits at the top of the export folder. adapter: the PEFT adapter "
        "(AutoPeftModelFor... loads it with its base, named by hub id and pinned commit); merged: the base with "
        "the LoRA merged in (AutoModelFor...), the adapter in adapter/. auto: adapter when the folder alone can "
        "rebuild the model that way (an unquantized hub base with its own head: seq2seq, sft), else "
        "merged (a package, local, GGUF or random base; a classifier's new head; a 4/8-bit base, dequantized). "
        "A full finetune's model is always at the top")
    merge: bool = Field(False, description="with the adapter at the top: also write merged/ (the base dequantized "
                        "to merged_dtype, LoRA merged in, safetensors + tokenizer + config)")
    merged_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the merged model's weights (and of a full finetune's model)")
    formats: list[Annotated[str, AfterValidator(FORMAT_NAMES)]] = Field(
        ["hf"], min_length=1, description="what the export folder holds. hf: the Hugging Face folder (always: "
        "`layout` says what is at its top), its tokenizer and card. onnx (classify, seq2seq; pip install "
        "'.[onnx]'): onnx/model.onnx (seq2seq: encoder.onnx and decoder.onnx) beside it, checked in onnxruntime "
        "against the exported model on the evaluated rows before the export is committed (docs/export.md#onnx). gguf (Llama-family causal LMs; pip install "
        "'.[gguf]'): gguf/model-<type>.gguf for each of gguf_types, the merged weights converted by llama.cpp's "
        "converter and checked in llama.cpp against the exported model's greedy generations on the evaluated "
        "prompts before the export is committed (docs/export.md#gguf). With onnx or gguf, layout auto puts "
        "the merged model at the top")
    onnx_int8: bool = Field(False, description="with onnx: also an int8 copy of each file (model_int8.onnx; "
                            "seq2seq: encoder_int8.onnx, decoder_int8.onnx), its weights quantized by onnxruntime's "
                            "dynamic quantization; its agreement with fp32 torch (a classifier's labels and "
                            "accuracy, a seq2seq's identical generations) is in the manifest and the card")
    gguf_types: list[Literal["f16", "q8_0"]] = Field(
        ["f16", "q8_0"], min_length=1, description="with gguf: the GGUF files written, one per type (the types "
        "llama.cpp's converter writes itself). f16 must give torch's greedy tokens on every checked prompt; "
        "q8_0's agreement is reported in the manifest and the card")
    gguf_check_tokens: int = Field(16, ge=1, description="with gguf: new tokens generated per evaluated prompt "
                                   "in the check (greedy, torch vs llama.cpp; stopping at the export's stop tokens)")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "format" in data:
            raise ValueError("export.format was renamed export.layout (what sits at the top of the folder; "
                             "export.formats lists the files beside it): write export.layout")
        return data

    @field_validator("formats")
    @classmethod
    def _hf_always(cls, v: list[str]) -> list[str]:
        if "hf" not in v:
            raise ValueError("the export folder is always a Hugging Face folder (its tokenizer and card are "
                             "there): list hf, e.g. [hf, onnx]")
        if len(set(v)) != len(v):
            raise ValueError(f"{v}: a format is listed twice")
        return v


class MlflowTracking(Section):
    enabled: bool | None = runtime(None, description="log each run to MLflow (docs/tracking.md). null: on when "
                                   "`uri` is set here; `--track` (FINETUNE_TRACK=1) turns it on for one command")
    uri: str | None = runtime(None, description="the MLflow tracking server, e.g. http://127.0.0.1:5000; default "
                              "MLFLOW_TRACKING_URI")
    experiment: str | None = runtime(None, description="the MLflow experiment the runs go to; default "
                                     "MLFLOW_EXPERIMENT_NAME, else `finetune`")


class TrackingConfig(Section):
    mlflow: MlflowTracking = runtime(MlflowTracking(), description="MLflow: one run per pipeline run, a parent "
                                     "run per sweep (pip install '.[mlflow]')")


# The methods' settings classes by method name (stages/methods/ fills it when imported; a user's method,
# MODULE:CLASS or path.py:CLASS, is loaded by `settings_loader`, which stages/methods/ sets too).
METHOD_SETTINGS: dict[str, type[MethodConfig]] = {}
settings_loader: list[Callable[[str], type[MethodConfig]]] = []
# pipeline files of before methods: model.task's values and the method each is now
LEGACY_TASKS = {"seq_cls": "classify", "seq2seq": "seq2seq", "causal_lm": "sft"}
_told: set[str] = set()


class MethodConfig(Section):
    """What is learned: the method's name, and its own settings (a method's settings class adds them)."""

    name: str = Field("classify", description="the training method, what is learned. classify: a classification "
                      "head on the model (accuracy, macro-F1); seq2seq: an encoder-decoder generating the target "
                      "(ROUGE); sft: a decoder continuing prompt + target, the loss on the target tokens only "
                      "(ROUGE; perplexity without targets); or your own method, MODULE:CLASS or path/to/file.py:CLASS "
                      "(docs/methods.md). `finetune methods` lists them")
    # the method's head (stages/models/heads.py), here so that model-side stages find it from the config alone
    head: ClassVar[str] = "seq_cls"


def method_settings(name: str) -> type[MethodConfig]:
    """The settings class of the method `name` (a ValueError listing the methods when there is none)."""
    if not METHOD_SETTINGS:
        # the registry sits above this schema in the layers: import it by name, which fills METHOD_SETTINGS
        importlib.import_module("stages.methods")
    if name in METHOD_SETTINGS:
        return METHOD_SETTINGS[name]
    if ":" in name and settings_loader:
        return settings_loader[0](name)
    raise ValueError(f"{name!r} is not a method; use one of {', '.join(METHOD_SETTINGS)}, or your own as "
                     f"MODULE:CLASS or path/to/file.py:CLASS (`finetune methods` lists them)")


# the config sections the export stage's model card prints; stages/graph.py declares them (with name,
# description) as export's reads
CARD_SECTIONS = ("method", "data", "tokenize", "model", "quantization", "adapters", "train", "evaluate", "export")


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name = Field(..., description="the pipeline's name, its key under `pipelines:` (set by the loader)")
    description: str = Field("", description="one line shown in listings and on the export card")

    extends: str | None = runtime(None, description="another pipeline whose settings this one is deep-merged "
                                  "over (only the merged values reach the keys)")
    method: SerializeAsAny[MethodConfig] = Field(MethodConfig(), description="the training method: `method: NAME`, "
                                                 "or a mapping with `name` and the method's own settings")
    data: DataConfig = Field(DataConfig(), description="the data stage: source, columns, splits")
    tokenize: TokenizeConfig = Field(TokenizeConfig(), description="the tokenize stage")
    model: ModelConfig = Field(..., description="the model stage: which model, how it is loaded")
    quantization: QuantizationConfig = Field(QuantizationConfig(), description="the model stage: bitsandbytes "
                                             "quantization")
    adapters: AdaptersConfig = Field(AdaptersConfig(), description="the adapters stage: full finetune or LoRA")
    train: TrainConfig = Field(TrainConfig(), description="the train stage")
    evaluate: EvaluateConfig = Field(EvaluateConfig(), description="the evaluate stage")
    export: ExportConfig = Field(ExportConfig(), description="the export stage")
    tracking: TrackingConfig = runtime(TrackingConfig(), description="experiment tracking (MLflow); never in a "
                                       "key, no stage reads it")
    overrides: list[str] = Field(default_factory=list, description="the `--set` overrides this config was "
                                 "loaded with, as given (set by the loader, never in pipeline.yaml); a stage that "
                                 "reads them sees those of the fields it reads")
    config_file: str | None = runtime(None, description="the user's pipeline file this config was loaded from, "
                                      "absolute (set by the loader; null for the project's pipeline.yaml): "
                                      "commands the project prints repeat it as --config")

    @model_validator(mode="before")
    @classmethod
    def _task_is_a_method_now(cls, data: Any) -> Any:
        """model.task (before methods) keeps loading: its method, with one line giving the new spelling."""
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or "task" not in model:
            return data
        task = model["task"]
        method = LEGACY_TASKS.get(task) if isinstance(task, str) else None
        if method is None:
            raise ValueError(f"model.task: {task!r} is not one of {', '.join(LEGACY_TASKS)}; model.task is spelled "
                             f"`method:` now (top level): one of {', '.join(LEGACY_TASKS.values())}")
        out = {**data, "model": {k: v for k, v in model.items() if k != "task"}}
        given = data.get("method")
        given_name = given.get("name") if isinstance(given, dict) else given
        if given_name is not None and given_name != method:
            raise ValueError(f"model.task {task} and method {given_name} disagree; drop model.task (spelled "
                             f"`method:` now)")
        out.setdefault("method", method)
        if task not in _told:
            _told.add(task)
            logging.getLogger("finetune.config").warning(
                "model.task: %s is spelled `method: %s` now (top level of the pipeline); loaded as that", task, method)
        return out

    @field_validator("method", mode="before")
    @classmethod
    def _method_settings(cls, value: Any) -> Any:
        """`method: NAME` or {name: NAME, its settings...}, validated by that method's settings class."""
        if isinstance(value, MethodConfig):
            return value
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict):
            raise ValueError("give a method's name, or a mapping with `name` and the method's settings")
        name = value.get("name", "classify")
        return method_settings(str(name)).model_validate({**value, "name": name})

    @model_validator(mode="after")
    def _packed_train_split_is_not_evaluated(self) -> PipelineConfig:
        if self.tokenize.packing and "train" in self.evaluate.splits:
            raise ValueError("evaluate.splits: the train split is packed (tokenize.packing: true), its rows are "
                             "not evaluated one by one; evaluate validation or test, or set tokenize.packing: false")
        return self

    def overrides_within(self, reads: Iterable[str]) -> list[str]:
        """The `--set` overrides that set a keyed (not runtime) field under one of the dotted paths `reads`:
        what a stage that reads `overrides` sees and is keyed on."""
        reads = [r for r in reads if r != "overrides"]
        return [o for o in self.overrides if self._keyed_within(o.split("=", 1)[0].strip(), reads)]

    def _keyed_within(self, path: str, reads: list[str]) -> bool:
        if not any(path == r or path.startswith(r + ".") for r in reads):
            return False
        obj: Any = self
        for part in path.split("."):
            field = type(obj).model_fields.get(part) if isinstance(obj, BaseModel) else None
            if field is None:
                return True  # a mapping's entry, or unknown to the schema (validation refused it): keep it
            if is_runtime(field) or (isinstance(obj, Section) and part in obj.ignored()):
                return False
            obj = getattr(obj, part)
        return True
