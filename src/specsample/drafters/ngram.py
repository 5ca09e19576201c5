"""The `ngram` drafter: prompt lookup, no second model.

It finds the last n tokens of the context (n from `max_n` down to `min_n`)
earlier in the context, the prompt and the text generated so far, and proposes
what followed their most recent occurrence. Summaries, answers over a document
and edits of code repeat their input, so the target often accepts long runs.

The proposal is a deterministic function of the context (a point mass), so
verification stays exact at any temperature: a draft token x is accepted with
probability target_probs[x].
"""

from __future__ import annotations

import torch
from torch import Tensor

from specsample.drafters.base import Draft
from specsample.sampling import RandomSource, SamplingParams
from specsample.tree import trie

BRANCHES = 4  # earlier matches a tree drafts the continuations of


class LookupDrafter:
    """Shared by the drafters that look their proposal up in an index of the context:
    subclasses provide `lookup(k)` and `extend(tokens)`."""

    is_lookup = True

    def propose(self, k: int, random: RandomSource) -> Draft:
        return Draft(torch.tensor(self.lookup(k), dtype=torch.long), None)

    def observe(self, tokens: list[int]) -> None:
        self.extend(tokens)

    def lookup(self, k: int) -> list[int]:
        raise NotImplementedError

    def extend(self, new: list[int]) -> None:
        raise NotImplementedError


class NgramDrafter(LookupDrafter):
    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []  # the context: prompt, then every emitted token
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.tokens, self.follows = [], {}
        self.extend(prompt_ids.tolist())

    def fork(self) -> NgramDrafter:
        """A drafter for another request (`base.Forks`): the index is the request's own context."""
        return NgramDrafter(self.max_n, self.min_n)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            start = self.follows.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.copy(start, k)
        return []

    def copy(self, start: int, k: int) -> list[int]:
        return copy_from(self.tokens, start, k)

    def extend(self, new: list[int]) -> None:
        """Append tokens; each n-gram that now has a following token points at it."""
        for token in new:
            end = len(self.tokens)
            self.tokens.append(token)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.follows[tuple(self.tokens[end - n : end])] = end


def copy_from(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens of `tokens` from `start` on; past the end the copy reads its own output,
    so a repeating pattern (shorter than k) continues instead of stopping."""
    out: list[int] = []
    length = len(tokens)
    for i in range(start, start + k):
        out.append(tokens[i] if i < length else out[i - length])
    return out


class NgramTreeDrafter(NgramDrafter):
    """`ngram` drafting a tree: the continuations of up to `branches` earlier occurrences of the longest
    matching suffix (the latest first, which gets half of the k nodes), merged where they agree."""

    def __init__(self, max_n: int = 4, min_n: int = 1, branches: int = BRANCHES) -> None:
        super().__init__(max_n, min_n)
        self.branches = branches
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its latest continuations start

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.starts = {}
        super().begin(prompt_ids, params)

    def extend(self, new: list[int]) -> None:
        end = len(self.tokens)
        super().extend(new)
        for start in range(end, len(self.tokens)):
            for n in range(self.min_n, min(self.max_n, start) + 1):
                starts = self.starts.setdefault(tuple(self.tokens[start - n : start]), [])
                starts.append(start)
                del starts[: -self.branches]

    def propose(self, k: int, random: RandomSource) -> Draft:
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            starts = self.starts.get(tuple(self.tokens[-n:]))
            if starts:
                latest, *others = starts[::-1]
                first = max(1, k // 2) if others else k
                rest = max(1, (k - first) // max(1, len(others)))
                continuations = [self.copy(latest, first)] + [self.copy(s, rest) for s in others]
                tokens, parents = trie(continuations)
                return Draft.tree(tokens[:k], parents[:k])
        return Draft.tree([], [])
