"""One configuration under two versions of the code, interleaved prompt by prompt: the working tree
against a git revision (default HEAD), for a change whose effect is smaller than the spread between
two `bench run`s minutes apart (the K policy, the drafters).

Each version runs in a process of its own that loads the model once and keeps its sampler, so its K
policy learns across prompts as a server's does: the revision from a `git worktree` of it, the working
tree from `src/`. The driver sends each prompt to one, then the other (the order flips every prompt),
with the same seed, and prints per prompt the ratio of wall times (the revision's over the working
tree's: above 1, the working tree is faster), then tokens per second of each, the ratio of the totals
with a 95% paired-bootstrap interval over the prompts, verification steps and how many answers
differ (none should: a seeded request gives the same text whatever the drafter and K).

Before each request the driver waits `--pause` seconds: a process's OpenMP threads spin for a while
after its last parallel region (GOMP_SPINCOUNT, `specsample.openmp`), and a request sent at once would
share the 2 cores with the other worker's spinning threads (per-prompt ratios from 0.77 to 1.50 for
one configuration against a revision that changed it by about 1%).

    python benchmarks/ab_revision.py [--revision HEAD] [--drafter suffix+quantized] [--backend fast]
        [--temperature 1] [--split all --limit 4] [--skip 0] [--max-new-tokens 128] [--pause 1]
        [--revision-isa avx2] [--isa avxvnni]

`--revision-isa` and `--isa` build each version's kernels for an instruction set
(SPECSAMPLE_KERNEL_ISA, models/kernels.py): with `--revision HEAD`, one configuration on two builds of the
same code (say `--revision-isa avx2 --isa avxvnni`).

Tune on `--split all` with `--limit` up to 6 (the first 6 of each category are the tuned prompts); the
held-out prompts are `--split odd --skip 6`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # the driver reads prompts and reports with the working tree's code

from specsample.bench.report import speedup_interval  # noqa: E402
from specsample.models.kernels import ISA_FLAGS, ISA_VARIABLE  # noqa: E402
from specsample.prompts import packaged_prompts, read_prompts  # noqa: E402

CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")
WORKER = """
import json, sys, time
from specsample import SpecSampler
options = json.loads(sys.argv[1])
sampler = SpecSampler.load(None, options["drafter"], backend=options["backend"])
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    start = time.perf_counter()
    out = sampler.generate(request["prompt"], max_new_tokens=options["max_new_tokens"],
                           temperature=options["temperature"], k=options["k"], seed=request["seed"])
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": out.token_ids, "steps": out.stats.steps}), flush=True)
"""


class Worker:
    """A process running one version of specsample (its `src` first on the path), one request a line."""

    def __init__(self, src: Path, options: dict, isa: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(src), **({ISA_VARIABLE: isa} if isa else {})}
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker for {src} did not start")

    def run(self, prompt: str, seed: int) -> dict:
        self.process.stdin.write(json.dumps({"prompt": prompt, "seed": seed}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def prompts(split: str, limit: int, skip: int) -> list:
    return [p for p in read_prompts(packaged_prompts(), split=split, limit=limit, skip=skip) if p.category in CATEGORIES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revision", default="HEAD")
    parser.add_argument("--drafter", default="suffix+quantized")
    parser.add_argument("--backend", default="fast")
    parser.add_argument("--k", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--split", default="all")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds before each request (other worker's threads idle)")
    parser.add_argument("--revision-isa", choices=list(ISA_FLAGS), help="the revision's kernels' instruction set")
    parser.add_argument("--isa", choices=list(ISA_FLAGS), help="the working tree's kernels' instruction set")
    args = parser.parse_args()
    options = {name: getattr(args, name) for name in ("drafter", "backend", "k", "temperature", "max_new_tokens")}
    selected = prompts(args.split, args.limit, args.skip)
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "revision"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.revision], check=True,
                       capture_output=True)
        try:
            workers = {"revision": Worker(tree / "src", options, args.revision_isa),
                       "working tree": Worker(ROOT / "src", options, args.isa)}
            results = compare(workers, selected, args.pause)
            for worker in workers.values():
                worker.close()
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    report(results, args)


def compare(workers: dict[str, Worker], selected: list, pause: float) -> list[dict[str, dict]]:
    """Each prompt's result from each worker, the order flipping every prompt, `pause` seconds before each."""
    results = []
    for i, prompt in enumerate(selected):
        names = list(workers) if i % 2 == 0 else list(reversed(workers))
        result = {}
        for name in names:
            time.sleep(pause)
            result[name] = workers[name].run(prompt.turns[0], seed=i)
        results.append(result)
        ratio = result["revision"]["seconds"] / result["working tree"]["seconds"]
        print(f"{prompt.category:15s} {ratio:.3f}", flush=True)
    return results


def report(results: list[dict[str, dict]], args: argparse.Namespace) -> None:
    records = [{"question_id": i, "turn": 0, "config": name, "generated_tokens": len(out["tokens"]),
                "wall_seconds": out["seconds"]} for i, result in enumerate(results) for name, out in result.items()]
    low, high = speedup_interval(records, "working tree", reference="revision")
    rates = {name: sum(len(r[name]["tokens"]) for r in results) / sum(r[name]["seconds"] for r in results)
             for name in results[0]}
    steps = {name: sum(r[name]["steps"] for r in results) for name in results[0]}
    differ = sum(r["revision"]["tokens"] != r["working tree"]["tokens"] for r in results)
    print(f"{args.drafter} --k {args.k}, t = {args.temperature}, {len(results)} prompts ({args.split}, limit {args.limit}, "
          f"skip {args.skip}); revision {args.revision}"
          + (f"; kernels: revision {args.revision_isa or 'native'}, working tree {args.isa or 'native'}"
             if args.revision_isa or args.isa else ""))
    print("tokens/s: " + ", ".join(f"{name} {rate:.2f}" for name, rate in rates.items()))
    print(f"working tree over revision: {rates['working tree'] / rates['revision']:.3f} "
          f"(95% {low:.3f}-{high:.3f}); verification steps: "
          + ", ".join(f"{name} {n}" for name, n in steps.items()) + f"; answers that differ: {differ} of {len(results)}")


if __name__ == "__main__":
    main()
