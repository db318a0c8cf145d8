"""ONNX of an encoder-decoder (seq2seq: T5, BART; `export.formats: [hf, onnx]`; docs/export.md#onnx), written with
torch.onnx from the export folder's merged model (the folder's top, or merged/ when the adapter is at the top):
    onnx/encoder.onnx  input_ids, attention_mask (batch, sequence) -> last_hidden_state
    onnx/decoder.onnx  decoder_input_ids (batch, decoded), encoder_hidden_states, encoder_attention_mask -> logits
                       of the next token (batch, vocabulary)
and, with `export.onnx_int8`, encoder_int8.onnx / decoder_int8.onnx (onnxruntime's dynamic quantization). The
decoder has no KV cache: each step runs it on all the tokens decoded so far (simple and robust to export; the
cost grows with the square of the generated length).

OnnxSeq2Seq decodes greedily in onnxruntime, in batches, each row stopping at its end token, with the export's
generation_config.json (max_new_tokens, eos); beam search and sampling are not implemented (one line, exit 2).
Before the export is committed, the files generate greedily on the first CHECK_ROWS rows of each evaluated split
next to the folder's model generating greedily in torch (float32): fp32 must give identical token ids on every
row, else ExportCheckError (nothing committed); int8: the rows generated identically are reported."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.common import onnx_export
from stages.common.onnx_export import ONNX_DIR, OPSET, ExportCheckError
from stages.engine.errors import ConfigError

ENCODER, DECODER = "encoder.onnx", "decoder.onnx"
CHECK_ROWS = 32  # per evaluated split: each row is a whole greedy generation
BATCH = 8
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
                      f"to ONNX; set export.merge: true (or export.format: merged)")


def write(model: Any, out: Path) -> tuple[Path, Path]:
    """onnx/encoder.onnx and onnx/decoder.onnx of a seq2seq model (fp32, eval mode), dynamic batch and lengths."""
    import warnings

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


def quantize(path: Path) -> Path:
    """path's int8 copy beside it (onnx_export.quantize writes a fixed name: moved to this file's)."""
    done = onnx_export.quantize(path)
    return done.rename(path.with_name(int8_name(path.name)))


class OnnxSeq2Seq:
    """An encoder-decoder in onnxruntime with the surface batched generation uses of a transformers model
    (stages/common/inference.py generate): `generate(input_ids, attention_mask, generation_config, **kw)` returns
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


def generated_ids(model: Any, prompts: list[list[int]], pad_id: int, gen: Any) -> list[list[int]]:
    """Each prompt's greedy generation as token ids (through the end token), in order: torch or OnnxSeq2Seq."""
    from stages.common.inference import batches, forward, padded

    eos = gen.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    got: list[list[int]] = [[] for _ in prompts]
    for idx in batches([len(p) for p in prompts], BATCH, "export onnx check"):
        ids, mask = padded([prompts[j] for j in idx], pad_id)
        out = forward(model, generate=True, input_ids=ids, attention_mask=mask, generation_config=gen)
        for r, j in enumerate(idx):
            seq = out[r, 1:].tolist()
            end = next((k for k, t in enumerate(seq) if t in stops), None)
            got[j] = seq if end is None else seq[:end + 1]
    return got


def runtime(folder: Path, encoder: str, decoder: str, threads: int | None = None) -> OnnxSeq2Seq:
    import transformers

    where = folder / ONNX_DIR
    return OnnxSeq2Seq(onnx_export.session(where / encoder, threads), onnx_export.session(where / decoder, threads),
                       transformers.AutoConfig.from_pretrained(str(model_folder(folder))), where / decoder,
                       transformers.GenerationConfig.from_pretrained(str(folder)))


def compare(out: Path, encoder: str, decoder: str, reference: list[list[int]], prompts: list[list[int]],
            pad_id: int, gen: Any, exact: bool) -> dict[str, Any]:
    """The files' greedy generations against torch's on the same prompts; `exact` (fp32): every row identical."""
    got = generated_ids(runtime(out, encoder, decoder), prompts, pad_id, gen)
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


def export_checked(out: Path, tokenized: Path, splits: Sequence[str], int8: bool, log: Any) -> dict[str, Any]:
    """Write onnx/ for the seq2seq model of `out` and check each pair of files; the facts for the manifest."""
    import datasets
    import transformers

    folder = model_folder(out)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder), dtype="float32").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    gen = copy.deepcopy(transformers.GenerationConfig.from_pretrained(str(out)))
    gen.update(num_beams=1, do_sample=False)  # the check is greedy whatever evaluate used (docs/export.md#onnx)
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    ds = datasets.load_from_disk(str(tokenized / "dataset"))
    prompts = [list(r) for split in splits if split in ds
               for r in ds[split].select(range(min(CHECK_ROWS, len(ds[split]))))["input_ids"]]
    reference = generated_ids(model, prompts, tok.pad_token_id, gen)
    write(model, out)
    facts: dict[str, Any] = {"opset": OPSET, "kv_cache": False,
                             "fp32": compare(out, ENCODER, DECODER, reference, prompts, tok.pad_token_id, gen, True)}
    log.info("export: onnx/%s + %s checked in onnxruntime on %d evaluated rows: every greedy generation identical "
             "to torch's", ENCODER, DECODER, len(prompts))
    if int8:
        for name in (ENCODER, DECODER):
            quantize(out / ONNX_DIR / name)
        q = compare(out, int8_name(ENCODER), int8_name(DECODER), reference, prompts, tok.pad_token_id, gen, False)
        facts["int8"] = q
        log.info("export: onnx int8: %d of %d greedy generations identical to fp32 torch's", q["rows_identical"],
                 len(prompts))
    return facts


def card_line(facts: dict[str, Any]) -> str:
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
