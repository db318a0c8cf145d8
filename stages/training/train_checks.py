"""The train stage's settings, checked at plan time (its runner.Stage.check): before any stage runs, each
problem one ConfigError line naming the key and the fix (exit 2), not a failure after data, tokenize, model
and adapters have run. What the config alone decides is in the schema's validators (stages/pipeline/schema.py:
early_stopping needs select_best, the machines' rendezvous, the optimizer's name); here is what also needs the
data config's splits, this machine or its installed packages. Imports no torch: planning stays free of it
(torch is asked about the GPUs only where a GPU driver is present: precision.device_type)."""

from __future__ import annotations

import importlib.util

from stages.engine.errors import ConfigError, FinetuneError
from stages.models import precision
from stages.pipeline.schema import PipelineConfig, TrainConfig
from stages.training.distributed import check_accelerate_config

NEEDS_VALIDATION = ("eval_every", "select_best", "early_stopping")  # settings that validate during training
OPTIMIZER_LIBRARIES = {"adamw_8bit": "bitsandbytes", "paged_adamw_8bit": "bitsandbytes"}


def check_config(cfg: PipelineConfig, has_validation: bool | None = None) -> None:
    """Every train setting that can be checked before the stages run. `has_validation`: whether the data
    stage will write a validation split (stages.data.makes_validation; None: not known before it runs)."""
    t = cfg.train
    if has_validation is not None:
        check_validation(t, has_validation)
    if t.mixed_precision == "fp16":
        precision.resolve_precision(t.mixed_precision, precision.device_type())  # fp16 needs a CUDA GPU
    library = OPTIMIZER_LIBRARIES.get(t.optimizer)
    if library is not None and importlib.util.find_spec(library) is None:
        raise ConfigError(f"train.optimizer: {t.optimizer} needs {library}, which is not installed; pip install "
                          f"{library}, or set train.optimizer to adamw_torch")
    launched = t.num_processes > 1 or t.num_machines > 1
    if t.num_processes > 1 and precision.device_type() == "cuda":
        import torch  # only where a GPU driver is present; on a CPU the processes are gloo processes

        if (gpus := torch.cuda.device_count()) < t.num_processes:
            raise ConfigError(f"train.num_processes: {t.num_processes} processes need {t.num_processes} GPUs, this "
                              f"machine has {gpus}; lower train.num_processes")
    if launched and t.accelerate_config:
        check_accelerate_config(t.accelerate_config, "train")


def check_validation(t: TrainConfig, has_validation: bool, error: type[FinetuneError] = ConfigError) -> None:
    """The settings that validate during training have a validation split to validate on."""
    asked = [name for name in NEEDS_VALIDATION if getattr(t, name) is not None]
    if asked and not has_validation:
        raise error(f"train.{asked[0]}: there is no validation split to evaluate (or it is empty); set "
                    f"data.split.validation (rows, or a fraction of train), or set train.{asked[0]} to null")
