"""A separate small draft model with its own KV cache.

Any causal LM with the target's vocabulary. It samples k tokens one at a time
under the same sampling transform as the target, draft token i with the step's
numbers at offset i (`RandomSource.draw`: coupled with the target's token there
for a request with a seed), and returns the distributions it sampled from, so
verification stays exact at any temperature. `draft_cost`, where measured
(`drafters.cost`), is a draft token's cost relative to a target pass (`DeclaresCost`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specsample.drafters.base import Draft
from specsample.models.target import Target
from specsample.sampling import RandomSource, SamplingParams, draft_confidence, probs_from_logits
from specsample.tokens import common_prefix


class DraftModelDrafter:
    is_lookup = False  # it draws its draft
    def __init__(self, model: Target, draft_cost: float | None = None) -> None:
        self.model = model
        self.draft_cost = draft_cost
        self.context: list[int] = []
        self.draft: list[int] = []
        self.params = SamplingParams()

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.context = prompt_ids.tolist()
        self.params = params
        self.model.prefill(prompt_ids[:-1])

    def propose(self, k: int, random: RandomSource) -> Draft:
        feed = self.context[self.model.length :]  # uncached tail, at least the last token
        tokens, probs, confidence = [], [], []
        for i in range(k):
            logits = self.model.score(torch.tensor(feed))[-1]  # [vocab]
            step_probs = probs_from_logits(logits, self.params)  # [vocab]
            feed = [random.draw(step_probs, i)]
            tokens.append(feed[0])
            probs.append(step_probs)
            confidence.append(draft_confidence(logits, step_probs, self.params))
        self.draft = tokens
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs), torch.tensor(confidence))

    def observe(self, tokens: list[int]) -> None:
        """Keep the cached positions of the draft tokens that the text took up; the rest is fed again.
        The last token, the new pending one, is left uncached as after the prompt."""
        valid = len(self.context) + common_prefix(self.draft, tokens[:-1])  # cached context plus accepted draft tokens
        self.context += tokens
        self.draft = []
        self.model.rollback(min(self.model.length, valid))
