"""One engine, many requests: a bounded queue in front of a single worker thread.

A SpecSampler holds one KV cache and is not thread-safe, so generations run one
at a time on one thread. At most `max_queue` requests are admitted (running or
waiting); more are refused at once instead of being left to time out. The
worker hands each chunk to its request's asyncio queue through
`call_soon_threadsafe` and checks the request's cancel flag between engine
steps, so a client that goes away stops its generation within one step and
frees its place; a request that has not started yet is dropped from the queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from typing import Protocol

from jinja2 import TemplateError

from specsample.api import Chunk, Completion, Prompt, SpecSampler
from specsample.policy import KPolicy
from specsample.server.metrics import ServerMetrics

log = logging.getLogger("specsample.server")


class QueueFull(Exception):
    """Every place in the queue is taken."""


class InvalidRequest(Exception):
    """The engine refused the request (a prompt too long for the context window, ...)."""


class Events(Protocol):
    """A request's events as the routes read them (`Job`, or a replica's stream in `ray_app`)."""

    async def next_event(self) -> Chunk | Completion: ...

    def cancel(self) -> None: ...


class Worker(Protocol):
    """What the routes need of whatever runs the generations (`EngineWorker`, or `ray_app`'s replicas)."""

    def submit(self, prompt: Prompt, chat: bool, options: dict, endpoint: str) -> Events: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Job:
    """One request as the worker runs it; its events go to the event loop that submitted it."""

    prompt: Prompt
    chat: bool
    options: dict  # keyword arguments of SpecSampler.stream; max_new_tokens None: the server's default
    endpoint: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=perf_counter)
    run: Future | None = None  # the worker thread's run of it, where it has one (`EngineWorker`)

    def emit(self, event: Chunk | Completion | Exception) -> None:
        """Called on the worker thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        """Stop the job: a waiting one never runs (its place is free at once), a running one stops
        between two engine steps."""
        self.cancelled.set()
        if self.run is not None:
            self.run.cancel()  # only while it waits: a running future cannot be cancelled

    async def next_event(self) -> Chunk | Completion:
        """The next chunk, or the completion that ends the generation; raises what the engine raised."""
        event = await self.events.get()
        if isinstance(event, Exception):
            raise event
        return event


class EngineWorker:
    def __init__(
        self,
        sampler: SpecSampler,
        metrics: ServerMetrics,
        *,
        max_queue: int,
        k: int | KPolicy | None,
        default_max_tokens: int,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.sampler, self.metrics = sampler, metrics
        self.max_queue, self.k, self.default_max_tokens = max_queue, k, default_max_tokens
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specsample-engine")
        self.jobs: set[Job] = set()  # admitted: running or waiting

    def submit(self, prompt: Prompt, chat: bool, options: dict, endpoint: str) -> Job:
        """Admit a request (on the event loop) or raise QueueFull."""
        if len(self.jobs) >= self.max_queue:
            self.metrics.requests.labels(endpoint, "rejected").inc()
            raise QueueFull(f"the server is busy: all {self.max_queue} places in its queue are taken; retry later")
        loop = asyncio.get_running_loop()
        job = Job(prompt, chat, options, endpoint, loop)
        self.jobs.add(job)
        self.metrics.queue_depth.set(len(self.jobs))
        job.run = self.executor.submit(self._run, job)
        asyncio.wrap_future(job.run, loop=loop).add_done_callback(lambda _: self._release(job))
        return job

    def close(self) -> None:
        """Stop every generation and let the worker thread end."""
        for job in self.jobs:
            job.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _release(self, job: Job) -> None:
        """On the event loop, once the job has run, or was cancelled while it waited (then counted here)."""
        if job.run is not None and job.run.cancelled():
            self.metrics.requests.labels(job.endpoint, "cancelled").inc()
        self.jobs.discard(job)
        self.metrics.queue_depth.set(len(self.jobs))

    def _run(self, job: Job) -> None:
        """Run one job on the worker thread and count its outcome."""
        outcome = "cancelled"
        try:
            if not job.cancelled.is_set():
                self.metrics.queue_seconds.observe(perf_counter() - job.arrived)
                outcome = self._generate(job)
        except (ValueError, TemplateError) as error:
            outcome = "invalid"
            job.emit(InvalidRequest(str(error)))
        except Exception as error:
            log.exception("generation failed")
            outcome = "error"
            job.emit(error)
        self.metrics.requests.labels(job.endpoint, outcome).inc()

    def _generate(self, job: Job) -> str:
        options = dict(job.options)
        if options["max_new_tokens"] is None:
            options["max_new_tokens"] = self._default_max_tokens(job)
        # a long prompt's prefill asks the flag too, every engine.PREFILL_PART positions
        generation = self.sampler.stream(job.prompt, chat=job.chat, k=self.k, cancelled=job.cancelled.is_set, **options)
        first = True
        for chunk in generation:
            if job.cancelled.is_set():
                generation.chunks.close()  # stops the engine between two steps
                return "cancelled"
            if first:
                self.metrics.first_token_seconds.observe(perf_counter() - job.arrived)
                first = False
            job.emit(chunk)
        if job.cancelled.is_set():  # during the prefill, or after the last step
            return "cancelled"
        completion = generation.result()
        self.metrics.finished(completion.stats)
        self.metrics.request_seconds.observe(perf_counter() - job.arrived)
        job.emit(completion)
        return "completed"

    def _default_max_tokens(self, job: Job) -> int:
        prompt_tokens = len(self.sampler.encode(job.prompt, job.chat))
        return default_max_tokens(self.default_max_tokens, prompt_tokens, self.sampler.target.max_length)


def default_max_tokens(default: int, prompt_tokens: int, max_length: int) -> int:
    """The server's default number of new tokens, cut to what the context window leaves after the prompt;
    ValueError when it leaves none (the client gave no max_tokens, so the message names none)."""
    if prompt_tokens >= max_length:
        raise ValueError(f"the prompt ({prompt_tokens} tokens) leaves no room for new tokens in the context window "
                         f"of {max_length} tokens")
    return min(default, max_length - prompt_tokens)
