"""Does prefix affinity pay? Two replicas with Ray Serve's power of two choices against two with its
prefix-aware router (`--prefix-affinity`), under the same load, on one local Ray cluster.

The load is the case the suffix drafter learns from: each group is one Spec-Bench prompt asked `--repeats`
times with a different closing line ("Request 1 of 3", ...), greedy, by one client, one request after the
other; `--clients` clients run groups at the same time. Its later requests draft well only on a replica
whose suffix tree holds the first answer: with affinity, the replica that served it; without, either.
Both applications get the same groups in the same order, rounds alternating between them, and every round
uses groups neither has seen (the replicas' suffix trees keep earlier requests). Printed per application:
mean accepted length (accepted tokens per step, over the repeats, from each response's `speculative`
block), and generated tokens per wall second of its rounds.

    python benchmarks/ray_prefix_affinity.py --groups 4 --repeats 3 --clients 2 --rounds 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray
from ray import serve

from specsample.prompts import packaged_prompts, read_prompts
from specsample.server.ray_app import RayOptions, build_app

PORT = 8797


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    """One greedy chat completion's `usage` and `speculative` blocks."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    return {**reply.json()["usage"], **reply.json()["speculative"]}


def run_round(url: str, groups: list[str], repeats: int, clients: int,
              max_tokens: int) -> tuple[float, list[dict], list[dict]]:
    """Wall seconds, the repeats' statistics, and those of the first of each group (which nothing has seen)."""

    def one_group(prompt: str) -> list[dict]:
        return [ask(url, f"{prompt}\n\n(Request {r + 1} of {repeats}.)", max_tokens) for r in range(repeats)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one_group, groups))
    return time.perf_counter() - start, [stats for group in results for stats in group[1:]], [g[0] for g in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4, help="prompt groups per round")
    parser.add_argument("--repeats", type=int, default=3, help="requests per group")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--backend", default="llamacpp")
    parser.add_argument("--k", default="3")
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    prompts = [p.turns[0] for p in read_prompts(packaged_prompts())]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # 2 x 2 replicas of one thread
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    urls = {}
    for affinity in (False, True):
        name = "affinity" if affinity else "p2c"
        options = RayOptions(replicas=2, threads=1, backend=args.backend, drafter="suffix", k=args.k,
                             prefix_affinity=affinity, name=name)
        serve.run(build_app(options), name=name, route_prefix=f"/{name}")
        urls[name] = f"http://127.0.0.1:{PORT}/{name}"
    records = {name: [] for name in urls}
    for r in range(args.rounds):
        groups = prompts[r * args.groups:(r + 1) * args.groups]
        for name, url in urls.items():
            records[name].append(run_round(url, groups, args.repeats, args.clients, args.max_tokens))
    rows = []
    for name, rounds in records.items():
        seconds = sum(r[0] for r in rounds)
        repeats = [s for r in rounds for s in r[1]]
        firsts = [s for r in rounds for s in r[2]]
        everything = repeats + firsts
        rows.append({
            "router": name, "requests": len(everything),
            "repeats_mean_accepted_length": sum(s["accepted_tokens"] for s in repeats) / sum(s["steps"] for s in repeats),
            "firsts_mean_accepted_length": sum(s["accepted_tokens"] for s in firsts) / sum(s["steps"] for s in firsts),
            "tokens_per_second": sum(s["completion_tokens"] for s in everything) / seconds,
        })
        print(f"{name:9s}: repeats {rows[-1]['repeats_mean_accepted_length']:.2f} accepted tokens per step "
              f"(first of each group {rows[-1]['firsts_mean_accepted_length']:.2f}), "
              f"{rows[-1]['tokens_per_second']:.1f} tokens/s aggregate over {len(everything)} requests")
    serve.shutdown()
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"command": " ".join(sys.argv), "machine": platform.platform(), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
