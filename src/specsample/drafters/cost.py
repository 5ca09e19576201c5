"""What a draft model's token costs against a target pass, measured once when the drafter is made.

A draft model drafts a token with one pass over one token; the target verifies with one pass too.
Their ratio c tells a K policy, before any draft, whether drafting can pay at all: K draft tokens
all accepted give K + 1 tokens for f(K + 1) + K c f(1) seconds against plain decoding's one token
per f(1), so a drafter with c at or above 1 never pays, whatever it drafts (`policy.CostModelK`,
`see_draft_cost`). Measured, not declared: it depends on both backends, their threads and the
machine; the two models' passes are interleaved so that both see the same load.
"""

from __future__ import annotations

import statistics

import torch

from specsample.cost_curve import time_score
from specsample.models.target import Target

ROUNDS = 5  # measured pairs of passes, after one to warm up
CONTEXT = 32  # cached positions before each measured pass


def relative_pass_cost(draft: Target, target: Target, rounds: int = ROUNDS, context: int = CONTEXT) -> float:
    """Seconds of the draft model's single-token pass per second of the target's: the median, over
    `rounds` pairs of the two passes taken one after the other (after a warm-up pair), of the pair's
    ratio, each pass after `context` cached positions. Both caches are left empty."""
    models = (draft, target)
    context = min(context, draft.max_length - 1, target.max_length - 1)
    contexts = [torch.arange(context) % model.vocab_size for model in models]
    for model, cached in zip(models, contexts):
        model.prefill(cached)
    ratios = []
    for round_ in range(rounds + 1):
        token = torch.tensor([context])  # [1]
        draft_seconds, target_seconds = (time_score(model, token % model.vocab_size, cached)
                                         for model, cached in zip(models, contexts))
        if round_:  # the first pair warms the caches and the backends' buffers up
            ratios.append(draft_seconds / target_seconds)
    for model in models:
        model.rollback(0)
    return statistics.median(ratios)

