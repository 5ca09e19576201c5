"""What the head is trained on: feature regression and distillation losses, and the greedy acceptance estimate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specsample.drafters.head import DraftHead
from specsample.training.dataset import Sequence
from specsample.training.options import TrainOptions

EVAL_K = 4


class Objective:
    """Losses and the greedy acceptance estimate of a head against stored target features."""

    def __init__(self, head: DraftHead, embed: Tensor, lm_head_rows: Tensor) -> None:
        self.head = head
        self.embed = embed  # [vocab, hidden], the target's input embeddings (frozen)
        self.lm_head_rows = lm_head_rows  # [n, hidden], the target's LM head restricted to the subset

    def passes(self, tokens: Tensor, features: Tensor, depth: int) -> list[Tensor]:
        """Predicted features [b, t, hidden] of `depth` passes (`DraftHead.forward`): pass d at
        position i is draft step d from anchor i - d + 1, predicting feature i + 1."""
        return self.head(features[:, :-1], self.embed[tokens[:, 1:]], depth)

    def loss(self, tokens: Tensor, features: Tensor, mask: Tensor, options: TrainOptions) -> tuple[Tensor, dict]:
        truth = features[:, 1:, -self.head.config.hidden_size :]  # [b, t, hidden], the final states
        target_logp = (truth @ self.lm_head_rows.t()).log_softmax(-1)  # [b, t, n]
        total, parts = torch.zeros(()), {}
        for j, predicted in enumerate(self.passes(tokens, features, options.unroll)):
            regression = F.smooth_l1_loss(predicted[mask], truth[mask])
            logp = (predicted @ self.lm_head_rows.t()).log_softmax(-1)
            distill = -(target_logp.exp() * logp).sum(-1)[mask].mean()
            total = total + (options.feature_weight * regression + options.distill_weight * distill) / (j + 1)
            parts[f"regression{j + 1}"], parts[f"distill{j + 1}"] = float(regression.detach()), float(distill.detach())
        return total, parts

    @torch.no_grad()
    def accepted_length(self, sequences: list[Sequence], k: int = EVAL_K) -> float:
        """Estimated greedy mean accepted length at K = k (bonus token included) on `sequences`.

        Anchors are the answer's positions. Drafting step j from a context ending at position m is right when the
        predictions of passes 1..j at positions m..m + j - 1 all match the
        target's argmax token.
        """
        counted, total = 0, 0.0
        for s in sequences:
            if len(s.tokens) < k + 2:
                continue
            features, tokens = s.features.float()[None], s.tokens[None]
            target_tokens = (features[0, 1:, -self.head.config.hidden_size :] @ self.lm_head_rows.t()).argmax(-1)  # [t]
            right = torch.stack([
                (p[0] @ self.lm_head_rows.t()).argmax(-1) == target_tokens for p in self.passes(tokens, features, k)
            ])  # [k, t]
            anchors = right.shape[1] - k + 1
            chain = torch.ones(anchors, dtype=torch.bool)
            length = torch.ones(anchors)
            for j in range(k):
                chain &= right[j, j : j + anchors]
                length += chain.float()
            answer = length[max(0, s.prompt_length - 2) :]  # drafting happens in the answer only
            counted, total = counted + answer.numel(), total + float(answer.sum())
        return total / max(counted, 1)
