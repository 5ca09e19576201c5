"""The `layerskip` drafter: the target drafts for itself with some of its layers skipped.

Self-speculation (Draft&Verify, SWIFT, CLaSp) needs no second model and no
training: a draft token comes from the target's own forward pass through a
subset of its layers, in the target's own KV cache. Drafting K tokens appends
them to the cache through the kept layers only, then rolls the cache back;
the verification pass over the same positions rewrites every layer before any
later pass reads them, so the skipped layers' stale slots are never read.

Which layers to skip is calibrated once, on the first prompt, without
training. The layers between the first and the last are ranked by how little
they change the hidden state (cosine similarity of a layer's input and
output, ShortGPT's block influence), read from one transformers forward pass
over the prompt. For a few numbers of skipped layers, the draft's acceptance
probability (the overlap of draft_probs and target_probs, so the argmax
agreement at temperature 0) is measured on the prompt's last positions,
teacher-forced, against the target's full pass. The skip set with the best
predicted speedup wins, a draft token costing the kept layers' and the LM
head's share of the weights and verification costing one target pass. Where
none is predicted to beat plain decoding (a small target whose layers are not
redundant enough: the bundled 135M model), the choice is to skip nothing, and
a drafter that would be the target itself drafts nothing: every step is a
plain one, with no draft passes to pay for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specsample.drafters.base import Draft
from specsample.drafters.draft_model import DraftModelDrafter
from specsample.models import LoadedModel, Target
from specsample.models.target import RunsLayerSubsets, require
from specsample.sampling import RandomSource, SamplingParams, probs_from_logits

SKIP_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.625)  # of the middle layers, one candidate each
CALIBRATION_POSITIONS = 64  # last prompt positions the acceptance is measured on
RANKING_TOKENS = 256  # last prompt tokens the layers are ranked on
K_MAX = 8  # largest K the predicted speedup considers


class KeptLayers:
    """The target through its kept layers only, as a Target sharing its KV cache."""

    def __init__(self, target: RunsLayerSubsets, kept: Sequence[int]) -> None:
        self.target = target
        self.kept = list(kept)
        self.vocab_size = target.vocab_size
        self.max_length = target.max_length

    @property
    def length(self) -> int:
        return self.target.length

    def prefill(self, token_ids: Tensor) -> None:
        """Fill the shared cache with every layer, as the target's own prefill does."""
        self.target.prefill(token_ids)

    def extend(self, token_ids: Tensor) -> None:
        self.target.extend(token_ids)

    def score(self, token_ids: Tensor) -> Tensor:
        return self.target.forward(token_ids, layers=self.kept)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)


@dataclass(frozen=True)
class Candidate:
    skip: tuple[int, ...]  # skipped layers
    acceptance: float  # mean acceptance probability per draft token on the calibration positions
    draft_cost: float  # a draft token's cost as a fraction of a target pass
    predicted_speedup: float


# Skipping nothing drafts with the target itself, which can only tie with plain decoding:
# the drafter then drafts nothing.
NO_SKIP = Candidate(skip=(), acceptance=1.0, draft_cost=1.0, predicted_speedup=1.0)


class LayerSkipDrafter(DraftModelDrafter):
    """Drafts with the target's kept layers in the target's cache; calibrates `skip` on the first prompt
    unless it is given. With nothing to skip it proposes nothing (plain decoding)."""

    def __init__(self, target: Target, model: nn.Module, skip: Sequence[int] | None = None) -> None:
        target = require(target, RunsLayerSubsets, "layerskip")
        n_layers = len(target.layers)
        if skip is not None and not all(0 <= i < n_layers for i in skip):
            raise ValueError(f"layers to skip must be in 0..{n_layers - 1}, got {list(skip)}")
        super().__init__(KeptLayers(target, kept_layers(n_layers, skip or ())))
        self.target = target
        self.hf_model = model
        self.skip = None if skip is None else tuple(sorted(skip))
        self.candidates: list[Candidate] = []  # the calibration's measurements

    @classmethod
    def load(cls, model: LoadedModel, target: Target) -> LayerSkipDrafter:
        """The registry's factory: calibrate on the first prompt."""
        return cls(target, model.model)

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        """The target's cache already holds the prompt but its last token: drafting starts from it."""
        self.context = prompt_ids.tolist()
        self.params = params
        if self.skip is None and prompt_ids.shape[0] > 2:
            self.candidates = calibrate(self.target, self.hf_model, prompt_ids, params)
            self.skip = best_candidate(self.candidates).skip
            self.model.kept = kept_layers(len(self.target.layers), self.skip)

    def propose(self, k: int, random: RandomSource) -> Draft:
        """Draft through the kept layers, then give the target its cache back where it was."""
        if not self.skip:
            return Draft.empty()
        start = self.model.length
        draft = super().propose(k, random)
        self.model.rollback(start)
        return draft

    def observe(self, tokens: list[int]) -> None:
        """The cache is the target's, kept by the target: only the context grows."""
        self.context += tokens


def best_candidate(candidates: Sequence[Candidate]) -> Candidate:
    """The measured skip set with the best predicted speedup, if it beats plain decoding; else NO_SKIP."""
    return max([NO_SKIP, *candidates], key=lambda c: c.predicted_speedup)


def kept_layers(n_layers: int, skip: Sequence[int]) -> list[int]:
    return [i for i in range(n_layers) if i not in set(skip)]


@torch.inference_mode()
def layer_ranking(model: nn.Module, prompt_ids: Tensor) -> list[int]:
    """The middle layers (neither the first nor the last), least influential first."""
    hidden = model(prompt_ids[-RANKING_TOKENS:][None], output_hidden_states=True).hidden_states  # layers + 1 x [1, n, hidden]
    n_layers = len(hidden) - 1
    similarity = {
        i: float(nn.functional.cosine_similarity(hidden[i][0], hidden[i + 1][0], dim=-1).mean())
        for i in range(1, n_layers - 1)
    }
    return sorted(similarity, key=similarity.get, reverse=True)


def calibrate(
    target: RunsLayerSubsets, model: nn.Module, prompt_ids: Tensor, params: SamplingParams
) -> list[Candidate]:
    """Measure skip sets of growing size on the prompt's last positions; leaves the cache as it found it.

    The cache holds the prompt but its last token. Each candidate rewrites the
    calibration positions through its kept layers; the target's full pass over
    them comes last, giving the reference and restoring every layer.
    """
    ranking = layer_ranking(model, prompt_ids)
    n_layers = len(target.layers)
    end = target.length
    start = max(1, end - CALIBRATION_POSITIONS)
    tokens = prompt_ids[start:end]  # [positions]
    sizes = sorted({max(1, round(f * len(ranking))) for f in SKIP_FRACTIONS}) if ranking else []
    draft_logits = {}
    for size in sizes:
        skip = tuple(sorted(ranking[:size]))
        target.rollback(start)
        draft_logits[skip] = target.forward(tokens, layers=kept_layers(n_layers, skip))  # [positions, vocab]
    target.rollback(start)
    target_probs = probs_from_logits(target.forward(tokens), params)  # [positions, vocab]
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    head_params = model.get_output_embeddings().weight.numel()
    total = sum(layer_params) + head_params
    out = []
    for skip, logits in draft_logits.items():
        draft_probs = probs_from_logits(logits, params)
        acceptance = float(torch.minimum(draft_probs, target_probs).sum(-1).mean())
        cost = (total - sum(layer_params[i] for i in skip)) / total
        out.append(Candidate(skip, acceptance, cost, predicted_speedup(acceptance, cost)))
    return out


def predicted_speedup(acceptance: float, draft_cost: float) -> float:
    """Best over K of tokens per step (1 + a + ... + a^K) over its cost (K draft tokens and one target pass)."""
    return max(
        sum(acceptance**i for i in range(k + 1)) / (1 + k * draft_cost) for k in range(1, K_MAX + 1)
    )
