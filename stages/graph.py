"""The stage graph: each stage's body, the config fields it reads, its upstream and its input files.
A pipeline runs the core chain below plus the stages its method adds (`graph_for`: a graph per pipeline);
`--until`, `--only` and `--force` pick parts of it (`GRAPH.plan`, which plans each config on its own graph).

The bodies are named, not imported (Lazy): planning, and a run where every stage is a store hit, import no
torch or transformers. The engine never imports this module: commands plan with `GRAPH` and hand the plan
to the engine (stages/engine/runner.py executes it)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages import data, formats
from stages.engine.config import DEFAULT_PIPELINE_FILE
from stages.engine.plan import Graph, Plan, Project
from stages.engine.stage import Lazy, Stage
from stages.facts import EVALUATES, LOADS_MODEL, MAKES_TRAINABLE, SHIPS, TRAINS
from stages.methods.base import Method
from stages.methods.metrics import metric_files, validation_metric_files
from stages.methods.registry import BUILTIN, method_in, method_of, user_files
from stages.models.hf import (
    check_model_folder,
    check_tokenizer_folder,
    model_deps,
    model_input_files,
    tokenizer_deps,
    tokenizer_files,
)
from stages.models.precision import resolve_compute_dtype, resolve_mixed_precision
from stages.pipeline import tracking
from stages.pipeline.loading import SCHEMA, load_pipeline
from stages.pipeline.schema import CARD_SECTIONS, PipelineConfig
from stages.text import chat
from stages.training import distributed
from stages.training.train_checks import check_config

if TYPE_CHECKING:
    import argparse

    from stages.engine.store import Store


def check_model(cfg: PipelineConfig) -> None:
    """A local model folder: config.json parses, its weights are safetensors whose headers read, its own Python is
    trusted; then a local tokenizer folder (the model's, or tokenize.tokenizer) holds a vocabulary (plan time)."""
    check_model_folder(cfg)
    check_tokenizer_folder(cfg)


# The finetuning pipelines: validated against PipelineConfig; a run is refused at plan time when tracking that
# is on cannot work, and every run is tracked by a hook (MLflow, when on); `--track` turns it on.
PROJECT = Project(schema=SCHEMA, check_run=tracking.check, hooks=lambda: [tracking.Tracking()],
                  options=tracking.apply_option)

# What `inspect status` shows of a stage's manifest metrics, by name or dotted suffix, the first 4 found. exact_match
# before the ROUGE scores: a chat run's short answers (evaluate.metrics [exact_match, rouge]) are judged by it first.
HEADLINE = ("accuracy", "val_accuracy", "exact_match", "val_exact_match", "rouge1", "rouge2", "rougeL", "rougeLsum",
            "loss", "val_loss", "final_loss", "steps", "rows.train", "rows.validation", "rows.test", "trainable",
            "percent", "parameters", "footprint_bytes", "vocab_size", "train.input.mean", "files")

def check_training(cfg: PipelineConfig) -> None:
    check_config(cfg, data.makes_validation(cfg))
    method_in(cfg).check(cfg)


CORE: Graph[PipelineConfig] = Graph([
    Stage(
        name="data",
        body=data.run,
        reads=("data", "method.name", "model.num_labels"),
        inputs=data.source_files,
        deps=data.source_deps,
        resolve=data.resolve_labels,  # data.label_names / model.num_labels from the data when left null
        check=data.check_rows,  # conversations and text columns of local files, before any stage runs
        hub_fix="set FINETUNE_DATA_MIRROR to a folder laid out like ../shared/data, or --set data.source=local "
                "--set data.path=FILE",
        libraries=("pandas", "pyarrow", "datasets"),
        headline=HEADLINE,
    ),
    Stage(
        name="tokenize",
        body=Lazy("stages.tokenize", "run"),
        reads=("tokenize", "model.name", "model.revision", "model.gguf_file", "method.name",
               "model.trust_remote_code"),
        upstream=("data",),
        inputs=lambda cfg: tokenizer_files(cfg) + chat.template_files(cfg),  # a chat template file: its content
        check=lambda cfg: method_in(cfg).check(cfg),  # the method's settings against the pipeline's
        deps=tokenizer_deps,
        hub_fix="set tokenize.tokenizer (or model.name) to a local folder or pkg:PACKAGE/PATH, or run where the "
                "hub answers",
        libraries=("transformers", "tokenizers", "datasets", "pyarrow"),
        headline=HEADLINE,
    ),
    Stage(
        name="model",
        body=Lazy("stages.model", "run"),
        precheck=Lazy("stages.training.pipeline_memory", "check_pipeline_fits"),  # stop before loading when training cannot fit
        check=check_model,  # a folder's config.json, its weights (safetensors only), its code; a tokenizer's vocabulary
        reads=("model", "quantization", "tokenize.tokenizer", "data.label_names", "method.name"),  # names: id2label
        resolve=resolve_compute_dtype,  # quantized, auto -> the compute dtype this machine loads in, before the keys
        inputs=model_input_files,
        deps=model_deps,
        hub_fix="set model.name to a local folder, a .gguf file or pkg:PACKAGE/PATH, or run where the hub answers",
        libraries=("torch", "transformers", "bitsandbytes", "safetensors", "gguf"),
        headline=HEADLINE,
        role=LOADS_MODEL,
    ),
    Stage(
        name="adapters",
        body=Lazy("stages.adapters", "run"),
        reads=("adapters",),
        upstream=("model",),
        libraries=("torch", "transformers", "peft", "bitsandbytes", "safetensors"),
        headline=HEADLINE,
        role=MAKES_TRAINABLE,
    ),
    Stage(
        name="train",
        body=Lazy("stages.train", "run"),
        reads=("train", "method"),
        joins=lambda cfg: distributed.joining(cfg.train),  # machine_rank > 0: trains with machine 0, commits nothing
        upstream=("tokenize", "model", "adapters"),
        inputs=validation_metric_files,  # select_best's metric module (val_macro_f1, val_rouge*), loaded by path
        resolve=resolve_mixed_precision,  # auto -> the precision this machine trains in, before the keys
        reports=True,  # its loss and time are a run's headline numbers
        volatile=("metrics.jsonl", "tensorboard/*", "loss.png"),  # timings and event-file names: not the weights
        history="metrics.jsonl",  # a tracked run's step metrics (loss, lr, grad norm, tokens/s, validation)
        tracked=("loss.png",),
        check=check_training,  # every train setting and the method's, at plan time
        libraries=("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "datasets"),
        headline=HEADLINE,
        role=TRAINS,
    ),
    Stage(
        name="evaluate",
        body=Lazy("stages.evaluate", "run"),
        # its own section: changing beams / max_new_tokens / splits reruns this stage only
        reads=("evaluate", "method", "train.mixed_precision"),  # its forward passes' autocast
        upstream=("data", "tokenize", "model", "adapters", "train"),  # data: untruncated reference texts
        inputs=lambda cfg: metric_files(cfg, method_in(cfg)),  # the evaluate modules' files, by path
        reports=True,
        tracked=("metrics.json",),
        libraries=("torch", "transformers", "peft", "bitsandbytes", "datasets", "evaluate", "rouge_score"),
        headline=HEADLINE,
        role=EVALUATES,
    ),
    Stage(
        name="export",
        body=Lazy("stages.export", "run"),
        # the card and the exported pipeline file read every section against its schema defaults (the schema's
        # classes run: their defaults, validators and overrides_within)
        code=(PipelineConfig,),
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
        headline=HEADLINE,
        role=SHIPS,
    ),
], PROJECT)



# Which part of a method each core stage runs (and so has in its code fingerprint): the data stage its column
# needs, the model stage its settings (the head), the others the whole method.
METHOD_PARTS = {"data": "data", "tokenize": "method", "model": "settings", "train": "method", "evaluate": "method",
                "export": "method"}


def _roots(method: Method, part: str) -> tuple[Any, ...]:
    cls = type(method)
    if part == "settings":
        return (method.settings,)
    if part == "data":
        module = sys.modules[cls.__module__]
        return ((cls.__module__, "DATA"),) if getattr(module, "DATA", None) is method.data else (cls,)
    return (cls,)


def _with_files(inputs: Callable[[PipelineConfig], Any], name: str) -> Callable[[PipelineConfig], Any]:
    """A stage's input files plus a user's method modules (their content in the key), found as they are now."""
    def both(cfg: PipelineConfig) -> Any:
        got, files = inputs(cfg), user_files(name)
        if isinstance(got, dict):
            return {**got, **{f"method/{f.name}": f for f in files}}
        return [*got, *files]
    return both


@functools.cache
def _graph(name: str) -> Graph[PipelineConfig]:
    method, user = method_of(name), bool(user_files(name))
    added = method.stages()
    ups = method.upstream()
    out: list[Stage] = []
    for st in CORE:
        part = METHOD_PARTS.get(st.name)
        if part is not None:
            st = replace(st, code=(*st.code, *_roots(method, part)),
                         inputs=_with_files(st.inputs, name) if user else st.inputs)
        if st.name in ups:
            st = replace(st, upstream=(*st.upstream, *ups[st.name]))
        out.append(st)
    for st in added:  # right after the last of its upstream
        st = replace(st, code=(*st.code, type(method)),
                     inputs=_with_files(st.inputs, name) if user else st.inputs)
        at = max((i for i, s in enumerate(out) if s.name in st.upstream), default=-1) + 1
        out.insert(at, st)
    return Graph(out, PROJECT)


def graph_for(cfg: PipelineConfig) -> Graph[PipelineConfig]:
    """The graph one pipeline runs: the core stages plus those its method adds."""
    return _graph(cfg.method.name)


class Graphs(Graph[PipelineConfig]):
    """The graph of every pipeline: iterated, the core stages; planned or validated, each config on its own
    graph (graph_for); `--only` / `--until` / `--force` take
    every stage some built-in method's pipeline runs."""

    def __init__(self, core: Graph[PipelineConfig]):
        super().__init__(core.stages, core.project)
        extra = [s.name for name in BUILTIN for s in _graph(name).stages if s.name not in core.names]
        self.selectable = [*core.names, *dict.fromkeys(extra)]  # checked again on the pipeline's own graph

    def plan(self, cfg: PipelineConfig, *args: Any, **kwargs: Any) -> Any:
        return graph_for(cfg).plan(cfg, *args, **kwargs)

    def validate(self, cfg: PipelineConfig, *args: Any, **kwargs: Any) -> Any:
        return graph_for(cfg).validate(cfg, *args, **kwargs)

    def check_selection(self, force: Any = (), only: str | None = None, until: str | None = None) -> None:
        """Nothing before the config is known: the pipeline's own graph checks the names when it plans (a
        user's method may add stages of its own)."""


GRAPH = Graphs(CORE)


def plan_run(store: Store, pipeline: str, overrides: dict[str, Any] | list[str] | None = None,
             config: Path | str | None = None, *, only: str | None = None, until: str | None = None,
             force: Iterable[str] = (), verify: bool = False) -> Plan[PipelineConfig]:
    """A run's plan, made the one way every driver makes it: by a command line before anything starts
    (`python -m stages`, `finetune run`, which hands it to the flow), or by the flow itself for a run that
    arrives with parameters only (a deployment's, a sweep's child). Bad input raises one FinetuneError."""
    force = tuple(force)
    GRAPH.check_selection(force, only, until)
    cfg = load_pipeline(pipeline, overrides, config or DEFAULT_PIPELINE_FILE)
    return graph_for(cfg).plan(cfg, store, only=only, until=until, force=force, verify=verify)


def plan_args(args: argparse.Namespace, store: Store) -> Plan[PipelineConfig]:
    """`plan_run` for a command line's arguments, the project's options (`--track`) applied first."""
    PROJECT.options(args)
    return plan_run(store, args.pipeline, args.overrides, args.config, only=args.only, until=args.until,
                    force=args.force, verify=args.verify)
