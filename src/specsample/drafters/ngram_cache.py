"""The `ngram-cache` drafter: llama.cpp's n-gram cache rule, with stricter thresholds.

After llama.cpp's `common_ngram_cache_draft` (common/ngram-cache.cpp, the context cache that
`llama-lookup` drafts from): the context's n-grams of 1 to NGRAM_MAX tokens are counted with the
token that followed each occurrence. A draft grows token by token: the most frequent continuation
of the longest suffix of the context and the draft so far whose counts pass a threshold (at least
MIN_SAMPLES[n - 1] occurrences, the continuation holding at least MIN_PERCENT[n - 1] percent of
them); it stops where none does. So it drafts fewer tokens than `ngram`, which copies whatever
followed the last match, and surer ones, which pays where each verified token costs a good part of
a pass (llama.cpp: f(2)/f(1) about 1.35 on the bundled model).

Thresholds: llama.cpp's are (2, 2, 1, 1) occurrences and (66, 50, 50, 50) percent (LLAMA_PERCENT);
this drafter asks (75, 60, 60, 60), chosen by replaying both along plain decoding's answers to the
tuned Spec-Bench prompts (`benchmarks/lookup_rules.py`). On 30 never-tuned answers on the llamacpp
backend at K = 3 it decoded at 1.05x plain decoding end to end against `llama-lookup`'s 1.03x on the
same answers (BENCHMARKS.md). Ties between continuations go to the one seen first.

The proposal is a deterministic function of the context (point masses), so verification stays exact.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from torch import Tensor

from specsample.drafters.ngram import LookupDrafter
from specsample.sampling import SamplingParams

NGRAM_MAX = 4  # llama.cpp's LLAMA_NGRAM_MAX
MIN_SAMPLES = (2, 2, 1, 1)  # occurrences of a suffix of 1..4 tokens to draft from it (llama.cpp's, lax)
MIN_PERCENT = (75, 60, 60, 60)  # the share its most frequent continuation must hold
LLAMA_PERCENT = (66, 50, 50, 50)  # llama.cpp's draft_min_percent_lax


class NgramCacheDrafter(LookupDrafter):
    def __init__(self, min_samples: tuple[int, ...] = MIN_SAMPLES, min_percent: tuple[int, ...] = MIN_PERCENT) -> None:
        if len(min_samples) != NGRAM_MAX or len(min_percent) != NGRAM_MAX:
            raise ValueError(f"need {NGRAM_MAX} thresholds each, got {min_samples} and {min_percent}")
        self.min_samples, self.min_percent = min_samples, min_percent
        self.tokens: list[int] = []  # the context: prompt, then every emitted token
        self.counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)  # n-gram -> its continuations' counts

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.tokens, self.counts = [], defaultdict(Counter)
        self.extend(prompt_ids.tolist())

    def fork(self) -> NgramCacheDrafter:
        """A drafter for another request (`base.Forks`): the counts are the request's own context's."""
        return NgramCacheDrafter(self.min_samples, self.min_percent)

    def extend(self, new: list[int]) -> None:
        """Append tokens; each n-gram before a new token counts it as a continuation."""
        for token in new:
            end = len(self.tokens)
            self.tokens.append(token)
            for n in range(1, min(NGRAM_MAX, end) + 1):
                self.counts[tuple(self.tokens[end - n : end])][token] += 1

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens, each the confident continuation of the context and the tokens drafted before it."""
        draft: list[int] = []
        while len(draft) < k and (token := self.next_token(self.tokens[-NGRAM_MAX:] + draft)) is not None:
            draft.append(token)
        return draft

    def next_token(self, context: list[int]) -> int | None:
        """The most frequent continuation of the longest suffix of `context` whose counts pass the thresholds."""
        for n in range(min(NGRAM_MAX, len(context)), 0, -1):
            counts = self.counts.get(tuple(context[-n:]))
            if not counts:
                continue
            token, best = counts.most_common(1)[0]
            total = counts.total()
            if total >= self.min_samples[n - 1] and 100 * best >= self.min_percent[n - 1] * total:
                return token
        return None
