"""The suffix drafter's tree in C++ against the Python one: microseconds a token counted, and per request evicted.

Every packaged Spec-Bench prompt (`--split`, first turn, chat template of the bundled model) is counted
in turn into one tree of `--depth`, as the `suffix` drafter counts a request, the oldest requests
evicted beyond `--history` tokens; both trees, `--rounds` times, alternating.

    python benchmarks/suffix_tree.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from specsample.drafters import suffix
from specsample.models.loading import load_model
from specsample.prompts import packaged_prompts, read_prompts
from specsample.text import encode_prompt


def run(tree, requests: list[list[int]], history_tokens: int) -> tuple[float, float]:
    """Seconds a token counted and seconds a request evicted."""
    history: list[list[int]] = []
    counting = evicting = 0.0
    evicted = 0
    for request in requests:
        start = time.perf_counter()
        tree.extend([], request)
        counting += time.perf_counter() - start
        history.append(request)
        while sum(map(len, history)) > history_tokens:
            start = time.perf_counter()
            tree.remove(history.pop(0))
            evicting += time.perf_counter() - start
            evicted += 1
    return counting / sum(map(len, requests)), evicting / max(evicted, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="odd")
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--history", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_model(None, tokenizer_only=True).tokenizer
    requests = [encode_prompt(tokenizer, p.turns[0]) for p in read_prompts(packaged_prompts(), split=args.split)]
    library = suffix.native_library()
    if library is None:
        raise SystemExit("the C++ suffix tree did not build")
    trees = {"python": lambda: suffix.SuffixTree(args.depth), "c++": lambda: suffix.NativeSuffixTree(args.depth, library)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, make in trees.items():
            results[name].append(run(make(), requests, args.history))
    print(f"{len(requests)} prompts, {sum(map(len, requests))} tokens, depth {args.depth}, history {args.history}")
    for name, rows in results.items():
        token = statistics.median(r[0] for r in rows)
        request = statistics.median(r[1] for r in rows)
        print(f"{name:7s} {1e6 * token:6.2f} us a token counted, {1e3 * request:6.2f} ms a request evicted (median of {args.rounds})")


if __name__ == "__main__":
    main()
