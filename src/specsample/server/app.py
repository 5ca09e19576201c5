"""The OpenAI-compatible HTTP API over one SpecSampler.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, ending in `data: [DONE]`)
    GET  /v1/models             GET  /v1/models/{id}   GET  /health   GET  /metrics (Prometheus text format)

Every response carries `usage` and a `speculative` block (acceptance rate, mean
accepted length, drafted and accepted tokens, tokens per second); a stream
carries them in its last chunk: the one with `finish_reason`, or, with
`stream_options.include_usage`, one of their own after it (no choices), as
OpenAI's API sends usage. Errors are OpenAI-style JSON: 400 for a bad
request, 401 for a missing or wrong API key, 503 when the queue is full.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import partial
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specsample.api import Chunk, Completion, SpecSampler
from specsample.gcfreeze import freeze_loaded
from specsample.openmp import in_passing_thread
from specsample.policy import KPolicy
from specsample.server.metrics import ServerMetrics
from specsample.server.scheduler import BatchWorker
from specsample.server.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, error_body, error_responses
from specsample.server.worker import EngineWorker, Events, InvalidRequest, QueueFull, Worker

log = logging.getLogger("specsample.server")
T = TypeVar("T")
SPECULATIVE_FIELDS = ("drafter", "acceptance_rate", "mean_accepted_length", "drafted_tokens", "accepted_tokens", "steps",
                      "tokens_per_second")


def create_app(
    sampler: SpecSampler,
    *,
    k: int | str | KPolicy | None = None,
    max_queue: int = 16,
    api_key: str | None = None,
    default_max_tokens: int = 256,
    max_batch: int = 1,
) -> FastAPI:
    """An app serving `sampler`; generations run one at a time, or up to `max_batch` together (continuous
    batching, `scheduler.BatchWorker`); at most `max_queue` admitted; K by the policy `k` (None: the
    sampler's configuration's; with `max_batch` above 1 a spec, each slot its own policy of it)."""
    metrics = ServerMetrics()
    worker = make_worker(sampler, metrics, max_queue=max_queue, k=k, default_max_tokens=default_max_tokens,
                         max_batch=max_batch)
    return serve_worker(worker, metrics, model_card(sampler), api_key=api_key)


def model_card(sampler: SpecSampler) -> dict:
    """The model's entry in /v1/models: its name, the drafter, its K policy and why they were chosen, the
    backend and why."""
    configuration = {**asdict(sampler.configuration), "backend": sampler.backend, "backend_reason": sampler.backend_reason}
    return {"id": sampler.model.name, "object": "model", "created": int(time.time()), "owned_by": "specsample",
            "speculative": configuration}


def serve_worker(worker: Worker, metrics: ServerMetrics, card: dict, *, api_key: str | None = None) -> FastAPI:
    """The routes over any worker that runs jobs: one engine in this process (`create_app`), or engine
    replicas elsewhere (`ray_app`); `card` is the model's entry in /v1/models (`model_card`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.close()

    app = FastAPI(title="specsample", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=check_api_key(api_key))
    add_error_handlers(app, metrics)
    app.openapi = partial(openapi_without_422, app)
    name = card["id"]
    generating = error_responses(400, 401, 503)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", responses=error_responses(401, 404))
    async def model(model_id: str) -> JSONResponse:
        if model_id != name:
            body = error_body(f"the model {model_id!r} does not exist: this server holds {name!r}", param="model",
                              code="model_not_found")
            return JSONResponse(body, status_code=404)
        return JSONResponse(card)

    @app.post("/v1/chat/completions", responses=generating)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [m.as_message() for m in body.messages]
        job = worker.submit(messages, True, body.generation_options(), request.url.path)
        return await respond(request, body, job, ChatReply(name))

    @app.post("/v1/completions", responses=generating)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        job = worker.submit(body.text, False, body.generation_options(), request.url.path)
        return await respond(request, body, job, TextReply(name))

    return app


def openapi_without_422(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document without the 422 it declares for every route with a body: this server
    answers a body that does not validate with a 400 and the OpenAI error body (`add_error_handlers`)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)  # made once and kept in app.openapi_schema
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            operation["responses"].pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
    return app.openapi_schema


def serving_sampler(model: str | None, drafter: str | None, *, backend: str, trust_remote_code: bool,
                    threads: int | None) -> SpecSampler:
    """A server's sampler (`SpecSampler.load`), loaded on a passing thread so that the worker thread that
    decodes holds the process's only OpenMP team (`openmp.in_passing_thread`), then its objects frozen
    for the garbage collector (`gcfreeze`)."""
    sampler = in_passing_thread(SpecSampler.load, model, drafter, backend=backend, trust_remote_code=trust_remote_code,
                                threads=threads)
    freeze_loaded()
    return sampler


def make_worker(
    sampler: SpecSampler, metrics: ServerMetrics, *, max_queue: int, k: int | str | KPolicy | None,
    default_max_tokens: int, max_batch: int,
) -> EngineWorker | BatchWorker:
    """The one-at-a-time worker, or the continuous batching one where `max_batch` is above 1."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if max_batch == 1:
        return EngineWorker(sampler, metrics, max_queue=max_queue, k=k, default_max_tokens=default_max_tokens)
    if not (k is None or isinstance(k, (int, str))):
        raise ValueError("with max_batch above 1, K is a spec (an integer, auto, ...): each slot has a policy of it")
    return BatchWorker(sampler, metrics, max_queue=max_queue, max_batch=max_batch, k=k,
                       default_max_tokens=default_max_tokens)


class TextReply:
    """The shapes of a text completion and of its stream chunks."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str) -> None:
        self.id, self.created, self.model = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time()), model

    def choice(self, completion: Completion) -> dict:
        return {"index": 0, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": None}

    def delta(self, text: str | None, finish_reason: str | None = None) -> dict:
        return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}

    def opening(self) -> list[dict]:
        return []

    def response(self, completion: Completion) -> dict:
        return {**self._head(self.object), "choices": [self.choice(completion)], **usage(completion)}

    def chunk(self, text: str) -> dict:
        return {**self._head(self.chunk_object), "choices": [self.delta(text)]}

    def last_chunks(self, completion: Completion, usage_chunk: bool) -> list[dict]:
        """The chunk with the finish reason, and the usage in it or (`usage_chunk`) in one of its own after it,
        whose choices are empty (OpenAI's `stream_options.include_usage`)."""
        finish = {**self._head(self.chunk_object), "choices": [self.delta(None, completion.finish_reason)]}
        if usage_chunk:
            return [finish, {**self._head(self.chunk_object), "choices": [], **usage(completion)}]
        return [{**finish, **usage(completion)}]

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}


class ChatReply(TextReply):
    """The shapes of a chat completion and of its stream chunks."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, completion: Completion) -> dict:
        message = {"role": "assistant", "content": completion.text}
        return {"index": 0, "message": message, "finish_reason": completion.finish_reason, "logprobs": None}

    def delta(self, text: str | None, finish_reason: str | None = None) -> dict:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def opening(self) -> list[dict]:
        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        return [{**self._head(self.chunk_object), "choices": [opening]}]


def usage(completion: Completion) -> dict:
    """The `usage` and `speculative` blocks of a finished generation."""
    stats = completion.stats.to_dict()
    prompt, generated = completion.stats.prompt_tokens, len(completion.token_ids)
    return {
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
        "speculative": {key: stats[key] for key in SPECULATIVE_FIELDS},
    }


async def respond(request: Request, body: GenerationRequest, job: Events, reply: TextReply) -> Response:
    """Wait for the first event (a bad prompt is still a 400), then stream or answer in one piece."""
    try:
        first = await unless_disconnected(request, job.next_event())
        if body.stream:
            return StreamingResponse(events(job, first, reply, body.usage_chunk), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(reply.response(await unless_disconnected(request, rest(job, first))))
    except InvalidRequest as error:
        return JSONResponse(error_body(str(error)), status_code=400)
    except ClientGone:
        job.cancel()
        return Response(status_code=499)
    except asyncio.CancelledError:  # the request's task cancelled (Ray Serve's proxy, when its client leaves)
        job.cancel()
        raise


async def rest(job: Events, event: Chunk | Completion) -> Completion:
    """The completion, after the chunks still to come."""
    while isinstance(event, Chunk):
        event = await job.next_event()
    return event


async def events(job: Events, event: Chunk | Completion, reply: TextReply, usage_chunk: bool) -> AsyncIterator[str]:
    """Server-sent events of a stream (`usage_chunk`: the usage in a chunk of its own, `TextReply.last_chunks`);
    leaving early (the client went away) cancels the generation."""
    try:
        for chunk in reply.opening():
            yield sse(chunk)
        while isinstance(event, Chunk):
            if event.text:
                yield sse(reply.chunk(event.text))
            event = await job.next_event()
        for chunk in reply.last_chunks(event, usage_chunk):
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    except Exception as error:  # the response has started: report in the stream, as OpenAI does, and end it
        log.exception("stream failed")
        yield sse(error_body(str(error), type="server_error"))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ClientGone(Exception):
    """The client disconnected before its response."""


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, or raise ClientGone as soon as the client disconnects."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work not in done:
        raise ClientGone()
    return work.result()


async def disconnect(request: Request) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """OpenAI-style JSON errors: 400 for malformed JSON and invalid fields (FastAPI says 422)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.requests.labels(request.url.path, "invalid").inc()
        message, param = describe(exc.errors()[0], request.headers.get("content-type"))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(QueueFull)
    async def busy(request: Request, exc: QueueFull) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="server_error", code="queue_full"), status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400:  # a body that cannot be parsed at all
            metrics.requests.labels(request.url.path, "invalid").inc()
            message = unparsed_body(exc.__cause__) or message
        return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc}", type="server_error"), status_code=500)


def unparsed_body(cause: BaseException | None) -> str | None:
    """What kept FastAPI from reading a body (its HTTPException says only "There was an error parsing the
    body"), from the exception it raised that from; None for another cause."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 text: byte {cause.object[cause.start]:#04x} at {cause.start}"
    if isinstance(cause, RecursionError):
        return "the body's JSON is nested too deeply"
    if isinstance(cause, ValueError):  # Python's limit on an integer's digits, among others
        return f"the body cannot be read as JSON: {cause}"
    return None


def describe(error: dict, content_type: str | None = None) -> tuple[str, str | None]:
    """A one-line message and the offending parameter of a pydantic or JSON error (`content_type`: the
    request's, for a body that was not read as JSON)."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    if error["type"] == "json_invalid":
        return f"malformed JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
    if isinstance(error.get("input"), bytes):  # FastAPI reads a body as JSON only under a JSON content type
        return f"send the body as JSON with Content-Type: application/json (got {content_type or 'no Content-Type'})", None
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    if not loc and error["type"] != "value_error":
        message = f"the request body must be a JSON object ({message})"
    param = ".".join(loc) or None
    if param is None:  # a check over the whole request names its option (`schemas.OptionError`)
        return message, getattr(error.get("ctx", {}).get("error"), "param", None)
    return f"{param}: {message}", loc[0]


def check_api_key(key: str) -> str:
    """`key` if a client can send it as `Authorization: Bearer KEY`, else a ValueError: an empty key would
    turn authentication off, and one with spaces around it or characters outside printable ASCII could
    never match what a client sends."""
    if not key:
        raise ValueError("the API key is empty (is SPECSAMPLE_API_KEY set?): give a key, or no --api-key for no authentication")
    if key != key.strip() or not all(" " < c <= "~" for c in key):
        raise ValueError("the API key must be printable ASCII without spaces, as clients send it in an HTTP header")
    return key


class BearerAuth:
    """ASGI middleware: /v1 routes need `Authorization: Bearer <api key>` (401 otherwise); the scheme's name
    is case-insensitive (RFC 7235), the key is not."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))  # the app's own, under a route prefix
        if scope["type"] == "http" and path.startswith("/v1"):
            scheme, _, key = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.expected):
                body = error_body("missing or incorrect API key (Authorization: Bearer ...)", code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
