"""Token-level intersection: a draft model with another tokenizer drafts from the tokens both share.

The draft model (kept on the target's text by `DraftText`) gives its distribution over its own
vocabulary under the request's sampling transform; `verify.cross_vocab.intersection_probs`
restricts it to the tokens whose string the target has too, renormalised on target ids. Draft
token i is drawn from that with `random.draw(draft_probs, i)` and verified by ordinary rejection
sampling with those draft_probs; the draft model is fed its own token of the same string. The
draft stops where the draft model puts no mass on a shared token.

`cross_vocab_drafter` builds the drafter for a draft model whose tokenizer is not the target's,
with one of `METHODS`: `text` (string-level, `drafters.cross_text`), `intersection`, or `auto`,
which picks per request (`ByTemperature`): string-level at temperature 0, where its point mass
is the draft model's argmax and it also drafts tokens the target lacks and text across token
boundaries, and intersection when sampling, where rejection sampling with draft_probs accepts
with probability sum(min(target_probs, draft_probs)) rather than the point mass's
target_probs[argmax].
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from specsample.drafters.base import Draft, Drafter, draft_cost
from specsample.drafters.cost import relative_pass_cost
from specsample.drafters.cross_text import TextDrafter
from specsample.drafters.draft_text import DraftText
from specsample.models.loading import LoadedModel
from specsample.models.target import Target
from specsample.sampling import RandomSource, SamplingParams, draft_confidence, draw_draft_token, probs_from_logits
from specsample.verify.cross_vocab import intersection_probs
from specsample.vocabulary import SharedVocabulary, check_shared, shared_vocabulary

METHODS = ("auto", "text", "intersection")


class IntersectionDrafter:
    is_lookup = False  # it draws its draft

    def __init__(self, text: DraftText, shared: SharedVocabulary) -> None:
        self.text = text
        self.shared = shared
        self.params = SamplingParams()

    @property
    def draft_cost(self) -> float | None:
        return self.text.draft_cost

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.params = params
        self.text.begin(prompt_ids.tolist())

    def propose(self, k: int, random: RandomSource) -> Draft:
        k = self.text.sync(k)
        if not k:
            return Draft.empty()
        tokens, probs, confidence = [], [], []
        for i in range(k):
            logits = self.text.logits()  # [draft_vocab]
            step_probs = intersection_probs(probs_from_logits(logits, self.params), self.shared)  # [target_width]
            if not step_probs.sum() > 0:
                break
            token = draw_draft_token(step_probs, i, random, self.params)
            tokens.append(token)
            probs.append(step_probs)
            confidence.append(draft_confidence(logits, step_probs, self.params))
            self.text.push(int(self.shared.to_draft[token]))
        setup = self.text.prefill_seconds
        if not tokens:
            return replace(Draft.empty(), setup_seconds=setup)
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs), torch.tensor(confidence), setup_seconds=setup)

    def observe(self, tokens: list[int]) -> None:
        self.text.observe(tokens)


class ByTemperature:
    """`greedy`'s drafts at temperature 0, `sampling`'s otherwise, chosen per request."""

    is_lookup = False

    def __init__(self, greedy: Drafter, sampling: Drafter) -> None:
        self.greedy, self.sampling = greedy, sampling
        self.active = sampling

    @property
    def draft_cost(self) -> float | None:
        return draft_cost(self.active)

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.active = self.greedy if params.greedy else self.sampling
        self.active.begin(prompt_ids, params)

    def propose(self, k: int, random: RandomSource) -> Draft:
        return self.active.propose(k, random)

    def observe(self, tokens: list[int]) -> None:
        self.active.observe(tokens)


def cross_vocab_drafter(method: str, model: LoadedModel, target: Target, draft: LoadedModel, draft_target: Target) -> Drafter:
    """The drafter of `draft` (on `draft_target`) for `model`'s target, whose tokenizer differs, by `method`;
    its cost per draft token (`DeclaresCost`) the draft model's pass against the target's, measured here."""
    if method not in METHODS:
        raise ValueError(f"unknown cross-vocabulary method {method!r}: expected one of {', '.join(METHODS)}")
    shared = check_shared(
        shared_vocabulary(model.tokenizer, draft.tokenizer, target.vocab_size, draft_target.vocab_size), draft.name
    )
    text = DraftText(draft_target, model.tokenizer, draft.tokenizer, relative_pass_cost(draft_target, target))
    drafters = {"text": TextDrafter(text, model.tokenizer), "intersection": IntersectionDrafter(text, shared)}
    if method == "auto":
        return ByTemperature(drafters["text"], drafters["intersection"])
    return drafters[method]
