"""The client-count curve of the server: one at a time against continuous batching, with and without
speculation, for 1, 2, 4, 8 and 16 concurrent streaming clients.

Each configuration is a `specsample serve` process on loopback (the bundled model unless `--model`,
`--backend`, `--drafter`): `--max-batch 1` (one generation at a time, the server before batching) and
`--max-batch M`, each with `--k auto` (speculation) and `--k 0` (none), and batch servers at the fixed K
of `--batch-k`. Every server is started first; then, for each client count in turn, each server gets the
same run, so configurations are interleaved in time on a shared machine. A run is C clients streaming C x
`--requests` greedy requests through the official `openai` client, each client taking the next prompt of
the run's shared queue when its previous answer ends (a fixed concurrency of C): never-tuned Spec-Bench
prompts (odd question_ids past the first TUNED_PER_CATEGORY of each category; with `--tuned` those first
ones, which the policies are developed on; first turn), `--max-tokens` each; each run starts on prompts
no earlier run used (the suffix drafter learns the answers it served). It prints per configuration and
client count: aggregate generated tokens per wall second, the median per-request tokens per second (its
tokens over its time from arrival to last token), time to first token (median, p95), the mean requests
per batch step and rows per step from the server's /metrics, the seconds its prompts' prefills took
(/metrics; the same work one at a time and batched, so at C clients a batch delivers at most the
one-at-a-time server's wall time over them), and how many responses differ from the same prompt served to
one client by the one-at-a-time server with speculation (greedy: must be 0). `--out` writes the rows as
JSON.

One client is measured otherwise: the four servers take turns request by request (the order rotating),
each serving the same `--single-requests` prompts in the same order, so that the drift of a shared VM
(a server idle while the others ran answers up to 2x slower, BENCHMARKS.md) falls on all of them alike;
each batch server's ratio to the one-at-a-time server of the same K comes with a 95% paired bootstrap
interval over the prompts (`bench.report.speedup_interval`).

    python benchmarks/batch_clients.py --clients 1,2,4,8,16 --max-batch 16 --requests 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from queue import Empty, SimpleQueue

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from specsample.bench.report import speedup_interval
from specsample.prompts import TUNED_PER_CATEGORY, packaged_prompts, read_prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, max_batch: int, k: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "specsample.cli", "serve", "--port", str(port), "--max-batch", str(max_batch),
               "--k", k, "--max-queue", "64", "--backend", args.backend, "--drafter", args.drafter]
    if args.model:
        command += ["--model", args.model]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server {' '.join(command)} did not start")
        time.sleep(0.5)


def one_request(client: openai.OpenAI, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, text, tokens = None, "", 0
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"prompt": prompt, "text": text, "tokens": tokens, "ttft": (first or end) - start, "seconds": end - start}


def batch_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(("specsample_batch_size_", "specsample_rows_per_step_", "specsample_prefill_seconds"))
            and not s.labels}


def client_of(url: str) -> openai.OpenAI:
    """An OpenAI client of a server, warmed by one untimed short request: on a shared 2-core VM a server
    that sat idle while the others ran answers its next request up to 2x slower than one that has just
    answered (BENCHMARKS.md), which would fall on the first timed request of each configuration."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1200)
    one_request(client, "Say hello.", 8)
    return client


def run_clients(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads streaming `clients * requests` prompts: each takes the next prompt of a shared
    queue as soon as its previous answer ended, so that all of them stay busy until the queue is empty
    (with a fixed share each, the client holding the longest answers would run alone at the end: 4 of
    8 requests a step on average where 8 were possible); the run's figures."""
    client = client_of(url)
    queue = SimpleQueue()
    for i in range(clients * requests):
        queue.put(prompts[i % len(prompts)])

    def serve_queue() -> list[dict]:
        mine = []
        with suppress(Empty):
            while True:
                mine.append(one_request(client, queue.get_nowait(), max_tokens))
        return mine

    before = batch_metrics(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [pool.submit(serve_queue) for _ in range(clients)]
        results = [r for per_client in done for r in per_client.result()]
    wall = time.perf_counter() - start
    return summary(results, clients, wall, before, batch_metrics(url))


def run_turns(urls: dict[str, str], prompts: list[str], requests: int, max_tokens: int) -> dict[str, dict]:
    """One client: the servers take turns request by request, the order rotating, each serving the same
    `requests` prompts in the same order; each server's figures, over the time of its own requests."""
    clients = {name: client_of(url) for name, url in urls.items()}
    before = {name: batch_metrics(url) for name, url in urls.items()}
    results: dict[str, list[dict]] = {name: [] for name in urls}
    names = list(urls)
    for i in range(requests):
        for name in names[i % len(names):] + names[: i % len(names)]:
            results[name].append(one_request(clients[name], prompts[i % len(prompts)], max_tokens))
    return {name: summary(results[name], 1, sum(r["seconds"] for r in results[name]), before[name], batch_metrics(url))
            for name, url in urls.items()}


def paired_interval(mine: list[dict], reference: list[dict]) -> list[float] | None:
    """The 95% paired bootstrap interval of the tokens/s ratio of two servers over the same prompts in order."""
    records = [{"question_id": i, "turn": 0, "config": config, "generated_tokens": r["tokens"], "wall_seconds": r["seconds"]}
               for config, results in (("mine", mine), ("reference", reference)) for i, r in enumerate(results)]
    return speedup_interval(records, "mine", "reference")


def summary(results: list[dict], clients: int, wall: float, before: dict, after: dict) -> dict:
    """A run's figures from its requests' results and the server's /metrics before and after it."""
    steps = after.get("specsample_batch_size_count", 0) - before.get("specsample_batch_size_count", 0)
    ttft = sorted(r["ttft"] for r in results)
    return {
        "clients": clients, "requests": len(results), "tokens": sum(r["tokens"] for r in results), "wall_seconds": wall,
        "aggregate_tokens_per_second": sum(r["tokens"] for r in results) / wall,
        "median_request_tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in results),
        "ttft_median": statistics.median(ttft), "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "mean_batch_size": (after.get("specsample_batch_size_sum", 0) - before.get("specsample_batch_size_sum", 0)) / steps
        if steps else 1.0,
        "mean_rows_per_step": (after.get("specsample_rows_per_step_sum", 0) - before.get("specsample_rows_per_step_sum", 0))
        / steps if steps else None,
        "prefill_seconds": after.get("specsample_prefill_seconds_total", 0) - before.get("specsample_prefill_seconds_total", 0),
        "texts": {r["prompt"]: r["text"] for r in results},
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="requests per client and run (2 or more clients)")
    parser.add_argument("--single-requests", type=int, default=16, help="requests of the one-client run, per server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--batch-k", default="", help="more batch servers at these fixed K, comma-separated "
                        "(against the one-at-a-time server with --k auto)")
    parser.add_argument("--tuned", action="store_true", help="the prompts the drafters and K policies are developed "
                        "on (the first TUNED_PER_CATEGORY of each category) instead of the never-tuned ones")
    parser.add_argument("--out")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    chosen = dict(limit=TUNED_PER_CATEGORY) if args.tuned else dict(split="odd", skip=TUNED_PER_CATEGORY)
    prompts = [p.turns[0] for p in read_prompts(packaged_prompts(), **chosen)]
    configs = {"one-at-a-time k=auto": (1, "auto"), "one-at-a-time k=0": (1, "0"),
               f"batch {args.max_batch} k=auto": (args.max_batch, "auto"), f"batch {args.max_batch} k=0": (args.max_batch, "0")}
    configs |= {f"batch {args.max_batch} k={k}": (args.max_batch, k) for k in filter(None, args.batch_k.split(","))}
    servers = {name: start_server(args, *config) for name, config in configs.items()}
    rows, reference = [], {}
    alone = "one-at-a-time k=auto"
    used = 0  # prompts taken by the runs so far: each run starts on new ones, which no drafter has seen
    try:
        for clients in counts:
            fresh = prompts[used:] + prompts[:used]
            if clients == 1:
                run = run_turns({name: url for name, (_, url) in servers.items()}, fresh, args.single_requests, args.max_tokens)
                reference.update(run[alone]["texts"])
            else:
                run = {name: run_clients(url, fresh, clients, args.requests, args.max_tokens) for name, (_, url) in servers.items()}
            used = (used + (args.single_requests if clients == 1 else clients * args.requests)) % len(prompts)
            for name, row in run.items():
                missing = [p for p in row["texts"] if p not in reference]
                for prompt in missing:  # the reference: this prompt served alone
                    reference[prompt] = run_clients(servers[alone][1], [prompt], 1, 1, args.max_tokens)["texts"][prompt]
                row["differing"] = sum(text != reference[p] for p, text in row["texts"].items())
                row["config"] = name
                one_name = f"one-at-a-time k={name.rsplit('=', 1)[1]}"
                one_name = one_name if one_name in run else alone
                row["x_one_at_a_time"] = row["aggregate_tokens_per_second"] / run[one_name]["aggregate_tokens_per_second"]
                row["x_interval"] = paired_interval(row["results"], run[one_name]["results"]) if clients == 1 else None
                rows.append(row)
                interval = "" if row["x_interval"] is None else " ({:.2f}-{:.2f})".format(*row["x_interval"])
                print(f"{name:24s} clients {clients:2d}: {row['aggregate_tokens_per_second']:7.1f} tok/s aggregate "
                      f"({row['x_one_at_a_time']:.2f}x one at a time{interval}), "
                      f"{row['median_request_tokens_per_second']:6.1f} median per request, TTFT "
                      f"{row['ttft_median']:.2f}/{row['ttft_p95']:.2f} s (median/p95), batch {row['mean_batch_size']:.1f}, "
                      f"rows/step {row['mean_rows_per_step'] or 0:.1f}, prefill {row['prefill_seconds']:.2f} s of "
                      f"{row['wall_seconds']:.2f}, differing {row['differing']}", flush=True)
            for row in run.values():
                del row["texts"], row["results"]
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    if args.out:
        machine = {"cpu": platform.processor(), "cores": os.cpu_count(), "command": " ".join(sys.argv)}
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
