"""How far drafting by copying from the context can go on a workload, whatever the drafter.

On the target's own greedy answers, it replays verification steps at a fixed K
and counts the tokens each step would emit (accepted draft tokens plus the one
the target adds) for three drafters:

- `ngram`: the ngram drafter itself, one proposal per step;
- `all matches`: the best of the continuations of every earlier occurrence of
  every suffix of the context: what a tree holding all of them, verified at
  once, would get;
- `any copy`: the best copy starting anywhere in the context: a bound on every
  drafter that proposes text copied from the context.

Each step's candidates contain the previous drafter's (a copy runs on into
its own output as the ngram drafter's does), so per step the three are ordered.

Mean accepted length is tokens / steps. With f(K + 1)/f(1) the cost of a
verification step, mean accepted length / (f(K + 1)/f(1)) bounds the decoding
speedup such a drafter can give on this target, before its own cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specsample.drafters.ngram import NgramDrafter, copy_from
from specsample.sampling import SamplingParams
from specsample.tokens import common_prefix

# (context, truth: the next K tokens of the answer) -> candidate drafts. The truth only rules candidates
# out that cannot match (a bound may look at it); its length is K, shorter at the answer's end.
Proposer = Callable[[list[int], list[int]], list[list[int]]]


@dataclass(frozen=True)
class Bound:
    tokens: int
    steps: int

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def replay(prompt: list[int], output: list[int], k: int, propose: Proposer) -> Bound:
    """Steps to emit `output` after `prompt` when each step accepts the best candidate's matching prefix."""
    j = steps = 0
    while j < len(output):
        truth = output[j : j + k]
        accepted = max((common_prefix(c, truth) for c in propose(prompt + output[:j], truth)), default=0)
        j, steps = j + accepted + 1, steps + 1
    return Bound(len(output), steps)


def ngram_bound(prompt: list[int], output: list[int], k: int) -> Bound:
    """The `ngram` drafter's own proposals, replayed (its index grows with the accepted text, as in the engine)."""
    drafter = NgramDrafter()
    drafter.begin(torch.tensor(prompt), SamplingParams(temperature=0))
    j = steps = 0
    while j < len(output):
        accepted = common_prefix(drafter.lookup(k), output[j : j + k])
        drafter.extend(output[j : j + accepted + 1])
        j, steps = j + accepted + 1, steps + 1
    return Bound(len(output), steps)


def positions(tokens: list[int], token: int, stop: int) -> list[int]:
    """Every i < stop with tokens[i] == token (list.index scans in C)."""
    found, i = [], -1
    while True:
        try:
            i = tokens.index(token, i + 1, stop)
        except ValueError:
            return found
        found.append(i)


def all_matches(context: list[int], truth: list[int]) -> list[list[int]]:
    """The continuations of every earlier occurrence of every suffix of the context. An occurrence of a
    longer suffix is one of the last token too, so these are the continuations of the last token's."""
    return [copy_from(context, i + 1, len(truth)) for i in positions(context, context[-1], len(context) - 1)]


def any_copy(context: list[int], truth: list[int]) -> list[list[int]]:
    """A copy from every position of the context (the bound: any copied text at all); those that do
    not start with the truth's first token are left out, as they match nothing."""
    return [copy_from(context, i, len(truth)) for i in positions(context, truth[0], len(context))]


def bounds(prompt: list[int], output: list[int], k: int) -> dict[str, Bound]:
    return {
        "ngram": ngram_bound(prompt, output, k),
        "all matches": replay(prompt, output, k, all_matches),
        "any copy": replay(prompt, output, k, any_copy),
    }
