"""Continuous batching: the server's requests decoded together, one target pass per step.

`BatchWorker` stands where `worker.EngineWorker` does (same `submit`, `close`, `jobs`, same `Job`s,
queue bound and errors) when the server runs with `--max-batch N` above 1. One thread runs a
`batch.Batch` of N slots: between two steps it admits waiting requests into free slots (their
prefill, PREFILL_CHUNK positions of a long prompt before each step) and drops the requests whose
client went away, then runs one step over every running request and hands each request's new text
to its own client. Each request ends on its own: an EOS
token or max_tokens (the batch), a stop string (its `TextOutput`), or its client leaving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass
from time import perf_counter

from jinja2 import TemplateError

from specsample.api import Prompt, SpecSampler, TextOutput
from specsample.batch import Request
from specsample.openmp import in_passing_thread
from specsample.server.metrics import ServerMetrics
from specsample.server.worker import InvalidRequest, Job, QueueFull, default_max_tokens

log = logging.getLogger("specsample.server")
# A long prompt prefills this many positions before each step of the running requests, which stall for that
# long (about 0.5 s after 3,700 positions, the bundled model on 2 cores: BENCHMARKS.md) rather than for its
# whole prefill (chunked prefill, `batch.Batch`).
PREFILL_CHUNK = 256


@dataclass(eq=False)
class Running:
    """A job in the batch: its request and the text its client has been sent."""

    job: Job
    request: Request
    output: TextOutput
    started: bool = False  # its first chunk was sent


class BatchWorker:
    def __init__(
        self,
        sampler: SpecSampler,
        metrics: ServerMetrics,
        *,
        max_queue: int,
        max_batch: int,
        k: int | str | None,
        default_max_tokens: int,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.sampler, self.metrics = sampler, metrics
        self.max_queue, self.default_max_tokens = max_queue, default_max_tokens
        # its slots are made on a passing thread: the batch thread then holds the only OpenMP team (openmp.py)
        self.batch = in_passing_thread(sampler.batch, max_batch, k, PREFILL_CHUNK)
        self.jobs: set[Job] = set()  # admitted: running or waiting
        self.waiting: deque[Job] = deque()
        self.running: dict[Request, Running] = {}
        self.wake = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="specsample-batch", daemon=True)
        self.thread.start()

    def submit(self, prompt: Prompt, chat: bool, options: dict, endpoint: str) -> Job:
        """Admit a request (on the event loop) or raise QueueFull."""
        with self.wake:
            if len(self.jobs) >= self.max_queue:
                self.metrics.requests.labels(endpoint, "rejected").inc()
                raise QueueFull(f"the server is busy: all {self.max_queue} places in its queue are taken; retry later")
            job = Job(prompt, chat, options, endpoint, asyncio.get_running_loop())
            self.jobs.add(job)
            self.waiting.append(job)
            self.metrics.queue_depth.set(len(self.jobs))
            self.wake.notify()
        return job

    def close(self) -> None:
        """Stop every generation and let the batch thread end."""
        with self.wake:
            self.closed = True
            for job in self.jobs:
                job.cancel()
            self.wake.notify()

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.closed and not self.waiting and not self.running:
                    self.wake.wait()
                if self.closed:
                    return
            try:
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._step()
            except Exception as error:  # past one request's own failure: the running ones fail, the loop goes on
                log.exception("the batch loop failed")
                for running in list(self.running.values()):
                    running.job.emit(error)
                    self._leave(running, "error")

    def _admit(self) -> None:
        """Start waiting requests in free slots, oldest first."""
        while not self.batch.full:
            with self.wake:
                if not self.waiting:
                    return
                job = self.waiting.popleft()
            if job.cancelled.is_set():
                self._end(job, "cancelled")
                continue
            self.metrics.queue_seconds.observe(perf_counter() - job.arrived)
            try:
                request = self._request(job)
                self.batch.add(request)
            except (ValueError, TemplateError) as error:
                job.emit(InvalidRequest(str(error)))
                self._end(job, "invalid")
                continue
            except Exception as error:  # this request fails, the batch goes on
                log.exception("admitting a request failed")
                job.emit(error)
                self._end(job, "error")
                continue
            model = self.sampler.model
            output = TextOutput(model.tokenizer, job.options["stop"], model.eos_token_ids)
            self.running[request] = Running(job, request, output)

    def _request(self, job: Job) -> Request:
        options = dict(job.options)
        options.pop("stop")
        given = options.pop("max_new_tokens")
        request = self.sampler.request(job.prompt, chat=job.chat, max_new_tokens=1 if given is None else given, **options)
        if given is None:
            request.max_new_tokens = default_max_tokens(self.default_max_tokens, request.prompt_ids.shape[0],
                                                        self.batch.slots.max_length)
        return request

    def _drop_cancelled(self) -> None:
        """Requests whose client went away leave the batch, freeing their slots, or the queue."""
        for running in list(self.running.values()):
            if running.job.cancelled.is_set():
                self._leave(running, "cancelled")
        with self.wake:
            gone = [job for job in self.waiting if job.cancelled.is_set()]
            for job in gone:
                self.waiting.remove(job)
        for job in gone:
            self._end(job, "cancelled")

    def _step(self) -> None:
        """One step of every running request (after a chunk of a prompt still prefilling); each one's text
        goes to its client."""
        try:
            out = self.batch.step()
        except Exception as error:
            log.exception("batch step failed")
            for running in list(self.running.values()):
                running.job.emit(error)
                self._leave(running, "error")
            return
        if out:  # a step ran, not only a prefill chunk
            self.metrics.batch_size.observe(len(out))
            self.metrics.rows_per_step.observe(self.batch.rows)
        for request, new in out:
            running = self.running[request]
            chunk = running.output.feed(new)
            if not running.started:
                self.metrics.first_token_seconds.observe(perf_counter() - running.job.arrived)
                running.started = True
            running.job.emit(chunk)
            if request.done or running.output.stopped:
                self._finish(running)

    def _finish(self, running: Running) -> None:
        """A request that ended (EOS, max_tokens, a stop string): the rest of its text, its completion."""
        tail = running.output.finish()
        if tail.text:
            running.job.emit(tail)
        self.batch.remove(running.request)
        completion = running.output.completion(running.request.stats)
        self.metrics.finished(completion.stats)
        self.metrics.request_seconds.observe(perf_counter() - running.job.arrived)
        running.job.emit(completion)
        self._leave(running, "completed")

    def _leave(self, running: Running, outcome: str) -> None:
        self.batch.remove(running.request)
        del self.running[running.request]
        self._end(running.job, outcome)

    def _end(self, job: Job, outcome: str) -> None:
        self.metrics.requests.labels(job.endpoint, outcome).inc()
        with self.wake:
            self.jobs.discard(job)
            self.metrics.queue_depth.set(len(self.jobs))
