"""Does prefix affinity pay? Two replicas with Ray Serve's power of two choices against two with its
prefix-aware router (`--prefix-affinity`), under the same load, on one local Ray cluster.

The load is the case the suffix drafter learns from: each group is one Spec-Bench prompt asked `--repeats`
times with a different closing line ("Request 1 of 3", ...), greedy. A round sends the groups in waves:
wave r sends request r of every group at once (`--groups` concurrent requests, more than the replicas),
so where a group's later requests go is decided by the router, not by a client that keeps to an idle
replica. Those later requests draft well only on a replica whose suffix tree holds the group's first
answer: with affinity, the replica that served it; with power of two choices, whichever is less loaded.
Both applications get the same groups in the same order, rounds alternating between them, and every round
uses groups neither has seen (the replicas' suffix trees keep earlier requests). Printed per application:
mean accepted length (accepted tokens per step, from each response's `speculative` block) of the later
requests and of the first ones, and generated tokens per wall second of its rounds.

    python benchmarks/ray_prefix_affinity.py --groups 4 --repeats 3 --rounds 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import logging
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


def run_round(url: str, groups: list[str], repeats: int, max_tokens: int) -> tuple[float, list[list[dict]]]:
    """Wall seconds and each wave's statistics (wave r: request r of every group, all at once)."""
    start, waves = time.perf_counter(), []
    with ThreadPoolExecutor(len(groups)) as pool:
        for r in range(repeats):
            closing = f"\n\n(Request {r + 1} of {repeats}.)"
            waves.append(list(pool.map(lambda prompt: ask(url, prompt + closing, max_tokens), groups)))
    return time.perf_counter() - start, waves


def accepted_per_step(stats: list[dict]) -> float:
    return sum(s["accepted_tokens"] for s in stats) / sum(s["steps"] for s in stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4, help="prompt groups per round (concurrent requests)")
    parser.add_argument("--repeats", type=int, default=3, help="requests per group")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--backend", default="llamacpp")
    parser.add_argument("--k", default="3")
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
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
            records[name].append(run_round(url, groups, args.repeats, args.max_tokens))
    rows = []
    for name, rounds in records.items():
        seconds = sum(r[0] for r in rounds)
        firsts = [s for _, waves in rounds for s in waves[0]]
        repeats = [s for _, waves in rounds for wave in waves[1:] for s in wave]
        rows.append({"router": name, "requests": len(firsts + repeats),
                     "repeats_accepted_per_step": accepted_per_step(repeats),
                     "firsts_accepted_per_step": accepted_per_step(firsts),
                     "tokens_per_second": sum(s["completion_tokens"] for s in firsts + repeats) / seconds})
        print(f"{name:9s}: later requests {rows[-1]['repeats_accepted_per_step']:.2f} accepted tokens per step "
              f"(first of each group {rows[-1]['firsts_accepted_per_step']:.2f}), "
              f"{rows[-1]['tokens_per_second']:.1f} tokens/s aggregate over {rows[-1]['requests']} requests")
    serve.shutdown()
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"command": " ".join(sys.argv), "machine": platform.platform(), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
