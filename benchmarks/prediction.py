"""Predicted Outputs: an edit of a known text with the text as `prediction`, against the same requests without.

Each prompt asks the model to return a function of Python's standard library with one change (a
docstring added, a variable renamed, type hints added); the prediction is the function as it stands,
the text an editor sends. Two samplers (a lookup drafter learns each answer, so one sampler would draft
the second request from the first's answer), the configuration's drafter and K policy, greedy: for every
prompt the request without a prediction and with it, in alternating order, interleaved. Prints per
prompt the decode tokens/s of both and whether their tokens are the same, then the ratio of the totals
with a 95% paired-bootstrap interval. The name of the CPU (`lscpu`) goes beside the figures.

    python benchmarks/prediction.py --prompts 12 --max-new-tokens 160 [--backend gguf] [--drafter suffix]
"""

from __future__ import annotations

import argparse
import calendar
import colorsys
import difflib
import fnmatch
import inspect
import json
import shlex
import textwrap

import numpy as np
from scipy.stats import bootstrap

from specsample.api import SpecSampler

EDITS = [
    "Add a one-line docstring to this function and return the whole function unchanged otherwise.",
    "Rename the function's first parameter to `value` and return the whole function.",
    "Add type hints to this function's parameters and return the whole function.",
]


def functions(count: int) -> list[str]:
    """Short functions of the standard library (10 to 30 lines), in a fixed order."""
    found = []
    for module in (fnmatch, colorsys, shlex, textwrap, calendar, difflib):
        for _, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if function.__module__ != module.__name__:
                continue
            source = textwrap.dedent(inspect.getsource(function))
            if 10 <= source.count("\n") <= 30:
                found.append(source)
    return found[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--drafter", default=None, help="the drafter (default: the configuration's)")
    parser.add_argument("--json", help="also write the per-prompt figures here")
    args = parser.parse_args()
    # a sampler each way: a lookup drafter learns every answer, and the other way's answer to the same prompt
    # (the same tokens) would be drafted from
    samplers = {name: SpecSampler.load(drafter=args.drafter, backend=args.backend) for name in ("plain", "predicted")}
    sources = functions(args.prompts)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=0)
    for sampler in samplers.values():
        sampler.generate("Say hello.", max_new_tokens=8, temperature=0)  # warm-up
    rows = []
    for i, source in enumerate(sources):
        prompt = f"{EDITS[i % len(EDITS)]}\n\n```python\n{source}```"
        prediction = f"```python\n{source}```"
        runs = {}
        for name in (("plain", "predicted") if i % 2 == 0 else ("predicted", "plain")):
            out = samplers[name].generate(prompt, prediction=prediction if name == "predicted" else None, **options)
            runs[name] = out
        plain, predicted = runs["plain"], runs["predicted"]
        rows.append({"tokens": len(plain.token_ids), "same": plain.token_ids == predicted.token_ids,
                     "plain_seconds": plain.stats.decode_seconds, "predicted_seconds": predicted.stats.decode_seconds,
                     "predicted_mean_accepted_length": predicted.stats.mean_accepted_length,
                     "plain_mean_accepted_length": plain.stats.mean_accepted_length})
        r = rows[-1]
        print(f"{i:2d}: {r['tokens']:4d} tokens, without {r['tokens'] / r['plain_seconds']:6.1f} tok/s "
              f"(MAL {r['plain_mean_accepted_length']:.2f}), with {r['tokens'] / r['predicted_seconds']:6.1f} tok/s "
              f"(MAL {r['predicted_mean_accepted_length']:.2f}), same tokens: {r['same']}", flush=True)
    plain_s = np.array([r["plain_seconds"] for r in rows])
    predicted_s = np.array([r["predicted_seconds"] for r in rows])
    ratio = plain_s.sum() / predicted_s.sum()
    interval = bootstrap((plain_s, predicted_s), lambda a, b: a.sum() / b.sum(), paired=True, vectorized=False,
                         n_resamples=2000, random_state=0).confidence_interval
    sampler = samplers["plain"]
    print(f"{sampler.configuration.drafter} on {sampler.backend}: with the prediction {ratio:.2f}x decode speed "
          f"(95% {interval.low:.2f}-{interval.high:.2f}), {sum(r['same'] for r in rows)} of {len(rows)} answers identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"drafter": sampler.configuration.drafter, "backend": sampler.backend, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
