"""README's first command with its default configuration against `--drafter none`, as a new user runs it.

Each run is a fresh process (`specsample generate ... --json`, the arguments read from README.md's
first command), so the default's K policy starts from nothing every time, as it does for that user.
Runs alternate (the order flips every pair) and the ratio is of decode tokens per second
(`stats.tokens_per_second`; loading and prefill are the same for both). Prints every pair, the median
ratio and a 95% paired-bootstrap interval of the ratio of mean rates, and checks that both gave the
same tokens. `--prompt` replaces README's prompt (the earlier example, "Explain speculative decoding in
two sentences.", gives a lookup drafter nothing to copy).

    python benchmarks/readme_example.py --pairs 20 [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from scipy.stats import bootstrap

README = Path(__file__).resolve().parent.parent / "README.md"
CONFIGURATIONS = {"default": [], "none": ["--drafter", "none"]}


def readme_arguments(readme: Path = README) -> list[str]:
    """The arguments after `specsample` of README's first command (`generate PROMPT ...`)."""
    for line in readme.read_text().splitlines():
        if "specsample generate " in line:
            words = shlex.split(line.split("specsample ", 1)[1])
            return words[: words.index("&&")] if "&&" in words else words
    raise ValueError(f"no `specsample generate` command in {readme}")


def with_prompt(arguments: list[str], prompt: str | None) -> list[str]:
    """README's arguments, with `prompt` in place of its prompt where given."""
    return arguments if prompt is None else [arguments[0], prompt, *arguments[2:]]


def run(arguments: list[str]) -> dict:
    """One fresh process of `specsample ARGUMENTS`; its JSON output."""
    out = subprocess.run([sys.executable, "-m", "specsample.cli", *arguments], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--prompt", help="a prompt in place of README's")
    options = parser.parse_args()
    pairs, command = options.pairs, with_prompt(readme_arguments(), options.prompt)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for i in range(pairs):
        order = list(CONFIGURATIONS) if i % 2 == 0 else list(CONFIGURATIONS)[::-1]
        results = {name: run(command + CONFIGURATIONS[name]) for name in order}
        if results["default"]["token_ids"] != results["none"]["token_ids"]:
            raise SystemExit("the default's tokens differ from plain decoding's")
        for name, result in results.items():
            rates[name].append(result["stats"]["tokens_per_second"])
        default = results["default"]
        print(f"pair {i}: default {rates['default'][-1]:.1f} ({default['drafter']}, {default['backend']}, "
              f"drafted {default['stats']['drafted_tokens']}), none {rates['none'][-1]:.1f} tokens/s", flush=True)
    ours, plain = np.array(rates["default"]), np.array(rates["none"])
    interval = bootstrap((ours, plain), lambda a, b, axis=-1: a.mean(axis) / b.mean(axis), paired=True,
                         vectorized=True, method="percentile", rng=np.random.default_rng(0)).confidence_interval
    print(f"default / none: median of pair ratios {statistics.median(ours / plain):.3f}, ratio of means "
          f"{ours.mean() / plain.mean():.3f} (95% {interval.low:.3f}-{interval.high:.3f}); "
          f"medians {statistics.median(ours):.1f} and {statistics.median(plain):.1f} tokens/s, {pairs} pairs")


if __name__ == "__main__":
    main()
