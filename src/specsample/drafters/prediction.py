"""Drafting from a predicted answer: OpenAI's Predicted Outputs (`prediction`).

A caller who knows most of the answer already (a file to edit, a document to return with a few changes)
sends it as `prediction`. The drafter proposes the prediction's next tokens from where the answer stands
in it: while the answer follows the prediction, from the token after the last one copied (`cursor`); once
it departs, from the first occurrence at or after the cursor (else the last one before it) of the answer's
last n tokens (n from `max_n` down to `min_n`) in the prediction, which picks the copy up again after an edit.
At the answer's first token the prediction's beginning is proposed.

The draft is a point mass, a function of the prompt, the answer so far and the prediction, so
verification stays exact at any temperature and the answer is the one the target gives without a
prediction: a wrong prediction costs time, never text. `with_prediction` pairs it with a request's
drafter (`A+B`).
"""

from __future__ import annotations

from bisect import bisect_left

from torch import Tensor

from specsample.drafters.base import Drafter
from specsample.drafters.fallback import FallbackDrafter
from specsample.drafters.ngram import LookupDrafter
from specsample.sampling import SamplingParams


class PredictionDrafter(LookupDrafter):
    """Up to k tokens of `prediction` (token ids) from where the answer stands in it."""

    def __init__(self, prediction: list[int], max_n: int = 8, min_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.prediction, self.max_n, self.min_n = list(prediction), max_n, min_n
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its continuations start, ascending
        for end in range(1, len(self.prediction) + 1):
            for n in range(min_n, min(max_n, end) + 1):
                self.starts.setdefault(tuple(self.prediction[end - n : end]), []).append(end)
        self.tail: list[int] = []  # the context's last max_n tokens
        self.cursor = 0  # the prediction's next token, where the answer follows it
        self.following = True  # whether the answer's tokens so far followed the prediction from the cursor

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.tail = prompt_ids.tolist()[-self.max_n :]
        self.cursor, self.following = 0, True

    def lookup(self, k: int) -> list[int]:
        return self.prediction[self.cursor : self.cursor + k] if self.following else []

    def match(self) -> int | None:
        """Where the prediction continues the longest suffix of the context it holds: the first such place
        at or after the cursor, else the last one before it."""
        for n in range(min(self.max_n, len(self.tail)), self.min_n - 1, -1):
            starts = self.starts.get(tuple(self.tail[-n:]))
            if starts:
                i = bisect_left(starts, self.cursor)
                return starts[i] if i < len(starts) else starts[-1]
        return None

    def extend(self, new: list[int]) -> None:
        """The answer grew by `new`: follow the prediction on, or where it departed, look for where the
        prediction holds its last tokens (so the draft is a function of the text alone)."""
        for token in new:
            if self.following and self.cursor < len(self.prediction) and self.prediction[self.cursor] == token:
                self.cursor += 1
            else:
                self.following = False
        self.tail = (self.tail + new)[-self.max_n :]
        if not self.following:
            start = self.match()
            if start is not None:
                self.cursor, self.following = start, True


def with_prediction(drafter: Drafter, prediction: list[int]) -> Drafter:
    """A request's drafter with the prediction (`FallbackDrafter`, both orders exact): after a lookup
    drafter, which matches the prompt and earlier answers as well (where the prompt holds the text being
    edited it drafts it already), the prediction drafting where it finds nothing; before a model drafter,
    whose draft costs passes."""
    if drafter.is_lookup:
        return FallbackDrafter(drafter, PredictionDrafter(prediction))
    return FallbackDrafter(PredictionDrafter(prediction), drafter)
