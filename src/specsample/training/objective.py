"""What the head is trained on: feature regression and distillation losses, and the greedy acceptance estimate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specsample.drafters.head import DraftHead
from specsample.training.dataset import Sequence, drafted_from
from specsample.training.options import TrainOptions

EVAL_K = 4


class Objective:
    """Losses and the greedy acceptance estimate of a head against stored target features."""

    def __init__(self, head: DraftHead, embed: Tensor, lm_head: Tensor, token_ids: Tensor) -> None:
        self.head = head
        self.embed = embed  # [vocab, hidden], the target's input embeddings (frozen)
        self.lm_head = lm_head  # [vocab, hidden], the target's LM head: its greedy tokens
        self.token_ids = token_ids  # [n], the head's token subset, which it drafts from
        self.lm_head_rows = lm_head[token_ids]  # [n, hidden], the target's LM head restricted to the subset

    def passes(self, tokens: Tensor, features: Tensor, depth: int) -> list[Tensor]:
        """Predicted features [b, t, hidden] of `depth` passes (`DraftHead.forward`): pass d at
        position i is draft step d from anchor i - d + 1, predicting feature i + 1."""
        return self.head(features[:, :-1], self.embed[tokens[:, 1:]], depth)

    def loss(self, tokens: Tensor, features: Tensor, mask: Tensor, options: TrainOptions) -> tuple[Tensor, dict]:
        truth = features[:, 1:, -self.head.config.hidden_size :]  # [b, t, hidden], the final states
        target_logp = (truth @ self.lm_head_rows.t()).log_softmax(-1)  # [b, t, n]
        total, parts = torch.zeros(()), {}
        for j, predicted in enumerate(self.passes(tokens, features, options.unroll)):
            counted = mask.clone()
            counted[:, :j] = False  # pass j + 1's first j positions draft from an anchor before the window
            if not counted.any():  # windows of short answers: no position this deep (a mean of none is NaN)
                break
            regression = F.smooth_l1_loss(predicted[counted], truth[counted])
            logp = (predicted @ self.lm_head_rows.t()).log_softmax(-1)
            distill = -(target_logp.exp() * logp).sum(-1)[counted].mean()
            total = total + (options.feature_weight * regression + options.distill_weight * distill) / (j + 1)
            parts[f"regression{j + 1}"], parts[f"distill{j + 1}"] = float(regression.detach()), float(distill.detach())
        return total, parts

    @torch.no_grad()
    def accepted_length(self, sequences: list[Sequence], k: int = EVAL_K) -> float:
        """Estimated greedy mean accepted length at K = k (bonus token included) on `sequences`.

        Drafting step j from a context ending at position m is right when the drafts of passes 1..j at
        positions m..m + j - 1 (each the subset's token of highest draft logit) all are the target's
        greedy token over the whole vocabulary, and the sequence follows the greedy path there (a
        sampled answer leaves it where its token is not the target's argmax: past that, the passes
        read a token the engine would not have drafted from); that gives each anchor its accepted
        length. The steps are then walked as the engine takes them, from the answer's first anchor,
        each starting where the last one ended (an average over every anchor would weigh the easy
        stretches, where steps are long and few, as much as the hard ones).
        """
        steps, total = 0, 0
        for s in sequences:
            if len(s.tokens) < k + 2:
                continue
            features, tokens = s.features.float()[None], s.tokens[None]
            target_tokens = (features[0, 1:, -self.head.config.hidden_size :] @ self.lm_head.t()).argmax(-1)  # [t]
            on_path = torch.ones_like(target_tokens, dtype=torch.bool)  # [t], position i predicts token i + 2
            on_path[:-1] = target_tokens[:-1] == tokens[0, 2:]
            right = torch.stack([
                (self.token_ids[(p[0] @ self.lm_head_rows.t()).argmax(-1)] == target_tokens) & on_path
                for p in self.passes(tokens, features, k)
            ])  # [k, t]
            anchors = right.shape[1] - k + 1
            chain = torch.ones(anchors, dtype=torch.bool)
            length = torch.ones(anchors)
            for j in range(k):
                chain &= right[j, j : j + anchors]
                length += chain.float()
            walked = walk(length.long().tolist(), drafted_from(s))
            steps, total = steps + walked[0], total + walked[1]
        return total / max(steps, 1)


def walk(lengths: list[int], first: int) -> tuple[int, int]:
    """The steps and tokens of decoding from anchor `first` when a step from anchor a emits lengths[a]
    tokens (its accepted draft tokens and the bonus), the next step starting where it ended."""
    steps, tokens, anchor = 0, 0, first
    while anchor < len(lengths):
        steps, tokens = steps + 1, tokens + lengths[anchor]
        anchor += lengths[anchor]
    return steps, tokens
