"""The HTTP side of `finetune serve-model` (flows/reports/serve_model.py): a FastAPI app speaking the OpenAI API's
shape over the served exports (stages/runtimes/serving.py), and the playground page at `/`.

    GET  /v1/models                  the served models (id, kind: chat | completion | classifier, base: its base's id)
    GET  /v1/models/{id}             one of them, with its card (the export's README.md) under "card"
    POST /v1/chat/completions        a chat export: messages rendered with its own template; "stream": SSE chunks
    POST /v1/completions             a generating export: the prompt continued
    POST /v1/classifications         a classifier: {"model", "input": text or list} -> each text's label and scores

A client error is a 4xx JSON body in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): malformed
JSON or a bad parameter (400), no or a wrong API key (401), an unknown model or path (404), a prompt whose tokens and
max_tokens do not fit the model's context (400, code context_length_exceeded), a full queue (503, Retry-After).
Each request ends in one access-log line: method, path, status, prompt and completion tokens, milliseconds."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from stages.runtimes.serving import Answer, Engine, Job, QueueFull, Sampling

access = logging.getLogger("finetune.serve.access")
MAX_STOPS = 4  # as OpenAI's API
MAX_INPUTS = 256  # texts in one classification request


@dataclass
class Served:
    """A name the server answers to: an engine (an export loaded once) and which variant of it."""

    name: str
    engine: Engine
    kind: str  # chat | completion | classifier
    context: int  # the model's context length: prompt + max_tokens must fit
    default_max_tokens: int  # the export's generation_config.json max_new_tokens
    card: str  # the export's README.md
    folder: str
    base: str | None = None  # the name its base is served under (--base)
    base_of: str | None = None  # the tuned model it is the base of
    greedy_only: bool = False  # llama.cpp decodes greedily here


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---------------------------------------------------------------- request bodies


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"] = Field(description="who speaks this turn")
    content: str = Field(description="the turn's text")


class Generating(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="a served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the export's "
                                   "max_new_tokens); prompt + max_tokens must fit the model's context")
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name in OpenAI's API")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 (default): greedy, as predict and evaluate; "
                               "above 0: sampled at this temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sampling: the smallest set of tokens holding this mass")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOPS} strings that end the answer")
    seed: int | None = Field(None, description="sampling: the seed of this request's generator (reproducible)")
    stream: bool = Field(False, description="server-sent events in OpenAI's chunk format, ending data: [DONE]")
    n: int = Field(1, ge=1, le=1, description="answers per request: 1")
    stream_options: dict[str, Any] | None = Field(None, description="include_usage: a last chunk with the usage")


class ChatRequest(Generating):
    messages: list[Message] = Field(min_length=1, description="the conversation, ending in a user turn")


class CompletionRequest(Generating):
    prompt: str | list[str] = Field(description="the text to continue (a list: one text)")


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="a served classifier's id")
    input: str | list[str] = Field(description=f"a text or a list of up to {MAX_INPUTS} texts to label")


# ---------------------------------------------------------------- the app


def create_app(models: dict[str, Served], api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="finetune serve-model", docs_url=None, redoc_url=None, openapi_url=None)
    static = resources.files("flows.reports") / "playground"

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        request.state.usage = (0, 0)
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                what = "no API key was given" if not given else "the API key is not this server's"
                return JSONResponse(error_body(f"{what}: send the header 'Authorization: Bearer KEY' (the key "
                                               f"finetune serve-model was started with: --api-key)",
                                               "invalid_request_error", None, "invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid" or tuple(first.get("loc", ())) == ("body",):
            why = first.get("ctx", {}).get("error") or first.get("msg", "malformed")
            msg, param = (f"the body is not a JSON object ({why}); send one with Content-Type: "
                          f"application/json"), None
        else:
            loc = [str(x) for x in first.get("loc", ()) if x != "body"]
            param = ".".join(loc) or None
            msg = f"{param or 'the body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(msg, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = (f"no such path {request.method} {request.url.path}; the API is under /v1 (docs/serving.md)"
               if e.status_code == 404 else str(e.detail))
        return JSONResponse(error_body(msg, "invalid_request_error", None, None), status_code=e.status_code)

    def served(name: str, kinds: tuple[str, ...]) -> Served:
        m = models.get(name)
        if m is None:
            raise ApiError(404, f"the model '{name}' is not served here; served: {', '.join(models)} "
                           f"(GET /v1/models)", param="model", code="model_not_found")
        if m.kind not in kinds:
            raise ApiError(400, f"the model '{name}' is a {m.kind} model; this endpoint takes a {' or '.join(kinds)} "
                           f"model", param="model", code="wrong_model_kind")
        return m

    def listed(m: Served) -> dict[str, Any]:
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "finetune", "kind": m.kind,
                "base": m.base, "base_of": m.base_of, "context": m.context}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [listed(m) for m in models.values()]}

    @app.get("/v1/models/{name}")
    async def one_model(name: str) -> dict[str, Any]:
        m = served(name, ("chat", "completion", "classifier"))
        return {**listed(m), "card": m.card, "folder": m.folder}

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(str(static / "index.html"))

    @app.get("/playground/{name}")
    async def asset(name: str) -> FileResponse:
        if name not in ("app.js", "style.css"):
            raise ApiError(404, f"no such file /playground/{name}")
        return FileResponse(str(static / name))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Any:
        from stages.runtimes.serving import chat_prompt

        m = served(body.model, ("chat",))
        turns = [t.model_dump() for t in body.messages]
        if turns[-1]["role"] != "user":
            raise ApiError(400, f"messages: the last turn is the {turns[-1]['role']}'s; end with the user turn to "
                           f"answer", param="messages")
        try:
            ids = chat_prompt(m.engine.ex, turns)
        except Exception as e:  # the chat template's own refusal (e.g. roles out of order)
            raise ApiError(400, f"messages: the model's chat template refused them ({e})", param="messages") from None
        return await answer(m, body, ids, request, "chat.completion")

    @app.post("/v1/completions", response_model=None)
    async def complete(body: CompletionRequest, request: Request) -> Any:
        from stages.runtimes.serving import text_prompt

        m = served(body.model, ("chat", "completion"))
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, f"prompt: one text per request, got {len(prompts)}", param="prompt")
        return await answer(m, body, text_prompt(m.engine.ex, prompts[0]), request, "text_completion")

    @app.post("/v1/classifications")
    async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
        m = served(body.model, ("classifier",))
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or len(texts) > MAX_INPUTS or any(not t.strip() for t in texts):
            raise ApiError(400, f"input: give 1 to {MAX_INPUTS} non-empty texts, got {len(texts)}"
                           f"{' (one empty)' if texts and len(texts) <= MAX_INPUTS else ''}", param="input")
        job = Job(texts=texts)
        records = await asyncio.wrap_future(submit(m, job))
        tokens = sum(len(x) for x in m.engine.ex.tok(texts)["input_ids"])
        request.state.usage = (tokens, 0)
        return {"object": "list", "model": m.name,
                "data": [{"index": i, "label": r["label"], "score": r["probability"], "scores": r["probabilities"]}
                         for i, r in enumerate(records)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app


def submit(m: Served, job: Job) -> Any:
    try:
        return m.engine.submit(job)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}; retry shortly (or start it with a larger --max-queue)",
                       "server_error", code="queue_full", headers={"Retry-After": "1"}) from None


def sampling(m: Served, body: Generating, prompt_tokens: int) -> Sampling:
    asked = body.max_tokens or body.max_completion_tokens
    max_tokens = asked or min(m.default_max_tokens, max(1, m.context - prompt_tokens))
    if prompt_tokens + max_tokens > m.context:
        raise ApiError(400, f"this model's maximum context length is {m.context} tokens; the prompt is "
                       f"{prompt_tokens} tokens and max_tokens {max_tokens}: shorten the prompt or lower max_tokens",
                       param="messages" if isinstance(body, ChatRequest) else "prompt",
                       code="context_length_exceeded")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: up to {MAX_STOPS} non-empty strings, got {stops!r}", param="stop")
    if m.greedy_only and body.temperature > 0:
        raise ApiError(400, f"temperature: {m.name} runs in llama.cpp, which decodes greedily here; give "
                       f"temperature 0, or serve it with --runtime torch", param="temperature")
    return Sampling(max_tokens, body.temperature, body.top_p, body.seed, stops)


async def answer(m: Served, body: Generating, ids: list[int], request: Request, obj: str) -> Any:
    s = sampling(m, body, len(ids))
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[str | None] = asyncio.Queue()
    streaming = body.stream

    def on_text(piece: str) -> None:  # called from the model's thread
        loop.call_soon_threadsafe(pieces.put_nowait, piece)

    job = Job(ids=ids, sampling=s, on_text=on_text if streaming else None)
    future = submit(m, job)
    rid, created = f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())

    def usage(a: Answer) -> dict[str, int]:
        return {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
                "total_tokens": a.prompt_tokens + a.completion_tokens}

    if not streaming:
        try:
            a: Answer = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        request.state.usage = (a.prompt_tokens, a.completion_tokens)
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": a.text},
                                   "finish_reason": a.finish_reason, "logprobs": None}
                                  if obj == "chat.completion" else
                                  {"index": 0, "text": a.text, "finish_reason": a.finish_reason, "logprobs": None})
        return {"id": rid, "object": obj, "created": created, "model": m.name, "choices": [choice],
                "usage": usage(a)}

    future.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, None))
    chunk_obj = "chat.completion.chunk" if obj == "chat.completion" else "text_completion"

    def chunk(piece: str | None, finish: str | None = None, role: bool = False) -> str:
        if obj == "chat.completion":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                ({} if piece is None else {"content": piece})
            c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            c = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created, "model": m.name,
                                      "choices": [c]}) + "\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            if obj == "chat.completion":
                yield chunk(None, role=True)
            while (piece := await pieces.get()) is not None:
                yield chunk(piece)
            try:
                a = future.result()
            except Exception as e:  # the status line went out already: the error is the last event
                yield "data: " + json.dumps(error_body(f"generation failed: {e}", "server_error")) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            while not pieces.empty():  # pieces queued after the future's end marker
                if (piece := pieces.get_nowait()) is not None:
                    yield chunk(piece)
            request.state.usage = (a.prompt_tokens, a.completion_tokens)
            yield chunk(None, a.finish_reason)
            if (body.stream_options or {}).get("include_usage"):
                yield "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created, "model": m.name,
                                             "choices": [], "usage": usage(a)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client gone mid-answer: its row stops generating

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class AccessLog:
    """ASGI middleware: one line per request once its response is sent (a stream's at its last event)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [0]
        state = scope.setdefault("state", {})

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                prompt, completion = state.get("usage", (0, 0))
                client = scope.get("client") or ("-", 0)
                access.info('%s "%s %s" %d prompt_tokens=%d completion_tokens=%d %.0f ms', client[0],
                            scope["method"], scope["path"], status[0], prompt, completion,
                            (time.perf_counter() - t0) * 1000)

        await self.app(scope, receive, sending)
