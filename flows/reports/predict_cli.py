"""Run a trained model on new text (no Prefect, no training): the pipeline's current export, or any export folder.

    finetune predict PIPELINE [--config FILE] [--set ...] --text "a review" [--text ...]
    finetune predict EXPORT_FOLDER --file reviews.csv [--text-column review] [--out predictions.jsonl]
    finetune predict CHAT_EXPORT --chat "a question" [--chat ...] [--system "be brief"]
    finetune predict CHAT_EXPORT --file conversations.jsonl --messages-column messages [--out answers.jsonl]

(= python -m flows.predict; flows/predict.py is the shim.)

Classifiers print each text's label and its probability (--out: JSONL with every class's probability);
seq2seq / causal_lm models print the generated text, with the evaluate stage's generation settings (the
export's generation_config.json; --max-new-tokens / --num-beams change them). Texts are tokenized as the
tokenize stage does and run in batches sorted by length (stages/runtimes/exported.py), with a progress bar
on long inputs. From a pipeline name it uses the store's export for the current config and refuses, in one
line naming the command that makes it, when that export is missing or stale. --file is read as the data stage
reads data.path (stages/sources/tables.py: the same formats and errors). Bad input (no text, a file that cannot
be read or parsed, no such column, text that is not UTF-8 or over MAX_CHARS, a folder that is not an export or
is damaged) is one line on stderr naming the file and line, exit 2, before the model loads.

A chat export (a causal LM tuned on conversations; its tokenizer carries the chat template) answers
conversations: --chat TEXT is one user turn (each --chat its own conversation, after --system's turn when
given); --messages-column names --file's column holding whole conversations (a list of {role, content} ending
in a user turn; JSON text in a CSV). They are rendered with the export's template and its assistant cue,
batched with left padding, and each answer stops at the end-of-turn token. --chat on an export without a chat
template, or a malformed conversation (named by file, line and field), is one line, exit 2.
An export folder is predicted on without Prefect or the store; a pipeline name reads the store.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from stages.engine.cli import guarded
from stages.engine.commands import command
from stages.engine.config import DEFAULT_PIPELINE_FILE
from stages.engine.errors import ConfigError, DataError, MissingInputError
from stages.engine.paths import why_missing
from stages.pipeline.loading import load_pipeline
from stages.runtimes import RUNTIMES

SHOWN = 80  # characters of each input text printed beside its prediction
# The longest text (a conversation: all its turns) predict takes. The model reads a text's first
# tokenize.max_length tokens, but the tokenizer reads all of it first: 20 MB takes minutes, and most likely is
# a broken file (a quote never closed) rather than one text.
MAX_CHARS = 1_000_000


def build_parser(prog: str = "python -m flows.predict") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Predict with a pipeline's current "
                                "export or an export folder: labels with probabilities, or generated text; a chat "
                                "export answers conversations (--chat, or --file with --messages-column), rendered "
                                "with its chat template, batched with left padding, each stopping at the end of "
                                "its turn.")
    p.add_argument("target", help="a pipeline name (its export in the store) or an export folder")
    p.add_argument("--text", action="append", default=[], help="a text to predict on (repeatable)")
    p.add_argument("--file", type=Path, help="a CSV, TSV or JSONL file (.gz too), a JSON array of objects or a "
                   "Parquet file, as data.path takes, with one text (or, with --messages-column, one conversation) "
                   "per row")
    p.add_argument("--text-column", default="text", help="--file's column holding the text (default: text)")
    p.add_argument("--chat", action="append", default=[], metavar="TEXT",
                   help="a chat export: a user turn to answer (repeatable: each its own conversation, batched)")
    p.add_argument("--system", metavar="TEXT", help="a chat export: a system turn before each --chat turn (and "
                   "before each --messages-column conversation that has none)")
    p.add_argument("--messages-column", metavar="COLUMN", help="a chat export: --file's column holding whole "
                   "conversations, each a list of {role, content} turns (system / user / assistant) ending in "
                   "the user turn to answer (JSONL; in a CSV, the list as JSON text)")
    p.add_argument("--out", type=Path, help="write one JSON line per text here instead of printing")
    p.add_argument("--batch-size", type=int, help="texts per forward pass (default: 8 on a CPU, 32 on a GPU; "
                   "docs/export.md#batch-size)")
    p.add_argument("--max-new-tokens", type=int, help="generation: tokens to generate (default: the export's)")
    p.add_argument("--num-beams", type=int, help="generation: beams (default: the export's)")
    p.add_argument("--precision", choices=("export", "auto", "no", "bf16", "fp16"), default="export",
                   help="autocast of the forward passes; export (default): the precision the run evaluated in, "
                   "so predictions.jsonl reproduces; auto: bf16 on GPUs and CPUs with bf16 units, else fp32")
    p.add_argument("--runtime", choices=tuple(RUNTIMES), default="torch",
                   help="; ".join(f"{name}: {r.help}" for name, r in RUNTIMES.items()))
    p.add_argument("--config", type=Path, default=DEFAULT_PIPELINE_FILE, help="pipeline file (with a pipeline name)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of the pipeline whose export to use (repeatable)")
    return p


# ---------------------------------------------------------------- inputs


def read_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, columns) of a data file, read as the data stage reads `data.path` (stages/sources/tables.py: the same
    formats, the same errors)."""
    from stages.sources.tables import KINDS, read_table

    if not path.is_file():
        why = ("a folder" if path.is_dir() else "not a regular file" if path.exists() else why_missing(path))
        raise MissingInputError(f"--file {path}: {why}; give {KINDS}")
    try:
        table = read_table(path)
    except DataError as e:
        raise DataError(f"--file {e}") from None
    if table.empty:
        raise DataError(f"--file {path}: no rows; give a file with one text (or conversation) per row")
    return table.to_dict("records"), [str(c) for c in table.columns]


def missing_column(path: Path, column: str, columns: list[str], option: str) -> ConfigError:
    hint = (" (conversations? pass --messages-column messages)" if option == "--text-column" and
            "messages" in columns else "")
    return ConfigError(f"--file {path}: no column '{column}' (it has {', '.join(map(str, columns)) or 'none'}); "
                       f"pass {option}{hint}")


def read_texts(path: Path, column: str) -> list[str]:
    """The texts of a file's column (read_rows), in file order: a number is its text, as the data stage reads
    one; an empty cell, a list or a dict is refused, naming its line."""
    from stages.sources.tables import each_row
    from stages.text.conversations import looks_structured

    rows, columns = read_rows(path)
    if column not in columns:
        raise missing_column(path, column, columns, "--text-column")
    empty = sum(not text_of(r.get(column)).strip() for r in rows if not looks_structured(r.get(column)))

    def checked(value: Any, at: str) -> str:
        if looks_structured(value):
            raise DataError(f"--file {at}, column '{column}': holds a {type(value).__name__}, not text; for a "
                            f"chat export's conversations pass --messages-column {column}")
        if not (text := text_of(value)).strip():
            raise DataError(f"--file {at}, column '{column}': empty ({empty} such row{'s' if empty > 1 else ''}); "
                            f"fill or remove those rows")
        return short_enough(text, f"--file {at}, column '{column}'")

    return each_row(checked, [r.get(column) for r in rows], path, len(rows), lambda i: f"{path}: row {i + 1}")


def text_of(value: Any) -> str:
    """A cell as the data stage takes it for text: a number is its digits; missing (None, NaN) is empty."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def read_conversations(path: Path, column: str, system: str | None) -> list[list[dict[str, str]]]:
    """The conversations of a file's `column`, each checked as the data stage checks one (a list of
    {role, content}, known roles, text content), ending in a user turn; `system` goes first where there is
    no system turn."""
    from stages.sources.tables import each_row
    from stages.text.conversations import conversation

    rows, columns = read_rows(path)
    if column not in columns:
        raise missing_column(path, column, columns, "--messages-column")

    def checked(value: Any, at: str) -> list[dict[str, str]]:
        turns = conversation(value, column, {}, {}, f"--file {at}", reply=True)
        short_enough("".join(t["content"] for t in turns), f"--file {at}, field '{column}'")
        return with_system(turns, system)

    return each_row(checked, [r.get(column) for r in rows], path, len(rows), lambda i: f"{path}: row {i + 1}")


def short_enough(text: str, where: str) -> str:
    if len(text) > MAX_CHARS:
        raise DataError(f"{where}: {len(text):,} characters, more than the {MAX_CHARS:,} predict takes (the model "
                        f"reads only its first tokenize.max_length tokens); shorten it, or check the file's quotes")
    return text


def check_utf8(text: str, where: str) -> None:
    """`text` from the command line, refused (naming `where`) when it cannot be UTF-8: a byte that was not
    UTF-8 there (Python keeps it as a surrogate escape), or a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = (f"byte 0x{code - 0xDC00:02x} is not UTF-8" if 0xDC80 <= code <= 0xDCFF else
                f"U+{code:04X} is a lone surrogate, not a character")
        raise ConfigError(f"{where}: {what} (character {e.start + 1}); give the text as UTF-8") from None


def with_system(turns: list[dict[str, str]], system: str | None) -> list[dict[str, str]]:
    if system is None or any(t["role"] == "system" for t in turns):
        return turns
    return [{"role": "system", "content": system}, *turns]


def finetune_command(cfg: Any, config: Path) -> str:
    return command("run", cfg.name, config=config, overrides=cfg.overrides)


def export_folder(target: str, config: Path, overrides: list[str]) -> Path:
    """An export folder: `target` itself, or the store's export of pipeline `target` under its current config."""
    path = Path(target)
    if path.is_dir() or "/" in target or target.startswith("."):
        if overrides:
            raise ConfigError("--set applies to a pipeline name, not to an export folder; drop it")
        if not path.is_dir():
            why = "a file, not a folder" if path.exists() else why_missing(path)
            raise MissingInputError(f"{target}: {why}; give a pipeline name or an export folder")
        return path
    from stages.engine.remote_store import open_store
    from stages.engine.status import CACHED, find, pipeline_status
    from stages.facts import SHIPS, stage_named
    from stages.graph import graph_for

    cfg, store = load_pipeline(target, overrides, config), open_store()
    graph = graph_for(cfg)
    ships = stage_named(graph, SHIPS)
    if ships is None:
        raise MissingInputError(f"{cfg.name}: its pipeline ships no model (no stage of its graph exports one); "
                                f"predict with an export folder instead")
    st = find(pipeline_status(graph.plan(cfg, store, pinned=False), store), ships)
    if st.status != CACHED or st.path is None:
        why = "; ".join(st.reasons) or st.status
        raise MissingInputError(f"{cfg.name}: no current export ({st.status}: {why}); make it with: "
                                f"{finetune_command(cfg, config)}")
    folder = store.materialize(ships, st.artifact_key or st.key)  # on a shared store: downloaded here
    if folder is None:
        raise MissingInputError(f"{cfg.name}: the export {st.key[:12]} could not be read from the store {store}; "
                                f"make it again with: {finetune_command(cfg, config)} --force {ships}")
    return folder


# ---------------------------------------------------------------- output


def check_out(out: Path) -> None:
    """--out can be written, known before the model loads: not a folder, in a folder that is or can be made
    and that this user may write to."""
    if out.is_dir():
        raise ConfigError(f"--out {out}: a folder; give a file name, e.g. {out / 'predictions.jsonl'}")
    folder = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("."))
    if not folder.is_dir():
        raise ConfigError(f"--out {out}: {folder} is a file, not a folder; give another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"--out {out}: {out if out.exists() else folder} is not writable; give another path")


def shown(text: str) -> str:
    one = " ".join(text.split())
    return one if len(one) <= SHOWN else one[:SHOWN - 3] + "..."


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.predict") -> int:
    args = build_parser(prog).parse_args(argv)

    def go() -> int:
        if args.batch_size is not None and args.batch_size < 1:
            raise ConfigError("--batch-size: must be at least 1")
        given = [o for o, v in (("--text", args.text), ("--chat", args.chat), ("--file", args.file)) if v]
        if len(given) > 1:
            raise ConfigError(f"give one of --text, --chat or --file, not {' and '.join(given)}")
        if args.messages_column is not None and args.file is None:
            raise ConfigError("--messages-column names a column of --file; give --file FILE (or --chat TEXT)")
        if args.system is not None and not (args.chat or args.messages_column):
            raise ConfigError("--system goes with --chat or --messages-column (a chat export's conversations)")
        if any(not t.strip() for t in args.text + args.chat):
            raise ConfigError(f"{'--chat' if args.chat else '--text'}: an empty text; give the text to predict on")
        for option, values in (("--text", args.text), ("--chat", args.chat), ("--system", [args.system or ""])):
            for i, t in enumerate(values, 1):
                check_utf8(t, option if len(values) == 1 else f"{option} #{i}")
        for option, n in (("--max-new-tokens", args.max_new_tokens), ("--num-beams", args.num_beams)):
            if n is not None and n < 1:
                raise ConfigError(f"{option}: must be at least 1, got {n}")
        if args.out is not None:
            check_out(args.out)
        chats = None  # conversations to answer, else texts to predict on
        if args.chat:
            chats = [with_system([{"role": "user", "content": t}], args.system) for t in args.chat]
        elif args.messages_column is not None:
            chats = read_conversations(args.file, args.messages_column, args.system)
        if chats is not None:
            texts = [c[-1]["content"] for c in chats]  # what is shown beside each answer
        elif args.file is not None:
            texts = read_texts(args.file, args.text_column)
        else:
            texts = list(args.text)
        if not texts:
            raise ConfigError("nothing to predict: give --text TEXT (repeatable), --chat TEXT or --file FILE")
        folder = export_folder(args.target, args.config, args.overrides)
        from stages.runtimes.exported import load_export, predict

        ex = load_export(folder, chat=chats is not None, runtime=args.runtime)
        gen = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("num_beams", args.num_beams))
               if v is not None}
        if gen and not ex.method.head.generates:
            raise ConfigError("--max-new-tokens / --num-beams: this export is a classifier; drop them")
        records = predict(ex, texts, args.batch_size, gen, args.precision, conversations=chats)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as f:
                for i, (t, r) in enumerate(zip(texts, records, strict=True)):
                    asked = {"text": t} if chats is None else {"messages": chats[i]}
                    f.write(json.dumps({**asked, **r}) + "\n")
            print(f"predict: {len(records)} {'texts' if chats is None else 'conversations'} -> {args.out} "
                  f"(model {folder})")
            return 0
        for t, r in zip(texts, records, strict=True):
            if "label" in r:
                print(f"{r['label']}\t{r['probability']:.3f}\t{shown(t)}")
            else:
                print(f"{shown(t)}\n  -> {r['generated']}")
        return 0

    return guarded(go)

