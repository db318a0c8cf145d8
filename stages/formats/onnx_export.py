"""ONNX beside the Hugging Face folder (`export.formats: [hf, onnx]`; docs/export.md#onnx), for runtimes without
torch: an encoder classifier's model as the export folder holds it, exported with torch.onnx (dynamic batch and
sequence axes, inputs input_ids + attention_mask, output logits) to onnx/model.onnx and, with
`export.onnx_int8`, quantized to int8 with onnxruntime's dynamic quantization (onnx/model_int8.onnx).

Each file is checked in onnxruntime before the export is committed, on the first CHECK_ROWS rows of each evaluated
split (the tokenize stage's rows), against the export folder's model run by torch in float32:
- fp32: every label equal and the largest |logit difference| under FP32_TOLERANCE; else the stage fails (exit 2,
  nothing committed);
- int8: how many labels agree, and accuracy against the rows' labels next to the fp32 model's (reported: int8
  changes numbers by design).

A seq2seq export (an encoder-decoder: T5; docs/export.md#seq2seq) is written with torch.onnx from the export
folder's merged model (the folder's top, or merged/ when the adapter is at the top):
    onnx/encoder.onnx  input_ids, attention_mask (batch, sequence) -> last_hidden_state
    onnx/decoder.onnx  decoder_input_ids (batch, decoded), encoder_hidden_states, encoder_attention_mask -> logits
                       of the next token (batch, vocabulary)
and, with `export.onnx_int8`, encoder_int8.onnx / decoder_int8.onnx (onnxruntime's dynamic quantization). The
decoder has no KV cache: each step runs it on all the tokens decoded so far (simple and robust to export; the
cost grows with the square of the generated length).

OnnxSeq2Seq decodes greedily in onnxruntime, in batches, each row stopping at its end token, with the export's
generation_config.json (max_new_tokens, eos); beam search and sampling are not implemented (one line, exit 2).
Before the export is committed, the files generate greedily on the first GENERATION_CHECK_ROWS rows of each
evaluated split next to the folder's model generating greedily in torch (float32): fp32 must give identical token
ids on every row, else ExportCheckError (nothing committed); int8: the rows generated identically are reported."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from stages.engine.errors import ConfigError, FinetuneError
from stages.formats.format import ExportJob, Format

if TYPE_CHECKING:
    import numpy as np

    from stages.pipeline.schema import PipelineConfig

ONNX_DIR = "onnx"
FP32, INT8 = "model.onnx", "model_int8.onnx"
CHECK_ROWS = 256  # per evaluated split
FP32_TOLERANCE = 1e-3  # largest |logit difference| allowed between the fp32 ONNX model and torch's
OPSET = 17
EXTRA = ("onnx", "onnxruntime")  # pip install '.[onnx]'


class ExportCheckError(FinetuneError):
    """A format's file does not behave like the model it was exported from: nothing is committed."""


def check_formats(cfg: PipelineConfig) -> None:
    """Plan time: each format asked for can be written for this head, and its libraries are installed."""
    from stages.models.heads import head_of

    if "onnx" not in cfg.export.formats:
        if cfg.export.onnx_int8:
            raise ConfigError("export.onnx_int8: quantizes the ONNX export; add onnx to export.formats "
                              "(e.g. export.formats=[hf, onnx])")
        return
    if head_of(cfg).decoder_only:
        raise ConfigError(f"export.formats onnx: method {cfg.method.name} is not exported to ONNX (classifiers and "
                          f"seq2seq are); a causal LM is exported as GGUF for llama.cpp (export.formats: [hf, gguf]; "
                          f"docs/export.md); remove onnx from export.formats")
    if missing := missing_extra():
        raise ConfigError(f"export.formats onnx: {missing} not installed; pip install '.[onnx]' "
                          f"(or remove onnx from export.formats)")


def missing_extra(modules: dict[str, str] | None = None) -> str:
    """The distributions of an extra whose modules are not installed ('' when all are); `modules`: import name ->
    distribution, the onnx extra's by default."""
    wanted = modules if modules is not None else {m: m for m in EXTRA}
    return " and ".join(d for m, d in wanted.items() if importlib.util.find_spec(m) is None)


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

    from stages.models.inference import class_logits

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


def evaluated_rows(tokenized: Path, splits: Sequence[str], n: int) -> tuple[list[list[int]], list[Any]]:
    """(input ids, labels) of the first `n` rows of each evaluated split, as the tokenize stage wrote them: the
    rows a format's check runs on."""
    import datasets

    ds = datasets.load_from_disk(str(tokenized / "dataset"))
    ids: list[list[int]] = []
    labels: list[Any] = []
    for split in splits:
        if split in ds:
            part = ds[split].select(range(min(n, len(ds[split]))))
            ids += [list(r) for r in part["input_ids"]]
            labels += list(part["labels"])
    return ids, labels


def export_checked(out: Path, tokenized: Path, splits: Sequence[str], int8: bool, log: Any) -> dict[str, Any]:
    """Write onnx/ for the classifier at the top of `out` and check each file; the facts for the manifest. A
    seq2seq export's: export_checked_seq2seq."""
    if seq2seq(model_folder(out)):
        return export_checked_seq2seq(out, tokenized, splits, int8, log)
    import numpy as np
    import transformers

    from stages.models.inference import class_logits

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), dtype="float32").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    rows, gold = evaluated_rows(tokenized, splits, CHECK_ROWS)
    labels = [int(y) for y in gold]
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
        return card_line_seq2seq(facts)
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
    """Whether an export folder's model is an encoder-decoder (its ONNX: an encoder and a decoder file). A folder
    with the adapter alone at the top has no model for ONNX: the export stage refuses it (model_folder), predict
    then finds no ONNX file."""
    import transformers

    if not any((f / "config.json").is_file() for f in (folder, folder / "merged")):
        return False
    return bool(getattr(transformers.AutoConfig.from_pretrained(str(model_folder(folder))), "is_encoder_decoder",
                        False))


def runtime_model(folder: Path, runtime: str, threads: int | None = None) -> Any:
    """An export's ONNX file (`runtime` onnx: model.onnx; onnx-int8: model_int8.onnx) as the classifier model
    `finetune predict --runtime` runs (OnnxClassifier), or a seq2seq export's encoder and decoder files
    (OnnxSeq2Seq); one line when the folder has no such file."""
    import transformers

    if seq2seq(folder):
        encoder, decoder = (int8_name(n) if runtime == "onnx-int8" else n for n in (ENCODER, DECODER))
        missing(folder, runtime, [encoder, decoder])
        return seq2seq_runtime(folder, encoder, decoder, threads)
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
    """An ONNX classifier with the surface batched inference uses of a transformers model (stages/runtimes/
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


# ---------------------------------------------------------------- seq2seq: an encoder and a decoder

ENCODER, DECODER = "encoder.onnx", "decoder.onnx"
GENERATION_CHECK_ROWS = 32  # per evaluated split: each row is a whole greedy generation
GENERATION_BATCH = 8
# generation settings the greedy loop does not implement: the export check and predict refuse them
UNSUPPORTED = {"num_beams": 1, "do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
               "encoder_repetition_penalty": 1.0, "min_length": 0, "min_new_tokens": None, "bad_words_ids": None,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None,
               "begin_suppress_tokens": None, "sequence_bias": None}


def int8_name(name: str) -> str:
    return name.replace(".onnx", "_int8.onnx")


def model_folder(out: Path) -> Path:
    """Where the export's full seq2seq model is: the top, or merged/ beside an adapter at the top."""
    for folder in (out, out / "merged"):
        if (folder / "config.json").is_file():
            return folder
    raise ConfigError(f"export.formats onnx: {out} has the adapter alone at the top and no merged model to export "
                      f"to ONNX; set export.merge: true (or export.layout: merged)")


def write_seq2seq(model: Any, out: Path) -> tuple[Path, Path]:
    """onnx/encoder.onnx and onnx/decoder.onnx of a seq2seq model (fp32, eval mode), dynamic batch and lengths."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, inner: Any):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    class Decoder(torch.nn.Module):  # the whole model given the encoder's output: its lm_head (T5's scaling too)
        def __init__(self, inner: Any):
            super().__init__()
            self.inner = inner

        def forward(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    encoder_attention_mask: torch.Tensor) -> torch.Tensor:
            logits = self.inner(encoder_outputs=(encoder_hidden_states,), attention_mask=encoder_attention_mask,
                                decoder_input_ids=decoder_input_ids, use_cache=False).logits
            return logits[:, -1, :]  # the next token's: the loop needs no more, and a vocabulary per step is big

    model = model.float().eval()
    folder = out / ONNX_DIR
    folder.mkdir(parents=True, exist_ok=True)
    ids = torch.ones((2, 8), dtype=torch.long)
    hidden = torch.zeros((2, 8, model.config.d_model if hasattr(model.config, "d_model") else
                          model.config.hidden_size))
    dec = torch.ones((2, 3), dtype=torch.long)
    # tracer warnings: what the check after export is for (it runs the files on real rows of other shapes)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch: the TorchScript exporter's notice
        torch.onnx.export(Encoder(model.get_encoder()), (ids, torch.ones_like(ids)), str(folder / ENCODER),
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                        "attention_mask": {0: "batch", 1: "sequence"},
                                        "last_hidden_state": {0: "batch", 1: "sequence"}},
                          opset_version=OPSET, dynamo=False)
        torch.onnx.export(Decoder(model), (dec, hidden, torch.ones_like(ids)), str(folder / DECODER),
                          input_names=["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask"],
                          output_names=["logits"],
                          dynamic_axes={"decoder_input_ids": {0: "batch", 1: "decoded"},
                                        "encoder_hidden_states": {0: "batch", 1: "sequence"},
                                        "encoder_attention_mask": {0: "batch", 1: "sequence"},
                                        "logits": {0: "batch"}},
                          opset_version=OPSET, dynamo=False)
    return folder / ENCODER, folder / DECODER


def quantize_as(path: Path) -> Path:
    """path's int8 copy beside it (quantize writes model_int8.onnx: renamed to this file's)."""
    done = quantize(path)
    return done.rename(path.with_name(int8_name(path.name)))


class OnnxSeq2Seq:
    """An encoder-decoder in onnxruntime with the surface batched generation uses of a transformers model
    (stages/models/inference.py generate): `generate(input_ids, attention_mask, generation_config, **kw)` returns
    the decoder start token then the greedy tokens (batch, 1 + steps), a finished row padded after its end token."""

    def __init__(self, encoder: Any, decoder: Any, config: Any, path: Path, generation: Any = None):
        import torch

        self.encoder, self.decoder, self.config, self.path = encoder, decoder, config, path
        self.generation_config = generation
        self._device = torch.empty(0)

    def parameters(self) -> Any:
        return iter([self._device])

    def eval(self) -> OnnxSeq2Seq:
        return self

    def generate(self, input_ids: Any, attention_mask: Any, generation_config: Any = None, **kw: Any) -> Any:
        import numpy as np
        import torch

        gen = copy.deepcopy(generation_config or self.generation_config)
        gen.update(**kw)
        refuse_unsupported(gen)
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.config.eos_token_id
        stops = np.asarray(eos if isinstance(eos, list) else [eos])
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.config.pad_token_id
        start = gen.decoder_start_token_id
        start = self.config.decoder_start_token_id if start is None else start
        steps = gen.max_new_tokens if gen.max_new_tokens is not None else gen.max_length - 1
        mask = attention_mask.cpu().numpy().astype(np.int64)
        hidden = self.encoder.run(["last_hidden_state"], {"input_ids": input_ids.cpu().numpy().astype(np.int64),
                                                          "attention_mask": mask})[0]
        out = np.full((len(mask), 1), start, dtype=np.int64)
        done = np.zeros(len(mask), dtype=bool)
        for _ in range(steps):
            logits = self.decoder.run(["logits"], {"decoder_input_ids": out, "encoder_hidden_states": hidden,
                                                   "encoder_attention_mask": mask})[0]
            nxt = np.where(done, pad, logits.argmax(-1)).astype(np.int64)
            out = np.concatenate([out, nxt[:, None]], axis=1)
            done |= np.isin(nxt, stops)
            if done.all():
                break
        return torch.from_numpy(out)


def refuse_unsupported(gen: Any) -> None:
    """One line for a generation setting the greedy loop does not implement (beams, sampling, logits processors)."""
    for name, plain in UNSUPPORTED.items():
        value = getattr(gen, name, plain)
        if value is not None and value != plain and not (plain is None and not value):
            raise ConfigError(f"--runtime onnx: {name} {value}: the ONNX seq2seq export decodes greedily and "
                              f"implements no {name}; give --runtime torch (or --num-beams 1 for beams)")


def generated_ids(model: Any, prompts: list[list[int]], tok: Any, gen: Any) -> list[list[int]]:
    """Each prompt's greedy generation as token ids (through the end token), in order: torch or OnnxSeq2Seq."""
    import torch

    from stages.models.inference import generated_ids as batched

    return batched(model, prompts, tok, {"generation_config": gen, "eos_token_id": gen.eos_token_id},
                   GENERATION_BATCH, torch.device("cpu"), False, "export onnx check")


def seq2seq_runtime(folder: Path, encoder: str, decoder: str, threads: int | None = None) -> OnnxSeq2Seq:
    import transformers

    where = folder / ONNX_DIR
    return OnnxSeq2Seq(session(where / encoder, threads), session(where / decoder, threads),
                       transformers.AutoConfig.from_pretrained(str(model_folder(folder))), where / decoder,
                       transformers.GenerationConfig.from_pretrained(str(folder)))


def compare_generations(out: Path, encoder: str, decoder: str, reference: list[list[int]], prompts: list[list[int]],
                        tok: Any, gen: Any, exact: bool) -> dict[str, Any]:
    """The files' greedy generations against torch's on the same prompts; `exact` (fp32): every row identical."""
    got = generated_ids(seq2seq_runtime(out, encoder, decoder), prompts, tok, gen)
    same = sum(a == b for a, b in zip(got, reference, strict=True))
    tokens = [sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(got, reference, strict=True)]
    result: dict[str, Any] = {"files": [f"{ONNX_DIR}/{encoder}", f"{ONNX_DIR}/{decoder}"], "rows": len(prompts),
                              "rows_identical": same, "max_new_tokens": gen.max_new_tokens,
                              "tokens_generated": sum(len(b) for b in reference),
                              "tokens_equal_at_position": sum(tokens)}
    if exact and same != len(prompts):
        raise ExportCheckError(
            f"export.formats onnx: {ONNX_DIR}/{encoder} + {decoder} do not behave like the exported model in "
            f"onnxruntime ({same} of {len(prompts)} greedy generations identical to torch's); nothing was committed. "
            f"Rerun the export (--force export); if it fails again, remove onnx from export.formats")
    return result


def export_checked_seq2seq(out: Path, tokenized: Path, splits: Sequence[str], int8: bool, log: Any) -> dict[str, Any]:
    """Write onnx/ for the seq2seq model of `out` and check each pair of files; the facts for the manifest."""
    import transformers

    folder = model_folder(out)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder), dtype="float32").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    gen = copy.deepcopy(transformers.GenerationConfig.from_pretrained(str(out)))
    gen.update(num_beams=1, do_sample=False)  # the check is greedy whatever evaluate used (docs/export.md#onnx)
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    prompts, _ = evaluated_rows(tokenized, splits, GENERATION_CHECK_ROWS)
    reference = generated_ids(model, prompts, tok, gen)
    write_seq2seq(model, out)
    facts: dict[str, Any] = {"opset": OPSET, "kv_cache": False,
                             "fp32": compare_generations(out, ENCODER, DECODER, reference, prompts, tok, gen, True)}
    log.info("export: onnx/%s + %s checked in onnxruntime on %d evaluated rows: every greedy generation identical "
             "to torch's", ENCODER, DECODER, len(prompts))
    if int8:
        for name in (ENCODER, DECODER):
            quantize_as(out / ONNX_DIR / name)
        q = compare_generations(out, int8_name(ENCODER), int8_name(DECODER), reference, prompts, tok, gen, False)
        facts["int8"] = q
        log.info("export: onnx int8: %d of %d greedy generations identical to fp32 torch's", q["rows_identical"],
                 len(prompts))
    return facts


def card_line_seq2seq(facts: dict[str, Any]) -> str:
    f = facts["fp32"]
    line = (f"{ENCODER} (input_ids, attention_mask -> last_hidden_state) and {DECODER} (decoder_input_ids, "
            f"encoder_hidden_states, encoder_attention_mask -> the next token's logits; no KV cache), fp32, opset "
            f"{facts['opset']}, checked in onnxruntime: greedy generations on {f['rows']} evaluated rows identical to "
            f"torch's")
    if "int8" in facts:
        q = facts["int8"]
        line += (f"; {int8_name(ENCODER)} / {int8_name(DECODER)} (weights int8, onnxruntime dynamic quantization): "
                 f"{q['rows_identical']} of {q['rows']} greedy generations identical to fp32 torch's")
    return line


class Onnx(Format):
    name = "onnx"
    folder = ONNX_DIR
    libraries = EXTRA

    def check(self, cfg: PipelineConfig) -> None:
        check_formats(cfg)
        super().check(cfg)

    def check_unlisted(self, cfg: PipelineConfig) -> None:
        check_formats(cfg)

    def write(self, job: ExportJob) -> dict[str, Any]:
        """From the folder just written, checked in onnxruntime before anything is committed."""
        return export_checked(job.out, job.upstream["tokenize"], job.cfg.evaluate.splits, job.cfg.export.onnx_int8,
                              job.log)

    def card_lines(self, job: ExportJob, facts: dict[str, Any]) -> dict[str, str]:
        return {self.folder: card_line(facts)}


FORMAT = Onnx()
