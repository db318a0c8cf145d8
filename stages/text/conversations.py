"""Conversations: a row's chat turns read from its data (data.format messages or alpaca), checked and
normalised to a list of {role, content} with role system / user / assistant.

The data stage writes them as an Arrow list<struct<role, content>> column `messages`; the tokenize stage
renders them with the chat template (stages/text/chat.py). A value that is not a conversation is a
DataError naming the file, the row (the file's line for CSV/JSONL) and the field, before any stage runs
(stages/data.py check_rows) and again when the data stage reads it.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Mapping
from typing import Any

from stages.engine.errors import DataError

ROLES = ("system", "user", "assistant")
ALPACA_COLUMNS = ("instruction", "input", "output")  # input is optional


def _as_list(value: Any) -> Any:
    """A conversation as JSONL, Parquet (numpy arrays of dicts) or CSV (a JSON string) hands it over."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return value


# Names other chat formats give the model's and the person's turns, for the suggested data.roles mapping.
_MODEL_NAMES = ("bot", "gpt", "model", "ai", "chatbot", "assistant", "agent", "response", "output", "answer")


def likely_role(name: str) -> str:
    """The role an unknown role name most likely means: assistant for a model's names, user otherwise."""
    return "assistant" if name.strip().lower() in _MODEL_NAMES else "user"


def conversation(value: Any, column: str, fields: Mapping[str, str], roles: Mapping[str, str],
                 where: str, reply: bool = False) -> list[dict[str, str]]:
    """The turns of one row's `column` as [{role, content}]; `where` names the file and row for errors.
    `reply`: a conversation to answer (`finetune predict`), which ends in a user turn instead of holding an
    assistant turn, and whose names no data.* setting maps (the fixes say to rename them in the file)."""
    turns = _as_list(value)
    fix = "give each row a list of {role, content} turns " + (
        "(rename other keys in the file)" if reply else "(data.message_fields / data.roles map other names)")
    if not isinstance(turns, list):
        raise DataError(f"{where}, field '{column}': a {type(turns).__name__}, not a list of turns; {fix}")
    role_key, content_key = fields.get("role", "role"), fields.get("content", "content")
    out = []
    for i, turn in enumerate(turns):
        at = f"{where}, field '{column}[{i}]'"
        if hasattr(turn, "items") and not isinstance(turn, dict):
            turn = dict(turn.items())
        if not isinstance(turn, dict):
            raise DataError(f"{at}: a {type(turn).__name__}, not a {{role, content}} turn; {fix}")
        for key in (role_key, content_key):
            if key not in turn:
                raise DataError(f"{at}: no key '{key}' (keys: {', '.join(map(str, turn))}); {fix}")
        raw_role, content = turn[role_key], turn[content_key]
        role = roles.get(str(raw_role), str(raw_role))
        if role not in ROLES:
            how = ("rename it to one of those in the file" if reply
                   else f"map it with data.roles, e.g. {{{raw_role}: {likely_role(str(raw_role))}}}")
            raise DataError(f"{at}: unknown role {raw_role!r} (known: {', '.join(ROLES)}); {how}")
        if not isinstance(content, str):
            raise DataError(f"{at}: content is a {type(content).__name__}, not text; give each turn's "
                            f"'{content_key}' as a string")
        out.append({"role": role, "content": content})
    if reply:
        if not out or out[-1]["role"] != "user":
            last = f"{'an' if out[-1]['role'] == 'assistant' else 'a'} {out[-1]['role']} turn" if out else "no turn"
            raise DataError(f"{where}, field '{column}': ends with {last}, not a user turn; end every "
                            f"conversation with the user turn to answer")
        return out
    if not any(t["role"] == "assistant" for t in out):
        raise DataError(f"{where}, field '{column}': no assistant turn (nothing to learn); give every "
                        f"conversation at least one assistant turn")
    return out


def _text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def alpaca(instruction: Any, input_: Any, output: Any, where: str) -> list[dict[str, str]]:
    """An alpaca row as a user turn (the instruction, then the input after a blank line) and an assistant
    turn (the output)."""
    ask, extra, answer = _text(instruction).strip(), _text(input_).strip(), _text(output)
    if not ask:
        raise DataError(f"{where}, field 'instruction': empty; give every alpaca row an instruction")
    if not answer.strip():
        raise DataError(f"{where}, field 'output': empty; give every alpaca row an output")
    return [{"role": "user", "content": f"{ask}\n\n{extra}" if extra else ask},
            {"role": "assistant", "content": answer}]


def last_exchange(turns: list[dict[str, str]]) -> tuple[str, str]:
    """(the user turn before the last assistant turn, that assistant turn): the text and target the
    evaluate stage shows and scores."""
    last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    asked = next((t["content"] for t in reversed(turns[:last]) if t["role"] == "user"), "")
    return asked, turns[last]["content"]


def looks_structured(value: Any) -> bool:
    """A cell holding a list or a dict (a conversation, most likely) where text is expected."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return True
    return isinstance(value, list | dict | tuple)


def fields_of(turns: Mapping[Any, str]) -> set[str]:
    """The {fields} data.conversation's format strings read."""
    return {f for text in turns.values() for _, f, _, _ in string.Formatter().parse(text) if f}


def from_columns(row: Mapping[str, Any], turns: Mapping[Any, str], label_names: list[str] | None,
                 where: str, label_column: str | None = "label") -> list[dict[str, str]]:
    """A row's conversation from data.conversation's format strings. {label} is the class name of the row's
    data.label_column: an integer id names label_names[id]; a name (string) stands as it is."""
    values = {k: _text(v) for k, v in row.items()}
    if label_column and label_column in row:
        value = row[label_column]
        if isinstance(value, str):
            if label_names and value not in label_names:
                raise DataError(f"{where}, field '{label_column}': {value!r} is not one of data.label_names "
                                f"{label_names}; add it there or fix the row")
            values["label"] = value
        elif label_names:
            try:
                if int(value) != value:
                    raise ValueError
                values["label"] = label_names[int(value)]
            except (ValueError, IndexError, TypeError):
                raise DataError(f"{where}, field '{label_column}': {value!r} is not a class id of "
                                f"data.label_names {label_names}; give labels 0..{len(label_names) - 1}") from None
    out = [{"role": role, "content": turns[role].format_map(values)}
           for role in ("system", "user", "assistant") if role in turns]
    if not out[-1]["content"].strip():
        raise DataError(f"{where}, field 'assistant': empty; every row needs an answer")
    return out
