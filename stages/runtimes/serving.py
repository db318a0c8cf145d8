"""The model side of `finetune serve-model` (flows/reports/serve_model.py): an export loaded once
(stages/runtimes/exported.py) behind a bounded queue, and one thread that takes requests off it in groups
(dynamic batching: up to `max_batch` requests, or whatever came within `max_wait` of the first) and runs each
group as one batched call: one `generate` with the KV cache for a generating export, one forward pass for a
classifier.

Generation reuses what `finetune predict` runs: the prompts padded on the left with their attention masks
(stages/models/inference.py `padded`), the export's generation_config.json (its end-of-turn stop), greedy
argmax. What differs per row rides on `generate`'s own hooks, so a greedy row computes exactly what predict
computes (its answers are the same batched or alone): a logits processor draws the sampled rows' tokens, each
from its own seeded generator (a row's sample does not depend on its neighbours), top-p filtered; a stopping
criterion ends each row at its own max_tokens, stop string or cancellation; a streamer hands each row's new
text out as it is decoded. The llama.cpp runtime (a causal LM's GGUF file in a process of its own) decodes
greedily, one row after the other: its whole answer comes as one piece.

An export's base (the model it was tuned from, for a side-by-side comparison) is loaded as the model stage loads
model.name (a hub id in the cache, a folder, a GGUF file or pkg:PACKAGE/PATH), with the export's tokenizer and
generation settings, and served by an engine of its own. Nothing here imports Prefect or opens the store."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from stages.runtimes.exported import Exported, predict

log = logging.getLogger("finetune.serve")


class QueueFull(Exception):
    """The bounded queue holds max_queue requests already."""


@dataclass
class Sampling:
    """One request's generation settings."""

    max_tokens: int
    temperature: float = 0.0  # 0: greedy, the argmax (predict's answer)
    top_p: float = 1.0
    seed: int | None = None  # a sampled row's generator seed (None: drawn at random)
    stop: list[str] = field(default_factory=list)  # strings that end the answer (not included)


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end of turn or a stop string) or "length" (max_tokens)


@dataclass
class Job:
    """A request in the queue: a prompt to answer (ids) or texts to classify, and where its results go."""

    ids: list[int] | None = None
    texts: list[str] | None = None
    sampling: Sampling | None = None
    on_text: Callable[[str], None] | None = None  # streamed pieces of the answer, from the model's thread
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)

    @property
    def group(self) -> bool:
        """Requests batched together: generations, or classifications."""
        return self.texts is not None


class Row:
    """One generated answer as it grows: its tokens, the text shown so far, why it ended."""

    def __init__(self, job: Job, tok: Any, stops: set[int]):
        assert job.sampling is not None
        self.job, self.tok, self.stops, self.s = job, tok, stops, job.sampling
        self.tokens: list[int] = []
        self.sent = ""
        self.finish: str | None = None
        self.hold = max((len(x) for x in self.s.stop), default=1) - 1

    def add(self, token: int) -> None:
        if self.finish is not None:
            return
        if token in self.stops:
            self.finish = "stop"
            return
        self.tokens.append(token)
        text = self.text()
        if self.finish is None and len(self.tokens) >= self.s.max_tokens:
            self.finish = "length"
        if self.finish is None:
            # hold back what may still change: a character cut mid-UTF-8, trailing spaces (the answer is
            # stripped, as predict strips it), the start of a stop string
            text = text.rstrip("\ufffd").rstrip()
            text = text[:max(len(self.sent), len(text) - self.hold)]
            self.emit(text)

    def text(self) -> str:
        """The answer so far: decoded, leading spaces dropped, cut at the first stop string (which ends it)."""
        text = self.tok.decode(self.tokens, skip_special_tokens=True).lstrip()
        cut = min((i for i in (text.find(x) for x in self.s.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.finish, text = "stop", text[:cut]
        return text

    def emit(self, text: str) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent) and self.job.on_text is not None:
            self.job.on_text(text[len(self.sent):])
            self.sent = text
        elif len(text) > len(self.sent) and text.startswith(self.sent):
            self.sent = text

    def done(self) -> bool:
        return self.finish is not None or self.job.cancelled.is_set()

    def answer(self, prompt_tokens: int) -> Answer:
        text = self.text().strip()
        self.emit(text)
        return Answer(text, prompt_tokens, len(self.tokens), self.finish or "length")


def hooks(rows: list[Row], device: Any) -> tuple[Any, Any, Any]:
    """generate's per-row hooks: (logits processor, stopping criterion, streamer)."""
    import torch
    from transformers import LogitsProcessor, StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    generators = []
    for r in rows:
        g = None
        if r.s.temperature > 0:
            g = torch.Generator(device="cpu")
            g.manual_seed(r.s.seed if r.s.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        generators.append(g)

    class Draw(LogitsProcessor):
        """A sampled row's token, drawn from its own generator: its scores become 0 there, -inf elsewhere, so
        generate's greedy argmax takes it. Greedy rows pass untouched."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            for i, (r, g) in enumerate(zip(rows, generators, strict=True)):
                if g is None:
                    continue
                probs = torch.softmax(scores[i].float().cpu() / r.s.temperature, -1)
                if r.s.top_p < 1:
                    p, order = probs.sort(descending=True)
                    drop = p.cumsum(-1) - p >= r.s.top_p  # keep the smallest head whose mass reaches top_p
                    probs[order[drop]] = 0
                token = int(torch.multinomial(probs, 1, generator=g))
                scores[i] = float("-inf")
                scores[i, token] = 0
            return scores

    class Ended(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
            return torch.tensor([r.done() for r in rows], dtype=torch.bool, device=input_ids.device)

    class Stream(BaseStreamer):
        def __init__(self) -> None:
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate's first call hands over the prompts
                self.prompt_seen = True
                return
            for r, t in zip(rows, value.reshape(-1).tolist(), strict=True):
                r.add(int(t))

        def end(self) -> None:
            pass

    return Draw(), Ended(), Stream()


class Engine:
    """One export behind a bounded queue, served by one thread in dynamic batches."""

    def __init__(self, ex: Exported, max_batch: int = 8, max_wait_s: float = 0.01, max_queue: int = 64):
        self.ex, self.max_batch, self.max_wait_s = ex, max_batch, max_wait_s
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.batches: list[int] = []  # the size of each group run (the bench and tests read it)
        self.thread = threading.Thread(target=self._loop, name=f"serve {ex.folder.name}", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests are queued already") from None
        return job.future

    def close(self) -> None:
        """Stop after the queued requests are answered."""
        self.queue.put(None)
        self.thread.join()
        with contextlib.suppress(Exception):
            getattr(self.ex.model, "close", lambda: None)()

    def _loop(self) -> None:
        waiting: deque[Job] = deque()  # taken off the queue, of another group than the one being filled
        stopping = False
        while waiting or not stopping:
            first = waiting.popleft() if waiting else self.queue.get()
            if first is None:
                stopping = True
                continue
            group = [first]
            for j in list(waiting):
                if len(group) < self.max_batch and j.group == first.group:
                    waiting.remove(j)
                    group.append(j)
            deadline = time.monotonic() + self.max_wait_s
            while len(group) < self.max_batch and not stopping:
                try:
                    came = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if came is None:
                    stopping = True
                elif came.group == first.group:
                    group.append(came)
                else:
                    waiting.append(came)
            for j in [j for j in group if j.cancelled.is_set()]:  # a client gone while it waited
                group.remove(j)
                j.future.cancel()
            if group:
                self.batches.append(len(group))
                self._run(group)

    def _run(self, group: list[Job]) -> None:
        try:
            if group[0].texts is not None:
                self._classify(group)
            else:
                self._generate(group)
        except Exception as e:  # the requests get the error; the server and this thread live on
            log.exception("serve: a batch of %d failed", len(group))
            for j in group:
                if not j.future.done():
                    j.future.set_exception(e)

    def _classify(self, group: list[Job]) -> None:
        texts = [t for j in group for t in j.texts or []]
        records = predict(self.ex, texts, batch_size=len(texts))
        at = 0
        for j in group:
            n = len(j.texts or [])
            j.future.set_result(records[at:at + n])
            at += n

    def _generate(self, group: list[Job]) -> None:
        import torch

        from stages.models.inference import device_for, padded, stop_set
        from stages.runtimes.exported import export_precision
        from stages.training.device import autocast

        ex = self.ex
        gen = ex.generation["generation_config"]
        stops = stop_set(gen.eos_token_id) or {ex.tok.pad_token_id}
        rows = [Row(j, ex.tok, stops) for j in group]
        prompts = [j.ids or [] for j in group]
        ids, mask = padded(prompts, ex.tok.pad_token_id, left=True)
        max_new = max(r.s.max_tokens for r in rows)
        if ex.runtime == "torch":
            device = device_for(ex.model)
            draw, ended, stream = hooks(rows, device)
            with torch.inference_mode(), autocast(export_precision(ex, device), device):
                ex.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen,
                                  max_new_tokens=max_new, logits_processor=[draw], stopping_criteria=[ended],
                                  streamer=stream)
        else:  # llama.cpp: greedy, every row's answer at once
            out = ex.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, max_new_tokens=max_new)
            for r, new in zip(rows, out[:, ids.shape[1]:].tolist(), strict=True):
                for t in new:
                    if r.done():
                        break
                    r.add(int(t))
        for j, r, p in zip(group, rows, prompts, strict=True):
            j.future.set_result(r.answer(len(p)))


# ---------------------------------------------------------------- prompts and the base model


def chat_prompt(ex: Exported, turns: list[dict[str, str]]) -> list[int]:
    """A conversation's prompt ids, rendered as `finetune predict --chat` renders it (exported.chat_ids: the
    export's template with the assistant cue, no specials added), but never cut: a prompt over the context is
    the client's to shorten."""
    text = ex.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return list(ex.tok(text, add_special_tokens=False)["input_ids"])


def text_prompt(ex: Exported, text: str) -> list[int]:
    """A completion prompt's ids as predict tokenizes a text (the tokenize stage's prefix, the causal prompt
    without its closing special), never cut."""
    ids = ex.tok([ex.prefix + text])["input_ids"]
    return list(ex.method.prompt_ids(ex.tok, ids)[0])


def context_length(ex: Exported) -> int:
    """The longest prompt + answer the model takes: its config's position limit."""
    config = ex.model.config
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048)


def load_base(ex: Exported, settings: dict[str, Any]) -> Exported:
    """The model `ex` was tuned from (its pipeline's model.name, loaded as the model stage loads it), with the
    export's tokenizer, template and generation settings: the same conversation asked of both."""
    import transformers

    from stages.engine.errors import ConfigError
    from stages.models.hf import pretrained_source
    from stages.sources.tables import one_line

    m = base_model(settings)
    if m.get("from_config"):  # a random init: the model stage's, rebuilt from the same config and seed
        import torch

        from stages.models.model_loading import auto_class, hf_config
        from stages.pipeline.schema import ModelConfig

        model_cfg = ModelConfig.model_validate({k: v for k, v in m.items() if k != "task"})
        torch.manual_seed(model_cfg.init_seed)
        model = auto_class(ex.method.head).from_config(hf_config(model_cfg, ex.method.head), dtype=torch.float32)
        model.eval()
        return Exported(ex.folder, model, ex.tok, ex.method, ex.prefix, ex.max_length, ex.generation, ex.precision,
                        "torch")
    source, kwargs, _ = pretrained_source(m["name"], m.get("gguf_file"), "model")
    try:
        model = getattr(transformers, ex.method.head.auto_class).from_pretrained(source, revision=m.get("revision"),
                                                                            **kwargs)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--base: the base model {m['name']} of {ex.folder} cannot be loaded here "
                          f"({one_line(e)}); drop --base, or make the model available offline") from None
    model.eval()
    return Exported(ex.folder, model, ex.tok, ex.method, ex.prefix, ex.max_length, ex.generation, ex.precision, "torch")


def base_model(settings: dict[str, Any]) -> dict[str, Any]:
    """The model section of an export's pipeline settings: the base it was tuned from."""
    return dict(settings["model"])
