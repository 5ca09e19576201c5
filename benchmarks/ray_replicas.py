"""Replicas against threads on one machine: N replicas of T threads each behind one Ray Serve endpoint,
compared with other (replicas, threads) layouts under the same load of concurrent streaming clients.

Every layout runs as its own application on one local Ray cluster (`--layouts 2x1,1x2`: replicas x
threads; the cluster's logical CPUs cover all of them, and only the application under load computes),
and the rounds alternate between the layouts, so a shared machine's load moves them alike. A round:
`--clients` threads each send `--requests` streaming chat completions (greedy, `--max-tokens`, the first
turns of the packaged Spec-Bench prompts, the same ones for every layout) with the official `openai`
client. Printed per layout, pooled over its rounds: aggregate generated tokens per wall second of the
rounds, and time to first token (median and 90th percentile), measured at the client.

`--overhead N`: what the router costs per request. One client sends N one-token completions, one at a
time, alternately to the first layout (an idle replica answers each) and to `specsample serve`'s app
(uvicorn in this process, the same model on one thread); the difference of the medians is the cost of
Ray's proxy, the gateway and the handle call.

    python benchmarks/ray_replicas.py --layouts 2x1,1x2 --clients 8 --requests 2 --rounds 3 --backend llamacpp
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import ray
from ray import serve

from specsample.policy import parse_k
from specsample.prompts import packaged_prompts, read_prompts
from specsample.server.ray_app import RayOptions, build_app

PORT = 8799


def layouts(text: str) -> list[tuple[int, int]]:
    """"2x1,1x2" as [(2, 1), (1, 2)]: (replicas, threads)."""
    return [tuple(int(n) for n in part.split("x")) for part in text.split(",")]


def one_request(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[float, int]:
    """Seconds to the first content and the completion's generated tokens."""
    start, first, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first if first is not None else time.perf_counter() - start, tokens


def run_round(url: str, prompts: list[str], clients: int, requests: int,
              max_tokens: int) -> tuple[float, int, list[float]]:
    """Wall seconds, generated tokens and the times to first token of one round."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

    def one_client(c: int) -> list[tuple[float, int]]:
        return [one_request(client, prompts[(c * requests + r) % len(prompts)], max_tokens) for r in range(requests)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [result for per_client in pool.map(one_client, range(clients)) for result in per_client]
    return time.perf_counter() - start, sum(t for _, t in results), [f for f, _ in results]


def overhead(ray_url: str, args: argparse.Namespace) -> dict:
    """Median seconds of a one-token completion through Ray Serve and straight to the app, interleaved."""
    import threading

    import uvicorn

    from specsample.api import SpecSampler
    from specsample.server import create_app

    sampler = SpecSampler.load(None, args.drafter, backend=args.backend, threads=1)
    server = uvicorn.Server(uvicorn.Config(create_app(sampler, k=args.k and parse_k(args.k)), host="127.0.0.1",
                                           port=PORT + 1, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    clients = {name: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
               for name, url in (("ray", ray_url), ("direct", f"http://127.0.0.1:{PORT + 1}"))}
    seconds = {name: [] for name in clients}
    for i in range(args.overhead + 1):
        for name, client in clients.items():
            start = time.perf_counter()
            client.completions.create(model="any", prompt="The capital of France is", max_tokens=1, temperature=0)
            if i:  # the first of each warms up
                seconds[name].append(time.perf_counter() - start)
    server.should_exit = True
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"one-token request, median of {args.overhead}: through Ray Serve {medians['ray'] * 1e3:.1f} ms, "
          f"straight to the app {medians['direct'] * 1e3:.1f} ms: the router costs "
          f"{(medians['ray'] - medians['direct']) * 1e3:.1f} ms per request")
    return {"overhead_requests": args.overhead, "ray_median_s": medians["ray"], "direct_median_s": medians["direct"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x1,1x2")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--backend", default="llamacpp")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--k", default=None)
    parser.add_argument("--overhead", type=int, default=0, help="one-token requests to time the router with")
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    shapes = layouts(args.layouts)
    prompts = [p.turns[0] for p in read_prompts(packaged_prompts(), limit=2)][: args.clients * args.requests]
    ray.init(num_cpus=sum(r * t for r, t in shapes), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    urls = {}
    for replicas, threads in shapes:
        name = f"r{replicas}t{threads}"
        options = RayOptions(replicas=replicas, threads=threads, backend=args.backend, drafter=args.drafter, k=args.k,
                             max_queue=args.clients * args.requests, name=name)
        serve.run(build_app(options), name=name, route_prefix=f"/{name}")
        urls[(replicas, threads)] = f"http://127.0.0.1:{PORT}/{name}"
    for url in urls.values():  # warm-up: first requests pay for lazy set-up
        run_round(url, prompts, args.clients, 1, 8)
    records = {shape: [] for shape in shapes}
    for _ in range(args.rounds):
        for shape in shapes:
            records[shape].append(run_round(urls[shape], prompts, args.clients, args.requests, args.max_tokens))
    rows = []
    for (replicas, threads), rounds in records.items():
        seconds, tokens = sum(r[0] for r in rounds), sum(r[1] for r in rounds)
        ttft = sorted(f for r in rounds for f in r[2])
        rows.append({"replicas": replicas, "threads": threads, "tokens_per_second": tokens / seconds,
                     "ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
                     "requests": len(ttft), "generated_tokens": tokens})
        print(f"{replicas} replica(s) x {threads} thread(s): {tokens / seconds:6.1f} tokens/s aggregate, "
              f"TTFT median {rows[-1]['ttft_median_s']:.2f} s, p90 {rows[-1]['ttft_p90_s']:.2f} s "
              f"({len(ttft)} requests, {tokens} tokens)")
    if args.overhead:
        rows.append(overhead(urls[shapes[0]], args))
    serve.shutdown()
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"command": " ".join(sys.argv), "machine": platform.platform(),
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
