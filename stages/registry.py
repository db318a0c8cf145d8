"""The stage graph: each stage's body, the config fields it reads, its upstream and its input files.
Every pipeline runs this chain; `--until`, `--only` and `--force` pick parts of it."""

from __future__ import annotations

from stages import adapters, data, memory, model, tokenize, train
from stages import evaluate as evaluate_stage
from stages import export as export_stage
from stages.hf import tokenizer_files
from stages.pipeline import Stage

STAGES: list[Stage] = [
    Stage(
        name="data",
        body=data.run,
        reads=("data", "model.task", "model.num_labels"),
        inputs=data.source_files,
        libraries=("pandas", "pyarrow", "datasets"),
    ),
    Stage(
        name="tokenize",
        body=tokenize.run,
        reads=("tokenize", "model.name", "model.revision", "model.gguf_file", "model.task",
               "model.trust_remote_code"),
        upstream=("data",),
        inputs=tokenizer_files,
        libraries=("transformers", "tokenizers", "datasets", "pyarrow"),
    ),
    Stage(
        name="model",
        body=model.run,
        precheck=memory.check_pipeline_fits,  # stop before loading when training cannot fit
        reads=("model", "quantization", "tokenize.tokenizer"),
        inputs=model.input_files,
        libraries=("torch", "transformers", "bitsandbytes", "safetensors", "gguf"),
    ),
    Stage(
        name="adapters",
        body=adapters.run,
        reads=("adapters",),
        upstream=("model",),
        libraries=("torch", "transformers", "peft", "bitsandbytes", "safetensors"),
    ),
    Stage(
        name="train",
        body=train.run,
        reads=("train", "model.task"),
        upstream=("tokenize", "model", "adapters"),
        libraries=("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "datasets"),
    ),
    Stage(
        name="evaluate",
        body=evaluate_stage.run,
        # its own section: changing beams / max_new_tokens / splits reruns this stage only
        reads=("evaluate", "model.task"),
        upstream=("data", "tokenize", "model", "adapters", "train"),  # data: untruncated reference texts
        libraries=("torch", "transformers", "peft", "bitsandbytes", "datasets", "rouge_score"),
    ),
    Stage(
        name="export",
        body=export_stage.run,
        # every section the model card prints; all but `export` are upstream's already (no extra reruns).
        # Not `evaluate`: the card carries training metrics, so evaluation changes never re-export.
        reads=("name", "description", *export_stage.CARD_SECTIONS),
        upstream=("tokenize", "model", "adapters", "train"),  # tokenize: the tokenizer shipped with the model
        libraries=("torch", "transformers", "peft", "bitsandbytes", "safetensors"),
    ),
]
