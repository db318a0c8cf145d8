"""Conversations rendered with a chat template into token ids and labels (the tokenize stage, causal_lm).

The template is the tokenizer's own unless `tokenize.chat_template` names a file or holds one inline; the
text rendered is what the model sees in use (`tokenizer.apply_chat_template`). Labels follow
`tokenize.loss_on`: the assistant turns (each with the end-of-turn token that closes it, so the model
learns to stop, also when the pad token is that same token), the last assistant turn (completion), or
everything.

How the turns are told apart: the conversation up to turn k, rendered with the generation prompt, must be
a prefix of the whole rendering; the text between that prefix and the rendering up to turn k + 1 is
assistant turn k. Each piece is tokenized on its own, the way generation sees a prompt and what follows
it. A template that does not render conversations prefix by prefix is refused with a line saying so.

Too long for `tokenize.max_length`: the oldest exchanges go first (a system turn stays); if the last
exchange alone is too long, the head of its prompt is cut; the last assistant turn (cut to
`max_target_length`, its closing tokens kept) and the generation cue before it always survive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.paths import PROJECT_ROOT
from stages.pipeline.schema import PipelineConfig, TokenizeConfig
from stages.text.tokens import IGNORE_INDEX

TEMPLATE_SUFFIXES = (".jinja", ".j2", ".jinja2")


def template_path(value: str | None) -> Path | None:
    """The file `tokenize.chat_template` names (None: the tokenizer's own, or an inline template)."""
    if value is None or "{" in value:
        return None
    for base in (Path.cwd(), PROJECT_ROOT):
        p = (base / value).expanduser()
        if p.is_file():
            return p
    if value.endswith(TEMPLATE_SUFFIXES):
        raise MissingInputError(f"tokenize.chat_template {value}: no such file; give an existing .jinja file or "
                                f"an inline Jinja template")
    raise ConfigError(f"tokenize.chat_template {value!r}: neither a file nor a Jinja template (no '{{'); give a "
                      f".jinja file or the template itself")


def template_files(cfg: PipelineConfig) -> list[Path]:
    """The template file, whose content goes in the tokenize key (an inline one is in it as config)."""
    p = template_path(cfg.tokenize.chat_template)
    return [] if p is None else [p]


def template_of(tok: Any, t: TokenizeConfig, model: str) -> str:
    """The chat template text the conversations are rendered with."""
    p = template_path(t.chat_template)
    if p is not None:
        return p.read_text()
    if t.chat_template is not None:
        return t.chat_template
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"the tokenizer of {model} has no chat template; set tokenize.chat_template to a .jinja "
                          f"file or an inline Jinja template")
    return str(tok.chat_template)


class Renderer:
    """Token ids and labels of conversations, one template and loss mode."""

    def __init__(self, tok: Any, template: str, loss_on: str, t: TokenizeConfig):
        self.tok, self.template, self.t = tok, template, t
        self.loss_on = "assistant" if loss_on == "auto" else loss_on

    def text(self, turns: list[dict[str, str]], prompt: bool = False) -> str:
        return str(self.tok.apply_chat_template(turns, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=prompt))

    def pieces(self, turns: list[dict[str, str]]) -> list[tuple[str, int | None]]:
        """The rendering cut into (text, assistant turn index or None), in order."""
        full = self.text(turns)
        out: list[tuple[str, int | None]] = []
        at = 0
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            start, end = self.text(turns[:k], prompt=True), self.text(turns[:k + 1])
            if not (full.startswith(start) and full.startswith(end) and at <= len(start) <= len(end)):
                raise ConfigError("the chat template does not render a conversation as its turns one after "
                                  "another (the conversation up to an assistant turn is not a prefix of the whole), "
                                  "so assistant turns cannot be told apart; set tokenize.loss_on: all or give "
                                  "tokenize.chat_template")
            out += [(full[at:len(start)], None), (full[len(start):len(end)], k)]
            at = len(end)
        if at < len(full):
            out.append((full[at:], None))
        return [(s, k) for s, k in out if s]

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def row(self, turns: list[dict[str, str]]) -> tuple[list[int], list[int], int, int]:
        """(input ids, labels, untruncated length, where the last assistant turn starts) of a conversation."""
        ids, labels, answer = self._row(turns)
        untruncated = len(ids)
        keep = [i for i, t in enumerate(turns) if t["role"] == "system"]
        rest = [i for i in range(len(turns)) if i not in keep]
        last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
        while len(ids) > self.t.max_length:
            older = [i for i in rest if turns[i]["role"] == "assistant" and i < last]
            if not older:
                break
            rest = [i for i in rest if i > older[0]]  # the oldest exchange goes
            ids, labels, answer = self._row([turns[i] for i in sorted(keep + rest)])
        if len(ids) > self.t.max_length:  # the last exchange alone: its prompt's head goes
            cut = min(len(ids) - self.t.max_length, answer)
            ids, labels, answer = ids[cut:], labels[cut:], answer - cut
        return ids, labels, untruncated, answer

    def _row(self, turns: list[dict[str, str]]) -> tuple[list[int], list[int], int]:
        """(ids, labels, where the last assistant turn starts)."""
        last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
        ids: list[int] = []
        labels: list[int] = []
        answer = 0
        for text, k in self.pieces(turns):
            x = self.ids(text)
            if k == last:
                answer = len(ids)
                limit = min(self.t.max_target_length or self.t.max_length, self.t.max_length - 1)
                if len(x) > limit:
                    x = self._cut_target(x, limit)
            trained = self.loss_on == "all" or (k is not None and (self.loss_on == "assistant" or k == last))
            ids += x
            labels += x if trained else [IGNORE_INDEX] * len(x)
        return ids, labels, answer

    def _cut_target(self, x: list[int], limit: int) -> list[int]:
        """The head of a too-long assistant turn, its closing tokens (end of turn and after) kept."""
        stops = {i for i in (self.tok.eos_token_id, self.tok.pad_token_id) if i is not None}
        close = next((j for j in range(len(x) - 1, -1, -1) if x[j] in stops), len(x))
        tail = x[close:]
        return x[: max(limit - len(tail), 1)] + tail


def render_rows(tok: Any, template: str, conversations: list[list[dict[str, str]]], t: TokenizeConfig
                ) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """(input ids, labels, untruncated lengths, prompt lengths: where the last assistant turn starts)."""
    r = Renderer(tok, template, t.loss_on, t)
    out = [r.row(turns) for turns in conversations]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out], [o[3] for o in out]
