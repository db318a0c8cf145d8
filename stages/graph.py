"""The stage graph: each stage's body, the config fields it reads, its upstream and its input files.
Every pipeline runs this chain; `--until`, `--only` and `--force` pick parts of it (`GRAPH.plan`).

The bodies are named, not imported (Lazy): planning, and a run where every stage is a store hit, import no
torch or transformers. The engine never imports this module: commands plan with `GRAPH` and hand the plan
to the engine (stages/engine/runner.py executes it)."""

from __future__ import annotations

from stages import data, formats
from stages.engine.plan import Graph
from stages.engine.stage import Lazy, Stage
from stages.methods.metrics import metric_files, validation_metric_files
from stages.methods.tasks import task_of
from stages.models.hf import (
    check_model_folder,
    check_tokenizer_folder,
    model_deps,
    model_input_files,
    tokenizer_deps,
    tokenizer_files,
)
from stages.models.precision import resolve_compute_dtype, resolve_mixed_precision
from stages.pipeline.schema import CARD_SECTIONS, PipelineConfig
from stages.text import chat
from stages.text.packing import check_packing
from stages.training import distributed
from stages.training.train_checks import check_config


def check_model(cfg: PipelineConfig) -> None:
    """A local model folder: config.json parses, its weights are safetensors whose headers read, its own Python is
    trusted; then a local tokenizer folder (the model's, or tokenize.tokenizer) holds a vocabulary (plan time)."""
    check_model_folder(cfg)
    check_tokenizer_folder(cfg)


GRAPH = Graph([
    Stage(
        name="data",
        body=data.run,
        reads=("data", "model.task", "model.num_labels"),
        inputs=data.source_files,
        deps=data.source_deps,
        resolve=data.resolve_labels,  # data.label_names / model.num_labels from the data when left null
        check=data.check_rows,  # conversations and text columns of local files, before any stage runs
        hub_fix="set FINETUNE_DATA_MIRROR to a folder laid out like ../shared/data, or --set data.source=local "
                "--set data.path=FILE",
        libraries=("pandas", "pyarrow", "datasets"),
    ),
    Stage(
        name="tokenize",
        body=Lazy("stages.tokenize", "run"),
        reads=("tokenize", "model.name", "model.revision", "model.gguf_file", "model.task",
               "model.trust_remote_code"),
        upstream=("data",),
        inputs=lambda cfg: tokenizer_files(cfg) + chat.template_files(cfg),  # a chat template file: its content
        check=check_packing,  # tokenize.packing for a task that packs
        deps=tokenizer_deps,
        hub_fix="set tokenize.tokenizer (or model.name) to a local folder or pkg:PACKAGE/PATH, or run where the "
                "hub answers",
        libraries=("transformers", "tokenizers", "datasets", "pyarrow"),
    ),
    Stage(
        name="model",
        body=Lazy("stages.model", "run"),
        precheck=Lazy("stages.training.pipeline_memory", "check_pipeline_fits"),  # stop before loading when training cannot fit
        check=check_model,  # a folder's config.json, its weights (safetensors only), its code; a tokenizer's vocabulary
        reads=("model", "quantization", "tokenize.tokenizer", "data.label_names"),  # names: the head's id2label
        resolve=resolve_compute_dtype,  # quantized, auto -> the compute dtype this machine loads in, before the keys
        inputs=model_input_files,
        deps=model_deps,
        hub_fix="set model.name to a local folder, a .gguf file or pkg:PACKAGE/PATH, or run where the hub answers",
        libraries=("torch", "transformers", "bitsandbytes", "safetensors", "gguf"),
    ),
    Stage(
        name="adapters",
        body=Lazy("stages.adapters", "run"),
        reads=("adapters",),
        upstream=("model",),
        libraries=("torch", "transformers", "peft", "bitsandbytes", "safetensors"),
    ),
    Stage(
        name="train",
        body=Lazy("stages.train", "run"),
        reads=("train", "model.task"),
        joins=lambda cfg: distributed.joining(cfg.train),  # machine_rank > 0: trains with machine 0, commits nothing
        upstream=("tokenize", "model", "adapters"),
        inputs=validation_metric_files,  # select_best's metric module (val_macro_f1, val_rouge*), loaded by path
        resolve=resolve_mixed_precision,  # auto -> the precision this machine trains in, before the keys
        reports=True,  # its loss and time are a run's headline numbers
        volatile=("metrics.jsonl", "tensorboard/*", "loss.png"),  # timings and event-file names: not the weights
        history="metrics.jsonl",  # a tracked run's step metrics (loss, lr, grad norm, tokens/s, validation)
        tracked=("loss.png",),
        check=lambda cfg: check_config(cfg, data.makes_validation(cfg)),  # every train setting, at plan time
        libraries=("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "datasets"),
    ),
    Stage(
        name="evaluate",
        body=Lazy("stages.evaluate", "run"),
        # its own section: changing beams / max_new_tokens / splits reruns this stage only
        reads=("evaluate", "model.task", "train.mixed_precision"),  # its forward passes' autocast
        upstream=("data", "tokenize", "model", "adapters", "train"),  # data: untruncated reference texts
        inputs=lambda cfg: metric_files(cfg, task_of(cfg.model.task)),  # the evaluate modules' files, by path
        reports=True,
        tracked=("metrics.json",),
        libraries=("torch", "transformers", "peft", "bitsandbytes", "datasets", "evaluate", "rouge_score"),
    ),
    Stage(
        name="export",
        body=Lazy("stages.export", "run"),
        # every section the model card prints; all but `export` are upstream's already (no extra reruns).
        # Downstream of evaluate: the card carries its metrics, generation_config.json its settings; `overrides`
        # are the --set options of these sections (the card's reproduce command), runtime ones dropped.
        # data.path: runtime for the data stage (its content is in that key), but the exported pipeline file
        # names it, so it is in this key: a moved data file re-exports rather than ship its old location.
        reads=("name", "description", "overrides", *CARD_SECTIONS, "data.path"),
        upstream=("tokenize", "model", "adapters", "train", "evaluate"),  # tokenize: the tokenizer shipped
        tracked=("README.md", "finetune_pipeline.yaml"),  # the model card and the pipeline that rebuilds it
        produces_model=True,
        check=formats.check_formats,  # each format listed possible for the pipeline, its extra installed
        libraries=("datasets", *formats.libraries()),  # datasets: the evaluated rows the formats are checked on
    ),
])


def graph_for(cfg: PipelineConfig) -> Graph:
    """The graph one pipeline runs: the core stages plus those its method adds."""
    return GRAPH
