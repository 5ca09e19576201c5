"""The OpenAI-compatible API over N engine replicas on a Ray cluster (Ray Serve).

    HTTP -> Ray Serve proxy -> Gateway (1 replica: the routes of `app.py`) --DeploymentHandle--> Engine x N

An `Engine` replica is one worker (`app.make_worker`, `max_batch` as in `serve`) over its own SpecSampler
(target, drafter, K policy), on `threads` CPUs; it streams a request's chunks and completion back. The `Gateway` is today's FastAPI app
(`serve_worker`: same routes, streaming, 400/401/503 JSON errors, `speculative` statistics) over a
`ReplicaWorker`, which hands each request to an Engine replica through a DeploymentHandle. Why a gateway
rather than `@serve.ingress` on the engine itself: the replica that dies is then never the process that
talks to the client, so its in-flight requests end in a 503 JSON error (or an error event in a stream it
had begun) instead of a connection Ray's proxy cuts; and every request passes through one place, whose
/metrics is therefore the sum over the replicas.

Routing is Ray Serve's: power of two choices on the replicas' ongoing requests (least loaded of two
sampled). A replica takes at most `max_queue` requests (`max_ongoing_requests`, running or waiting);
at most `max_queue` more wait in the gateway, beyond that a 503 (`RayOptions.capacity`: the gateway counts
its requests itself; Ray Serve's `max_queued_requests` refused requests below it, since the handle counts a
request as queued until a replica's report of its load reaches the router).
Autoscaling between `min_replicas` and `max_replicas` keeps about `target_queue` ongoing requests per
replica (Ray Serve's `autoscaling_config.target_ongoing_requests`: queue depth), averaged over `look_back`
seconds, adding replicas after `upscale_delay` seconds above it and removing them after `downscale_delay`
below. `prefix_affinity`: Ray Serve's prefix-aware router instead (`PrefixCacheAffinityRouter`): among
replicas whose queues differ by at most `AFFINITY_IMBALANCE`, the one whose earlier prompts share the
longest prefix with this one (its suffix drafter has seen that text), else power of two choices.

    serve run specsample.server.ray_app:build_app replicas=2 threads=1 backend=llamacpp
    specsample serve --replicas 2 --threads 1          (the same, from the command line)
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass
from time import perf_counter

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from specsample.api import Chunk, Completion, Prompt
from specsample.models import check_backend
from specsample.policy import parse_k
from specsample.server.app import check_api_key, make_worker, model_card, serve_worker, serving_sampler
from specsample.server.metrics import ServerMetrics
from specsample.server.schemas import error_body
from specsample.server.worker import InvalidRequest, QueueFull


AUTOSCALING = ("min_replicas", "max_replicas", "target_queue", "upscale_delay", "downscale_delay", "look_back")


class RayOptions(BaseModel):
    """The application's arguments (`serve run ...:build_app key=value`, or `specsample serve --replicas`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    drafter: str | None = None
    k: str | None = None
    backend: str = "auto"
    threads: int = Field(1, ge=1)  # CPUs (and engine threads) of each replica
    trust_remote_code: bool = False
    replicas: int | None = Field(None, ge=1)  # fixed count; else autoscaling between min and max
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_queue: float = Field(2.0, gt=0)  # ongoing requests per replica autoscaling aims at
    upscale_delay: float = Field(30.0, ge=0)  # seconds above target_queue before a replica is added
    downscale_delay: float = Field(600.0, ge=0)  # seconds below it before one is removed
    look_back: float = Field(30.0, gt=0)  # seconds over which the queue depth is averaged
    prefix_affinity: bool = False  # Ray Serve's prefix-aware router rather than power of two choices
    max_queue: int = Field(16, ge=1)
    max_batch: int = Field(1, ge=1)  # requests each replica decodes together (continuous batching)
    default_max_tokens: int = Field(256, ge=1)
    api_key: str | None = None
    name: str = "specsample"

    @model_validator(mode="after")
    def check_replicas(self) -> "RayOptions":
        check_backend(self.backend)  # an unknown backend, or llamacpp not installed: here, not in every replica
        if self.k is not None:
            parse_k(self.k)  # a bad K fails here, not in every replica
        if self.api_key is not None:
            check_api_key(self.api_key)
        autoscaling = [name for name in AUTOSCALING if name in self.model_fields_set]
        if self.replicas is not None and autoscaling:
            raise ValueError(f"replicas (a fixed count) and {autoscaling[0]} (autoscaling) were both given: "
                             "give replicas, or min_replicas and max_replicas, not both")
        if self.replicas is None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self

    def capacity(self) -> int:
        """Requests in the application at once, running or waiting: `max_queue` per replica (at most
        `max_replicas` of them when autoscaling) and `max_queue` more waiting for one."""
        replicas = self.max_replicas if self.replicas is None else self.replicas
        return self.max_queue * (replicas + 1)

    def scaling(self) -> dict:
        """The Engine deployment's replica count or autoscaling config."""
        if self.replicas is not None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "initial_replicas": max(1, self.min_replicas),
                                       "target_ongoing_requests": self.target_queue,
                                       "upscale_delay_s": self.upscale_delay,
                                       "downscale_delay_s": self.downscale_delay,
                                       "look_back_period_s": self.look_back}}

    def routing(self) -> dict:
        """The Engine deployment's request router: Ray Serve's default, or its prefix-aware one."""
        if not self.prefix_affinity:
            return {}
        # ray.serve.llm.request_router re-exports this class but imports ray[llm] (pyarrow, ...) on the way
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )

        return {"request_router_config": {"request_router_class": PrefixCacheAffinityRouter,
                                          "request_router_kwargs": {"imbalanced_threshold": AFFINITY_IMBALANCE}}}


AFFINITY_IMBALANCE = 1  # ongoing requests: a replica a generation further behind is not worth its prefix


@dataclass(frozen=True)
class EngineRequest:
    """One generation for an Engine replica: what `Worker.submit` takes."""

    input: Prompt
    chat: bool
    options: dict
    endpoint: str

    @property
    def prompt(self) -> str:
        """The text Ray Serve's prefix-aware router matches (it reads a `prompt` attribute): the messages
        with their roles, never empty."""
        if isinstance(self.input, str):
            return self.input
        return "".join(f"{message['role']}: {message['content']}\n" for message in self.input)


class ReplicaFailed(Exception):
    """The replica running a request died or became unreachable (Ray restarts it); retry the request."""


@serve.deployment(name="Engine")
class Engine:
    """One engine replica: a SpecSampler on `threads` CPUs behind a worker (`app.make_worker`: one generation at
    a time, or up to `max_batch` together)."""

    def __init__(self, options: RayOptions) -> None:
        torch.set_num_threads(options.threads)
        sampler = serving_sampler(options.model, options.drafter, backend=options.backend,
                                  trust_remote_code=options.trust_remote_code, threads=options.threads)
        policy = None if options.k is None else parse_k(options.k)
        # the gateway bounds the requests (`RayOptions.capacity`); Ray Serve's router, whose view of a
        # replica's load lags (cancelled requests it still counts, or ones it has not heard of), may send it
        # more than max_queue, which this worker takes rather than refuse what the gateway admitted
        self.worker = make_worker(sampler, ServerMetrics(), max_queue=options.capacity(),
                                  k=policy if options.max_batch == 1 else options.k,
                                  default_max_tokens=options.default_max_tokens, max_batch=options.max_batch)
        self.card = model_card(sampler)

    def describe(self) -> dict:
        """The model's entry in /v1/models."""
        return self.card

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk | Completion]:
        """A request's chunks, then its completion; a cancelled call (the client left) stops the engine."""
        job = self.worker.submit(request.input, request.chat, request.options, request.endpoint)
        try:
            event = await job.next_event()
            while isinstance(event, Chunk):
                yield event
                event = await job.next_event()
            yield event
        finally:
            job.cancel()


OUTCOMES = {InvalidRequest: "invalid", QueueFull: "rejected"}  # what the routes answer 400 and 503 to


class ReplicaJob:
    """A request running on an Engine replica, read as the routes read a local `Job`; it does the gateway's
    accounting (the sum over replicas, since every request passes here)."""

    def __init__(self, stream: DeploymentResponseGenerator, metrics: ServerMetrics, endpoint: str,
                 jobs: set[ReplicaJob]) -> None:
        self.stream, self.metrics, self.endpoint, self.jobs = stream, metrics, endpoint, jobs
        self.arrived, self.first, self.outcome = perf_counter(), True, None
        metrics.queue_depth.inc()
        jobs.add(self)

    async def next_event(self) -> Chunk | Completion:
        try:
            event = await self.stream.__anext__()
        except RayTaskError as error:  # raised by the replica's code: a bad prompt, its queue full
            self._settle(OUTCOMES.get(type(error.cause), "error"))
            raise error.cause if type(error.cause) in OUTCOMES else ReplicaFailed(
                f"the replica failed: {error.cause}") from None
        except (StopAsyncIteration, RayError, RayServeException) as error:
            self._settle("error")
            raise ReplicaFailed(f"the replica serving this request failed ({type(error).__name__}); Ray restarts "
                                "it; retry the request") from None
        self._account(event)
        return event

    def cancel(self) -> None:
        if self.outcome is None:
            self.stream.cancel()
            self._settle("cancelled")

    def _account(self, event: Chunk | Completion) -> None:
        if self.first:
            self.metrics.first_token_seconds.observe(perf_counter() - self.arrived)
            self.first = False
        if isinstance(event, Completion):
            self.metrics.finished(event.stats)
            self.metrics.request_seconds.observe(perf_counter() - self.arrived)
            self._settle("completed")

    def _settle(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.requests.labels(self.endpoint, outcome).inc()
            self.metrics.queue_depth.dec()
            self.jobs.discard(self)


class ReplicaWorker:
    """The `Worker` of the gateway: each request goes to an Engine replica picked by Ray Serve's router, at
    most `capacity` at once (`RayOptions.capacity`), counted here as they arrive and end."""

    def __init__(self, engine: DeploymentHandle, metrics: ServerMetrics, capacity: int) -> None:
        self.engine, self.metrics, self.capacity = engine.options(stream=True), metrics, capacity
        self.jobs: set[ReplicaJob] = set()  # not yet settled

    def submit(self, prompt: Prompt, chat: bool, options: dict, endpoint: str) -> ReplicaJob:
        if len(self.jobs) >= self.capacity:
            self.metrics.requests.labels(endpoint, "rejected").inc()
            raise QueueFull(f"the server is busy: all {self.capacity} places of its replicas and its queue are "
                            "taken; retry later")
        request = EngineRequest(prompt, chat, options, endpoint)
        return ReplicaJob(self.engine.generate.remote(request), self.metrics, endpoint, self.jobs)

    def close(self) -> None:
        """Nothing to stop here: the replicas end with the application."""


@serve.deployment(name="Gateway", num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Gateway:
    """The HTTP routes of `app.py` over the Engine replicas."""

    async def __init__(self, engine: DeploymentHandle, api_key: str | None, capacity: int) -> None:
        self.engine, self.api_key, self.capacity = engine, api_key, capacity
        self.card = await engine.describe.remote()

    def __serve_build_asgi_app__(self) -> FastAPI:
        metrics = ServerMetrics()
        worker = ReplicaWorker(self.engine, metrics, self.capacity)
        app = serve_worker(worker, metrics, self.card, api_key=self.api_key)
        app.add_exception_handler(ReplicaFailed, replica_failed)
        return app


async def replica_failed(request: Request, exc: ReplicaFailed) -> JSONResponse:
    return JSONResponse(error_body(str(exc), type="server_error", code="replica_failed"), status_code=503,
                        headers={"Retry-After": "1"})


def build_app(args: RayOptions | dict) -> serve.Application:
    """The Ray Serve application: `serve run specsample.server.ray_app:build_app replicas=2 threads=1` (the
    arguments as a dict, strings from the command line) or `build_app(RayOptions(...))`."""
    options = RayOptions.model_validate(args)
    engine = Engine.options(
        ray_actor_options={"num_cpus": options.threads}, max_ongoing_requests=options.max_queue,
        max_queued_requests=-1, **options.scaling(), **options.routing(),  # the gateway bounds the queue
    ).bind(options)
    return Gateway.bind(engine, options.api_key, options.capacity())


def run(options: RayOptions, *, host: str, port: int, address: str | None = None) -> None:
    """Serve `options` on a Ray cluster until Ctrl-C or SIGTERM. `address`: a cluster's "host:port", "auto"
    (the one `ray start` made on this machine), "local" (a new one on this machine's cores, without Ray's
    dashboard), or None: RAY_ADDRESS's, else as "auto", else a new one with the dashboard.

    It stops as `specsample serve` (uvicorn) does: on SIGINT or SIGTERM it deletes the application, and when
    it started the cluster itself, shuts Serve and that cluster down (no raylet, gcs_server or worker left;
    a cluster it joined keeps running); then it raises the signal again with its former handler:
    Ctrl-C ends in KeyboardInterrupt (the CLI's exit code 130), SIGTERM in death by SIGTERM (143 in a shell)."""
    import ray

    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt  # ends the wait in serve.run, or Ray's start-up

    former = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        handle_signals(stop)
        ray.init(address=address, include_dashboard=False if address == "local" else None)
        handle_signals(stop)  # again: ray.init installs Ray's own SIGTERM handler, which aborts the process
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(options), name=options.name, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        if not received:
            raise
    finally:
        handle_signals(signal.SIG_IGN)  # a second Ctrl-C must not cut the shut-down short, leaving processes
        shut_down(options.name)
        for signum, handler in former.items():
            signal.signal(signum, handler)
    for signum in received[:1]:
        signal.raise_signal(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def handle_signals(handler: Callable | int) -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def shut_down(name: str) -> None:
    """Delete the application; if this process started the cluster (it is its head node), stop Serve's
    actors and the cluster too, else only leave it."""
    import ray

    if not ray.is_initialized():
        return
    # Ray has no public "did ray.init start this cluster"; a driver that did is the head node's owner
    started_here = ray._private.worker.global_worker.node.is_head()
    with suppress(RayError, RayServeException):
        if started_here:
            serve.shutdown()
        else:
            serve.delete(name)
    ray.shutdown()
