"""ONNX beside the Hugging Face folder (`export.formats: [hf, onnx]`; docs/export.md#onnx), for runtimes without
torch (a seq2seq export's: stages/common/onnx_seq2seq.py): an encoder classifier's model as the export folder holds it, exported with torch.onnx (dynamic batch and
sequence axes, inputs input_ids + attention_mask, output logits) to onnx/model.onnx and, with
`export.onnx_int8`, quantized to int8 with onnxruntime's dynamic quantization (onnx/model_int8.onnx).

Each file is checked in onnxruntime before the export is committed, on the first CHECK_ROWS rows of each evaluated
split (the tokenize stage's rows), against the export folder's model run by torch in float32:
- fp32: every label equal and the largest |logit difference| under FP32_TOLERANCE; else the stage fails (exit 2,
  nothing committed);
- int8: how many labels agree, and accuracy against the rows' labels next to the fp32 model's (reported: int8
  changes numbers by design)."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from stages.engine.errors import ConfigError, FinetuneError

if TYPE_CHECKING:
    import numpy as np

    from stages.engine.schema import PipelineConfig

ONNX_DIR = "onnx"
FP32, INT8 = "model.onnx", "model_int8.onnx"
CHECK_ROWS = 256  # per evaluated split
FP32_TOLERANCE = 1e-3  # largest |logit difference| allowed between the fp32 ONNX model and torch's
OPSET = 17
EXTRA = ("onnx", "onnxruntime")  # pip install '.[onnx]'


class ExportCheckError(FinetuneError):
    """A format's file does not behave like the model it was exported from: nothing is committed."""


def check_formats(cfg: PipelineConfig) -> None:
    """Plan time: each format asked for can be written for this task, and its libraries are installed."""
    from stages.common.tasks import task_of

    if "onnx" not in cfg.export.formats:
        if cfg.export.onnx_int8:
            raise ConfigError("export.onnx_int8: quantizes the ONNX export; add onnx to export.formats "
                              "(e.g. export.formats=[hf, onnx])")
        return
    task = task_of(cfg.model.task)
    if task.decoder_only:
        raise ConfigError(f"export.formats onnx: model.task {task.name} is not exported to ONNX (classifiers and "
                          f"seq2seq are); a causal LM is exported as GGUF for llama.cpp (export.formats: [hf, gguf]; "
                          f"docs/export.md); remove onnx from export.formats")
    if missing := missing_extra():
        raise ConfigError(f"export.formats onnx: {missing} not installed; pip install '.[onnx]' "
                          f"(or remove onnx from export.formats)")


def missing_extra() -> str:
    """The packages of the onnx extra that are not installed ('' when all are)."""
    return " and ".join(m for m in EXTRA if importlib.util.find_spec(m) is None)


def session(path: Path, threads: int | None = None) -> Any:
    """An onnxruntime CPU session on `path` (`threads`: intra-op threads; default torch's count)."""
    import onnxruntime as ort
    import torch

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # errors only: its graph-optimisation notes are not the user's business
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def write(model: Any, out: Path) -> Path:
    """onnx/model.onnx of a classifier (fp32, eval mode): inputs input_ids and attention_mask, dynamic batch
    and sequence, output logits."""
    import torch

    class Logits(torch.nn.Module):  # keyword inputs (a BLOOM's second positional is its cache) and one output
        def __init__(self, inner: Any):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    path = out / ONNX_DIR / FP32
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.ones((2, 8), dtype=torch.long)
    dynamic = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
               "logits": {0: "batch"}}
    # the tracer's warnings (a shape check traced as a constant, negative indices) are what the check after
    # export is for: it runs the file on real rows of other shapes and refuses it if anything differs
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message="Exporting aten::index operator", category=UserWarning)
        torch.onnx.export(Logits(model.float().eval()), (example, torch.ones_like(example)), str(path),
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
    return path


def quantize(src: Path) -> Path:
    """onnx/model_int8.onnx: src with its weights quantized to int8 (onnxruntime's dynamic quantization:
    activations quantized per batch at run time)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    dst = src.with_name(INT8)
    root = logging.getLogger()
    level = root.level
    # a line per tensor on the root logger (INFO), and advice to pre-process the graph first (WARNING)
    root.setLevel(max(level, logging.ERROR))
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)
    return dst


def compare(path: Path, reference: np.ndarray, rows: list[list[int]], labels: list[int], pad_id: int,
            exact: bool) -> dict[str, Any]:
    """One file checked in onnxruntime against torch's logits on the same rows. `exact` (fp32): every label
    equal and |logit difference| within FP32_TOLERANCE, else ExportCheckError."""
    import numpy as np
    import torch

    from stages.common.inference import class_logits

    model: Any = OnnxClassifier(session(path), None, path)  # a torch module in what class_logits uses of one
    got = class_logits(model, rows, pad_id, 32, torch.device("cpu"), f"export {path.name} check").numpy()
    ours, theirs = got.argmax(-1), reference.argmax(-1)
    gold = np.asarray(labels)
    result: dict[str, Any] = {"file": f"{ONNX_DIR}/{path.name}", "rows": len(rows), "labels_equal": int((ours == theirs).sum()),
              "max_abs_logit_diff": float(np.abs(got - reference).max()) if len(rows) else 0.0,
              "accuracy": float((ours == gold).mean()) if len(rows) else None,
              "accuracy_torch": float((theirs == gold).mean()) if len(rows) else None}
    if exact and (result["labels_equal"] != len(rows) or result["max_abs_logit_diff"] > FP32_TOLERANCE):
        raise ExportCheckError(
            f"export.formats onnx: {result['file']} does not behave like the exported model in onnxruntime "
            f"({result['labels_equal']} of {len(rows)} labels equal, largest |logit difference| "
            f"{result['max_abs_logit_diff']:.3g} > {FP32_TOLERANCE}); nothing was committed. Rerun the export "
            f"(--force export); if it fails again, remove onnx from export.formats")
    return result


def export_checked(out: Path, tokenized: Path, splits: Sequence[str], int8: bool, log: Any) -> dict[str, Any]:
    """Write onnx/ for the classifier at the top of `out` and check each file; the facts for the manifest. A
    seq2seq export's: stages/common/onnx_seq2seq.py."""
    if seq2seq(out):
        from stages.common import onnx_seq2seq

        return onnx_seq2seq.export_checked(out, tokenized, splits, int8, log)
    import datasets
    import numpy as np
    import transformers

    from stages.common.inference import class_logits

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), dtype="float32").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ds = datasets.load_from_disk(str(tokenized / "dataset"))
    rows: list[list[int]] = []
    labels: list[int] = []
    for split in splits:
        if split in ds:
            part = ds[split].select(range(min(CHECK_ROWS, len(ds[split]))))
            rows += [list(r) for r in part["input_ids"]]
            labels += [int(y) for y in part["labels"]]
    reference = class_logits(model, rows, tok.pad_token_id, 32, model.device, "export onnx check",
                             log).numpy().astype(np.float32)
    fp32 = write(model, out)
    facts: dict[str, Any] = {"opset": OPSET, "fp32": compare(fp32, reference, rows, labels, tok.pad_token_id, exact=True)}
    log.info("export: %s checked in onnxruntime on %d evaluated rows: every label equal, largest |logit difference| "
             "%.2g", facts["fp32"]["file"], len(rows), facts["fp32"]["max_abs_logit_diff"])
    if int8:
        q = compare(quantize(fp32), reference, rows, labels, tok.pad_token_id, exact=False)
        q["accuracy_delta"] = (q["accuracy"] - q["accuracy_torch"]) if q["accuracy"] is not None else None
        facts["int8"] = q
        log.info("export: %s: %d of %d labels as fp32 torch, accuracy %.4f vs %.4f", q["file"], q["labels_equal"],
                 len(rows), q["accuracy"] or 0.0, q["accuracy_torch"] or 0.0)
    return facts


def card_line(facts: dict[str, Any]) -> str:
    """The card's line for onnx/."""
    if "files" in facts["fp32"]:
        from stages.common import onnx_seq2seq

        return onnx_seq2seq.card_line(facts)
    f = facts["fp32"]
    line = (f"{FP32} (fp32, opset {facts['opset']}; inputs input_ids and attention_mask, output logits), checked in "
            f"onnxruntime on {f['rows']} evaluated rows: every label equal to torch's, largest |logit difference| "
            f"{f['max_abs_logit_diff']:.2g}")
    if "int8" in facts:
        q = facts["int8"]
        line += (f"; {INT8} (weights int8, onnxruntime dynamic quantization): {q['labels_equal']} of {q['rows']} "
                 f"labels as fp32, accuracy {q['accuracy']:.4f} vs {q['accuracy_torch']:.4f}")
    return line


def seq2seq(folder: Path) -> bool:
    """Whether an export folder's model is an encoder-decoder (its ONNX: onnx_seq2seq.py)."""
    import transformers

    from stages.common.onnx_seq2seq import model_folder

    return bool(getattr(transformers.AutoConfig.from_pretrained(str(model_folder(folder))), "is_encoder_decoder",
                        False))


def runtime_model(folder: Path, runtime: str, threads: int | None = None) -> Any:
    """An export's ONNX file (`runtime` onnx: model.onnx; onnx-int8: model_int8.onnx) as the classifier model
    `finetune predict --runtime` runs (OnnxClassifier), or a seq2seq export's encoder and decoder files
    (OnnxSeq2Seq); one line when the folder has no such file."""
    import transformers

    if seq2seq(folder):
        from stages.common import onnx_seq2seq as s2s

        names = [s2s.int8_name(n) if runtime == "onnx-int8" else n for n in (s2s.ENCODER, s2s.DECODER)]
        missing(folder, runtime, names)
        return s2s.runtime(folder, *names, threads=threads)
    path = folder / ONNX_DIR / (INT8 if runtime == "onnx-int8" else FP32)
    missing(folder, runtime, [path.name])
    return OnnxClassifier(session(path, threads), transformers.AutoConfig.from_pretrained(str(folder)), path)


def missing(folder: Path, runtime: str, names: list[str]) -> None:
    """One line when the folder lacks one of the ONNX files `--runtime` runs, or onnxruntime is not installed."""
    for name in names:
        path = folder / ONNX_DIR / name
        if not path.is_file():
            how = "export.onnx_int8: true" if runtime == "onnx-int8" else "export.formats: [hf, onnx]"
            raise ConfigError(f"--runtime {runtime}: {folder} has no {ONNX_DIR}/{path.name}; export the pipeline "
                              f"with {how} (docs/export.md#onnx), or give --runtime torch")
    if lacking := missing_extra():
        raise ConfigError(f"--runtime {runtime}: {lacking} not installed; pip install '.[onnx]'")


class OnnxClassifier:
    """An ONNX classifier with the surface batched inference uses of a transformers model (stages/common/
    inference.py): called with input_ids and attention_mask, it returns an object with `.logits` (a torch
    tensor); `config` is the export's (id2label); it computes on the CPU in the file's own precision."""

    def __init__(self, sess: Any, config: Any, path: Path):
        import torch

        self.sess, self.config, self.path = sess, config, path
        self._device = torch.empty(0)  # parameters(): where its inputs go (the CPU)

    def parameters(self) -> Any:
        return iter([self._device])

    def eval(self) -> OnnxClassifier:
        return self

    def __call__(self, input_ids: Any, attention_mask: Any) -> Any:
        import torch

        out = self.sess.run(["logits"], {"input_ids": input_ids.cpu().numpy(),
                                         "attention_mask": attention_mask.cpu().numpy()})[0]
        return SimpleNamespace(logits=torch.from_numpy(out))
