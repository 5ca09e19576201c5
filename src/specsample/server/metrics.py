"""Prometheus metrics of the server: requests, tokens, acceptance, latency.

Each app has its own registry, so several servers (tests) live in one process.
Token counts and the acceptance gauges cover generations that ran to their end;
a generation cut short by a disconnecting client counts only as a cancelled
request.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specsample.stats import Stats

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.totals = Stats()  # all finished generations together
        self.lock = threading.Lock()
        self.requests = Counter(
            "specsample_requests", "Generation requests by endpoint and outcome "
            "(completed, cancelled, invalid, rejected, error).", ["endpoint", "outcome"], registry=registry)
        self.prompt_tokens = Counter("specsample_prompt_tokens", "Prompt tokens.", registry=registry)
        self.generated_tokens = Counter("specsample_generated_tokens", "Generated tokens.", registry=registry)
        self.drafted_tokens = Counter("specsample_drafted_tokens", "Draft tokens verified (those a K policy cut unverified left out).", registry=registry)
        self.accepted_tokens = Counter("specsample_accepted_tokens", "Draft tokens accepted.", registry=registry)
        self.steps = Counter("specsample_verification_steps", "Verification steps.", registry=registry)
        self.prefill_seconds = Counter("specsample_prefill_seconds", "Seconds spent prefilling prompts.", registry=registry)
        Gauge("specsample_acceptance_rate", "Accepted / drafted tokens.",
              registry=registry).set_function(lambda: self.totals.acceptance_rate)
        Gauge("specsample_mean_accepted_length", "Tokens per verification step.",
              registry=registry).set_function(lambda: self.totals.mean_accepted_length)
        self.queue_depth = Gauge("specsample_queue_depth", "Requests admitted: running or waiting.", registry=registry)
        self.request_seconds = self._latency("specsample_request_duration_seconds", "From arrival to the last token.")
        self.queue_seconds = self._latency("specsample_queue_wait_seconds", "From arrival to the start of generation.")
        self.first_token_seconds = self._latency("specsample_time_to_first_token_seconds",
                                                 "From arrival to the first chunk.")
        # continuous batching (--max-batch above 1): per step of the batch
        self.batch_size = Histogram("specsample_batch_size", "Requests in a step of the batch.",
                                    buckets=BATCH_BUCKETS, registry=registry)
        self.rows_per_step = Histogram("specsample_rows_per_step", "Rows (positions) scored in a step of the batch.",
                                       buckets=BATCH_BUCKETS, registry=registry)

    def _latency(self, name: str, help: str) -> Histogram:
        return Histogram(name, help, buckets=LATENCY_BUCKETS, registry=self.registry)

    def finished(self, stats: Stats) -> None:
        """Add a finished generation's tokens to the counters and the running totals."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.steps.inc(stats.steps)
        self.prefill_seconds.inc(stats.prefill_seconds)
        with self.lock:
            self.totals.steps += stats.steps
            self.totals.drafted_tokens += stats.drafted_tokens
            self.totals.accepted_tokens += stats.accepted_tokens
            self.totals.generated_tokens += stats.generated_tokens

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
