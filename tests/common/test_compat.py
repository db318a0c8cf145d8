"""Every third-party workaround lives in stages/models/compat/<library>.py and names the versions it was
written for. These fail, naming the workaround to revisit, when an upgrade leaves that range or removes what
a workaround patches or reads."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement

import stages.models.compat as compat_pkg

MODULES = sorted(m.name for m in pkgutil.iter_modules(compat_pkg.__path__))


def test_each_library_has_one_compat_module():
    assert MODULES == ["accelerate", "bitsandbytes", "peft", "transformers"]


@pytest.mark.parametrize("name", MODULES)
def test_installed_version_is_the_one_the_workarounds_were_written_for(name):
    mod = importlib.import_module(f"stages.models.compat.{name}")
    req = Requirement(mod.WRITTEN_FOR)
    assert req.name == name, f"{mod.__name__}.WRITTEN_FOR names {req.name}, not the library it is for"
    installed = version(req.name)
    assert req.specifier.contains(installed, prereleases=True), (
        f"{req.name} {installed} is installed but {mod.__name__} was written for {mod.WRITTEN_FOR}: check each "
        f"workaround in {mod.__file__} against the new version (tests/common/test_compat.py checks the targets), "
        f"then move WRITTEN_FOR")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_transformers_targets_exist():
    from transformers import PreTrainedModel
    from transformers.models.t5.modeling_t5 import T5PreTrainedModel
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    from stages.models.compat.transformers import KEEP_FP32_ATTRS

    for attr in KEEP_FP32_ATTRS:  # keep_in_fp32_modules / fp32_modules_quantized read and patch these
        assert attr in PreTrainedModel.__dict__, f"PreTrainedModel.{attr} is gone: revisit compat.transformers"
    assert "_keep_in_fp32_modules" in T5PreTrainedModel.__dict__, "T5 no longer keeps modules in fp32 on its class"
    assert _params(get_keys_to_not_convert) == ["model"], "keys_to_not_convert: get_keys_to_not_convert changed"
    assert _params(should_convert_module)[:2] == ["full_name", "patterns"], "matches_modules: signature changed"
    # clear_gguf_quantizer: save_pretrained still consults the quantizer it clears
    assert "hf_quantizer" in inspect.getsource(PreTrainedModel.save_pretrained), "clear_gguf_quantizer: revisit"


def test_peft_targets_exist():
    import peft.import_utils as pu
    import peft.tuners.lora.model as lora_model

    from stages.models.compat.peft import BNB_PROBES

    for name in BNB_PROBES:
        assert hasattr(getattr(pu, name), "cache_clear"), f"peft.import_utils.{name} is no longer cached: import_peft"
        assert hasattr(lora_model, name), f"peft.tuners.lora.model.{name} is gone: revisit peft_dispatch"


def test_accelerate_target_exists():
    from accelerate.state import AcceleratorState

    assert _params(AcceleratorState._reset_state) == ["reset_partial_state"], "reset_accelerator_state: revisit"


def test_bitsandbytes_targets_exist():
    import bitsandbytes.functional as bf
    import bitsandbytes.nn as bnn

    qs = set(_params(bf.QuantState.__init__))
    assert {"absmax", "code", "offset", "state2"} <= qs, "quant_state_bytes: QuantState's fields changed"
    assert "shape" in qs and "quant_state" in _params(bnn.Params4bit.__new__), "held_weights: revisit"
    assert "SCB" in _params(bnn.Int8Params.__new__), "quant_state_bytes: Int8Params.SCB is gone"


def test_bitsandbytes_cpu_flag_is_still_the_one_linear4bit_reads():
    import bitsandbytes.nn as bnn

    from stages.models.compat.bitsandbytes import CPU_BF16_FLAG

    assert CPU_BF16_FLAG in inspect.getsource(bnn.Linear4bit), "exact_cpu_kernels: Linear4bit's CPU flag changed"


def test_transformers_config_keeps_quantization_config_in_its_dict():
    from transformers import PretrainedConfig

    from stages.models.compat.transformers import drop_quantization_config

    class Holder:
        config = PretrainedConfig(quantization_config={"quant_method": "bitsandbytes"})

    assert "quantization_config" in Holder.config.to_dict()
    drop_quantization_config(Holder)
    assert "quantization_config" not in Holder.config.to_dict(), "drop_quantization_config: revisit"
