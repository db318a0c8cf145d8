"""pipeline.yaml, validated. The pydantic models mirror the YAML one to one: `defaults` is deep-merged
under each named pipeline (which may `extends` another), then `--set` overrides, then validation.
Every problem becomes one line naming the YAML path it came from and the fix.

Fields marked `runtime` (device, logging, workers...) do not change outputs and stay out of cache keys.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stages.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PIPELINE_FILE = PROJECT_ROOT / "pipeline.yaml"
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



def store_root() -> str:
    """The artifact store: $FINETUNE_STORE (a path or an fsspec URL), else artifacts/ in the project."""
    return os.environ.get("FINETUNE_STORE") or str(PROJECT_ROOT / "artifacts")


# ---------------------------------------------------------------- loading


def _deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` -> (['train', 'lr'], 1e-4). Values are YAML (numbers, lists, null, strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE with a dotted key, e.g. --set train.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {text}: empty key segment; write a dotted key such as train.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text}: value is not valid YAML ({e.problem}); quote it") from None
    return parts, _numberish(value)


def _numberish(value: Any) -> Any:
    # YAML 1.1 reads 5e-5 as a string; people mean a number.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            return value
    if isinstance(value, dict):
        return {k: _numberish(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numberish(v) for v in value]
    return value


def overrides_to_dict(overrides: list[str] | dict[str, Any] | None) -> dict:
    """--set strings (or a {dotted.key: value} dict, as Prefect deployments pass) -> nested dict."""
    nested: dict = {}
    if not overrides:
        return nested
    items = (
        [parse_override(o) for o in overrides]
        if isinstance(overrides, list)
        else [(k.split("."), _numberish(v)) for k, v in overrides.items()]
    )
    for parts, value in items:
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {'.'.join(parts)}: {p} is set to a value and a section at once")
        node[parts[-1]] = value
    return nested


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"{path}: pipeline file not found; pass --config PATH or run from the project root")
    try:
        doc = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path.name}{where}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pipelines"), dict):
        raise ConfigError(f"{path.name}: needs a top-level 'pipelines:' mapping of named pipelines")
    unknown = set(doc) - {"defaults", "pipelines"}
    if unknown:
        raise ConfigError(f"{path.name}: unknown top-level key(s) {sorted(unknown)}; allowed: defaults, pipelines")
    if not isinstance(doc.get("defaults") or {}, dict):
        raise ConfigError(f"{path.name}: defaults must be a mapping of sections")
    return doc


def pipeline_names(path: Path = DEFAULT_PIPELINE_FILE) -> list[str]:
    return list(read_yaml(path)["pipelines"])


def _chain(doc: dict, name: str) -> list[tuple[str, dict]]:
    """The pipeline and the pipelines it extends, nearest first."""
    pipes = doc["pipelines"]
    chain, seen = [], set()
    while name is not None:
        if name in seen:
            raise ConfigError(f"pipelines.{name}.extends: cycle through {sorted(seen)}; break the loop")
        seen.add(name)
        body = pipes.get(name)
        if body is None:
            raise ConfigError(f"pipelines.{chain[-1][0]}.extends: unknown pipeline '{name}'; available: "
                              f"{', '.join(pipes)}")
        if not isinstance(body, dict):
            raise ConfigError(f"pipelines.{name}: must be a mapping of sections, got {type(body).__name__}")
        chain.append((name, body))
        name = body.get("extends")
    return chain


def load_pipeline(name: str, overrides: list[str] | dict | None = None,
                  path: Path | str = DEFAULT_PIPELINE_FILE) -> PipelineConfig:
    path = Path(path)
    doc = read_yaml(path)
    if name not in doc["pipelines"]:
        raise ConfigError(f"unknown pipeline '{name}'; available: {', '.join(doc['pipelines'])} "
                          f"(defined under pipelines: in {path.name})")
    chain = _chain(doc, name)
    merged = copy.deepcopy(doc.get("defaults") or {})
    for _, body in reversed(chain):
        merged = _deep_merge(merged, body)
    over = overrides_to_dict(overrides)
    merged = _deep_merge(merged, over)
    merged["name"] = name
    merged.pop("extends", None)
    try:
        return PipelineConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_describe(e, name, chain, doc.get("defaults") or {}, over)) from None


def _has(d: Any, loc: tuple) -> bool:
    for part in loc:
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def _origin(loc: tuple, name: str, chain: list, defaults: dict, over: dict) -> str:
    dotted = ".".join(str(p) for p in loc)
    for prefix in (loc[:i] for i in range(len(loc), 0, -1)):
        if _has(over, prefix):
            return f"--set {dotted}"
        for pname, body in chain:
            if _has(body, prefix):
                return f"pipelines.{pname}.{dotted}"
        if _has(defaults, prefix):
            return f"defaults.{dotted}"
    return f"pipelines.{name}.{dotted}"


def _describe(err: ValidationError, name: str, chain: list, defaults: dict, over: dict) -> str:
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
        kind, ctx, got = e["type"], e.get("ctx") or {}, e.get("input")
        where = _origin(loc, name, chain, defaults, over) if loc else f"pipelines.{name}"
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            valid = ", ".join(model.model_fields) if model else "see pipeline.yaml"
            msg = f"unknown key '{loc[-1]}'; valid keys here: {valid}"
        elif kind == "missing":
            msg = "required; add it to the pipeline or to defaults"
        elif kind in ("greater_than_equal", "greater_than", "less_than", "less_than_equal"):
            op = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}[kind]
            bound = next(iter(ctx.values()))
            bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
            msg = f"must be {op} {bound}, got {got!r}"
        elif kind == "literal_error":
            msg = f"must be one of {ctx.get('expected')}, got {got!r}"
        elif kind.endswith("_parsing") or kind.endswith("_type"):
            want = kind.split("_")[0]
            want = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                    "list": "a list", "dict": "a mapping", "model": "a mapping"}.get(want, want)
            msg = f"must be {want}, got {got!r}"
        elif kind == "value_error":
            msg = str(ctx.get("error", e["msg"]))
        else:
            msg = e["msg"]
        problems.append(f"{where}: {msg}")
    return "; ".join(problems)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = PipelineConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if model is None:
            return None
    return model
