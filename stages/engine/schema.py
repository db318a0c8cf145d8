"""The schema of pipeline.yaml: one pydantic model per section, mirroring the YAML one to one. Every field
carries its description (the README's configuration reference is generated from it: `python -m
stages.engine.reference`). Fields made with `runtime(...)` do not change outputs and stay out of cache keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SECTIONS = ("data", "tokenize", "model", "quantization", "adapters", "train", "evaluate", "export")


def runtime(default: Any = None, **kw: Any) -> Any:
    """A field that does not change what a stage produces: excluded from cache keys."""
    return Field(default, json_schema_extra={"runtime": True}, **kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def cache_dict(self) -> dict[str, Any]:
        """The fields that change outputs, as JSON-able data (runtime fields dropped)."""
        out = {}
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra or {}
            if isinstance(extra, dict) and extra.get("runtime"):
                continue
            value = getattr(self, name)
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
    seed: int = 1
    train: int | None = Field(None, ge=1, description="rows (shuffle_concat)")
    validation: int | float | None = Field(None, ge=0, description="rows, or a fraction of train when < 1")
    test: int | float | None = Field(None, ge=0, description="rows, or a fraction (only when the source has no test)")

    @model_validator(mode="after")
    def _counts(self) -> SplitConfig:
        if self.mode == "shuffle_concat" and (self.train is None or self.validation is None or self.test is None):
            raise ValueError("shuffle_concat needs train, validation and test row counts")
        return self


class DataConfig(Section):
    source: Literal["imdb", "billsum", "local"] = "imdb"
    path: str | None = Field(None, description="local: a CSV / JSONL / Parquet file, a folder of split files, "
                             "an aclImdb folder or aclImdb_v1.tar.gz")
    hub_id: str | None = Field(None, description="dataset id on the hub; default stanfordnlp/imdb or billsum")
    hub_revision: str | None = None
    mirror: str | None = runtime(None, description="offline mirror laid out like ../shared/data (imdb/, billsum/); "
                                 "$FINETUNE_DATA_MIRROR wins. Its files' content is in the key, not its path.")
    text_column: str = "text"
    label_column: str | None = "label"
    target_column: str | None = None
    split: SplitConfig = SplitConfig()
    subset: dict[Literal["train", "validation", "test"], int] | None = Field(
        None, description="keep only the first N rows of a split after splitting (small CPU runs)")

    @model_validator(mode="after")
    def _local_needs_path(self) -> DataConfig:
        if self.source == "local" and not self.path:
            raise ValueError("source 'local' needs data.path (a CSV/JSONL/Parquet file or folder)")
        if self.subset and any(v < 1 for v in self.subset.values()):
            raise ValueError("subset sizes must be >= 1")
        return self


class TokenizeConfig(Section):
    tokenizer: str | None = Field(None, description="hub id, folder or pkg:... ; default: the model's")
    max_length: int = Field(1024, ge=8, le=1_000_000)
    max_target_length: int | None = Field(None, ge=1)
    prefix: str = ""
    batch_size: int = runtime(1000, ge=1)


class ModelConfig(Section):
    name: str = Field(..., description="hub id, local folder, GGUF file, or pkg:PACKAGE/RELATIVE/PATH")
    revision: str | None = None
    gguf_file: str | None = None
    task: Literal["seq_cls", "seq2seq", "causal_lm"] = "seq_cls"
    num_labels: int | None = Field(2, ge=2)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    from_config: dict[str, Any] | None = Field(
        None, description="build a randomly initialised model from this transformers config (tests, memory bench)")
    init_seed: int = Field(0, description="seed for random models and newly initialised heads (score, classifier)")
    memory_check: bool = runtime(True, description="stop before loading when the estimated footprint exceeds "
                                 "the device's free memory")


class QuantizationConfig(Section):
    mode: Literal["none", "8bit", "4bit"] = "none"
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = False
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU")
    skip_modules: list[str] = Field(default_factory=list, description="modules never quantized, besides the heads "
                                    "(score, classifier, lm_head) and tied embeddings")
    quantize_fp32_modules: bool = Field(False, description="also quantize the modules a model keeps in fp32 "
                                        "(T5's wo); smaller, but those layers lose their fp32 precision")


class AdaptersConfig(Section):
    method: Literal["full", "lora"] = "full"
    r: int = Field(8, ge=1)
    alpha: float = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=list)
    modules_to_save: list[str] = Field(default_factory=list)
    bias: Literal["none", "all", "lora_only"] = "none"
    init_seed: int = Field(0, description="seed for the initial LoRA weights")

    @model_validator(mode="after")
    def _lora_targets(self) -> AdaptersConfig:
        if self.method == "lora" and not self.target_modules:
            raise ValueError("method 'lora' needs target_modules (e.g. [q_proj, v_proj])")
        return self


class TrainConfig(Section):
    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    epochs: float = Field(1, gt=0)
    max_steps: int | None = Field(None, ge=1)
    optimizer: Literal["adam", "adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = "adamw_torch"
    lr: float = Field(5e-5, gt=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = Field(None, gt=0)
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"
    gradient_checkpointing: bool = False
    group_by_length: bool = True
    seed: int = 123
    checkpoint_every: int = runtime(50, ge=1)
    keep_checkpoints: int = runtime(2, ge=1)
    log_every: int = runtime(10, ge=1)
    num_processes: int = Field(1, ge=1, description="processes training together, one per GPU (gloo processes on "
                               "a CPU-only machine); > 1 runs the stage under `accelerate launch` with DDP. "
                               "Effective batch = micro_batch_size x gradient_accumulation_steps x num_processes, "
                               "so it is in the key")
    main_process_port: int | None = runtime(None, ge=1, le=65535, description="num_processes > 1: the port the "
                                            "processes rendezvous on; default a free one")
    accelerate_config: str | None = runtime(None, description="num_processes > 1: an `accelerate config` file "
                                            "(machine settings such as gpu_ids) for accelerate launch; DDP only "
                                            "(distributed_type MULTI_GPU / MULTI_CPU)")


class EvaluateConfig(Section):
    splits: list[Literal["train", "validation", "test"]] = Field(
        default_factory=lambda: ["test"], min_length=1, description="splits to evaluate, each in metrics.json")
    batch_size: int = Field(8, ge=1, description="rows per forward / generate call (in the key: padding and "
                            "batched beam search can change generated text at float precision)")
    max_examples: int | None = Field(None, ge=1, description="evaluate only the first N rows of each split")
    num_beams: int = Field(1, ge=1, description="1: greedy decoding; more: beam search (seq2seq, causal_lm)")
    max_new_tokens: int = Field(128, ge=1, description="generation limit per example")
    length_penalty: float = Field(1.0, description="beam search only: > 1 favours longer, < 1 shorter outputs")
    log_examples: int = runtime(3, ge=0, description="predictions shown in the log per split")


class ExportConfig(Section):
    merge: bool = Field(False, description="LoRA: also write merged/ (base dequantized to merged_dtype, LoRA "
                        "merged in, safetensors + tokenizer + config)")
    merged_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the merged model's weights (and of a full finetune's model/)")


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    extends: str | None = None
    data: DataConfig = DataConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    model: ModelConfig
    quantization: QuantizationConfig = QuantizationConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()
    overrides: list[str] = Field(default_factory=list, description="the `--set` overrides this config was "
                                 "loaded with, as given (set by the loader, never in pipeline.yaml); the export "
                                 "card's reproduce command repeats them")
