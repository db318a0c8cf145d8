"""A quiet run: the known-harmless third-party warnings are filtered by message and module, nothing else;
bitsandbytes is not imported by a pipeline that neither quantizes nor uses its optimizers."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
from helpers import ROOT, needs_shared_data, subprocess_env

from stages.models.quiet import filter_known_warnings


def warn_from(module: str, message: str, category: type[Warning]) -> list[str]:
    """Warnings shown when `module` raises this one (as if from its own code: the filter matches modules)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn_explicit(message, category, filename=f"{module.replace('.', '/')}.py", lineno=1,
                               module=module)
    return [str(w.message) for w in seen]


def test_known_warnings_are_filtered_by_message_and_module_only():
    msg = "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing`"
    assert warn_from("transformers.modeling_utils", msg, FutureWarning) == []
    assert warn_from("mypackage.training", msg, FutureWarning) == [msg]  # the same text from elsewhere
    assert warn_from("transformers.modeling_utils", "something else is deprecated", FutureWarning) == [
        "something else is deprecated"]
    tied = ("Model has `tie_word_embeddings=True` and a tied layer is part of the adapter, but `ensure_weight_tying` "
            "is not set to True.")
    assert warn_from("peft.tuners.tuners_utils", tied, UserWarning) == []
    assert warn_from("peft.tuners.tuners_utils", tied, FutureWarning) == [tied]  # another category


def test_bitsandbytes_kernel_notice_is_dropped_and_its_other_records_kept(caplog):
    filter_known_warnings()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes"):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...",
                       "offline")
        logger.warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]


@needs_shared_data
@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_pipeline_without_quantization_or_8bit_optimizers_never_imports_bitsandbytes(tmp_path, method):
    lora = ", '--set', 'adapters.method=lora', '--set', 'adapters.target_modules=[query_key_value]'"
    code = ("import sys\nfrom stages.__main__ import main\n"
            "rc = main(['tiny-imdb', '--set', 'train.max_steps=1', '--set', "
            f"'data.subset={{train: 8, validation: 4, test: 4}}'{lora if method == 'lora' else ''}])\n"
            "print('bitsandbytes' in sys.modules, rc)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(tmp_path / "store"),
                         capture_output=True, text=True, timeout=600)
    assert res.stdout.strip().splitlines()[-1] == "False 0", res.stdout[-2000:] + res.stderr[-2000:]
    assert "Warning" not in res.stderr, res.stderr[-3000:]
