"""Batched inference, shared by the evaluate stage and `flows.predict`: rows sorted longest first and cut into
batches (little padding; an out-of-memory error shows on the first batch), every model call through `forward`
(the one place where inference precision is decided), classifier logits and greedy / beam generation decoded
the way the evaluate stage records them. Results come back in the order of the inputs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from stages.engine.errors import NonFiniteOutputError
from stages.engine.progress import iterate
from stages.models.hf import IGNORE_INDEX, special_affixes

log = logging.getLogger("finetune.inference")


def forward(model: Any, *, generate: bool = False, **inputs: Any) -> Any:
    """The one model call of inference: `model(**inputs)`, or `model.generate(**inputs)` (a transformers
    model: GenerationMixin's, which torch.nn.Module lacks)."""
    return model.generate(**inputs) if generate else model(**inputs)


def device_for(model: torch.nn.Module) -> torch.device:
    """The GPU when there is one. A model loaded onto it (quantized, device_map) stays where it is."""
    current = next(model.parameters()).device
    if current.type != "cpu" or not torch.cuda.is_available():
        return current
    model.to("cuda")
    return torch.device("cuda")


def batches(lengths: list[int], batch_size: int, desc: str, logger: logging.Logger | None = None
            ) -> Iterator[list[int]]:
    """Row indices in batches of similar length, longest first, with a progress bar (or log lines)."""
    rows = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    yield from iterate([rows[i:i + batch_size] for i in range(0, len(rows), batch_size)], desc, logger or log)


def padded(seqs: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token id lists padded to the longest (on the left for decoder-only
    generation)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        p = torch.as_tensor(s, dtype=torch.long)
        if left:
            ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
        else:
            ids[r, :len(p)], mask[r, :len(p)] = p, 1
    return ids, mask


def generation_kwargs(e: Any, tok: Any, model: Any) -> dict[str, Any]:
    """Greedy (num_beams 1) or beam search from an `evaluate` section; length_penalty only means something
    with beams. Generation stops at the token the targets were tokenized to end with (the tokenizer's
    closing special)."""
    kw: dict[str, Any] = {"max_new_tokens": e.max_new_tokens, "num_beams": e.num_beams, "do_sample": False,
                          "eos_token_id": stop_token(tok, model), "pad_token_id": tok.pad_token_id}
    if e.num_beams > 1:
        kw["length_penalty"] = e.length_penalty
        kw["early_stopping"] = True
    return kw


def stop_token(tok: Any, model: Any) -> int | None:
    """The token the targets were tokenized to end with (the tokenizer's closing special), else EOS."""
    _, tail = special_affixes(tok)
    return tail[-1] if tail else (tok.eos_token_id if tok.eos_token_id is not None else model.config.eos_token_id)


def end_of_turn(tok: Any) -> int | None:
    """The token that closes an assistant turn under the tokenizer's chat template (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>, Gemma's <end_of_turn>): the first special token after the answer of a rendered
    exchange, the end the tokenize stage labels in each assistant turn. None without a template (or one that
    does not render a plain user / assistant exchange)."""
    from jinja2 import TemplateError

    if not getattr(tok, "chat_template", None):
        return None
    answer = "Fine, thanks."
    try:
        text = str(tok.apply_chat_template([{"role": "user", "content": "How are you?"},
                                            {"role": "assistant", "content": answer}], tokenize=False))
    except (TemplateError, ValueError, TypeError):
        return None
    at = text.rfind(answer)
    if at < 0:
        return None
    specials = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    after = tok(text[at + len(answer):], add_special_tokens=False)["input_ids"]
    return next((int(i) for i in after if i in specials), None)


def decoded_targets(tok: Any, labels: list[list[int]]) -> list[str]:
    """The target texts of tokenized rows (their labels, masked positions dropped), as generation decodes."""
    return [tok.decode([t for t in y if t != IGNORE_INDEX], skip_special_tokens=True).strip() for y in labels]


def prompt_of(input_ids: list[int], labels: list[int]) -> list[int]:
    """causal_lm rows are prompt + target with the prompt's labels masked (a conversation: each assistant turn
    labelled): the prompt is what comes before the last labelled run, the answer generation is scored on."""
    n = len(labels)
    while n > 0 and labels[n - 1] == IGNORE_INDEX:
        n -= 1
    while n > 0 and labels[n - 1] != IGNORE_INDEX:
        n -= 1
    return input_ids[:n]


@torch.no_grad()
def class_logits(model: torch.nn.Module, rows: list[list[int]], pad_id: int, batch_size: int, device: torch.device,
                 desc: str, logger: logging.Logger | None = None) -> torch.Tensor:
    """A classifier's logits (rows x classes, float32 on the CPU), in the order of `rows`."""
    out: torch.Tensor | None = None
    for idx in batches([len(x) for x in rows], batch_size, desc, logger):
        ids, mask = padded([rows[j] for j in idx], pad_id)
        logits = forward(model, input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        if out is None:
            out = torch.empty((len(rows), logits.shape[-1]), dtype=torch.float32)
        out[torch.as_tensor(idx)] = logits
    if out is not None and not (finite := torch.isfinite(out).all(-1)).all():
        raise NonFiniteOutputError(f"{desc}: the model's outputs are NaN or infinite for {int((~finite).sum())} of "
                                   f"{len(rows)} rows; its weights are corrupt or diverged")
    return out if out is not None else torch.empty((0, 0))


def stop_set(eos: Any) -> set[int]:
    """A generation config's eos_token_id (one id, a list of them, or None) as a set of stop ids."""
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@torch.no_grad()
def generated_ids(model: torch.nn.Module, prompts: list[list[int]], tok: Any, gen: dict[str, Any], batch_size: int,
                  device: torch.device, decoder_only: bool, desc: str, logger: logging.Logger | None = None
                  ) -> list[list[int]]:
    """Batched generation: each prompt's new token ids up to and including its stop token, in the order of
    `prompts`. Encoder-decoder inputs are padded on the right, decoder-only prompts on the left."""
    out_ids: list[list[int]] = [[] for _ in prompts]
    pad = tok.pad_token_id
    stops = stop_set(gen.get("eos_token_id")) or {pad}
    for idx in batches([len(p) for p in prompts], batch_size, desc, logger):
        ids, mask = padded([prompts[j] for j in idx], pad, left=decoder_only)
        out = forward(model, generate=True, input_ids=ids.to(device), attention_mask=mask.to(device), **gen)
        # decoder-only: the prompt comes back first; encoder-decoder: the decoder start token does
        new = out[:, ids.shape[1]:] if decoder_only else out[:, 1:]
        for r, j in enumerate(idx):
            seq = new[r].tolist()
            end = next((k for k, t in enumerate(seq) if t in stops), None)
            out_ids[j] = seq if end is None else seq[:end + 1]  # a finished row is padded after its end token
    return out_ids


def generate(model: torch.nn.Module, prompts: list[list[int]], tok: Any, gen: dict[str, Any], batch_size: int,
             device: torch.device, decoder_only: bool, desc: str, logger: logging.Logger | None = None
             ) -> tuple[list[str], list[int]]:
    """Batched generation: (decoded texts, generated token counts), in the order of `prompts`."""
    seqs = generated_ids(model, prompts, tok, gen, batch_size, device, decoder_only, desc, logger)
    return [tok.decode(s, skip_special_tokens=True).strip() for s in seqs], [len(s) for s in seqs]
