"""The settings of a draft-head training run, checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainOptions:
    generate_batch: int = 16  # prompts per generate call
    sampled_answers: int = 0  # answers per prompt sampled at temperature 1, after the greedy one
    self_prompts: int = 0  # prompts the target writes itself, added to the given ones
    self_prompt_tokens: int = 48  # longest self-written prompt; longer ones are dropped
    batch_size: int = 16  # windows per training step
    max_new_tokens: int = 160
    max_prompt_tokens: int = 384  # longer prompts keep their last tokens
    data_minutes: float = 0.0  # stop generating after this long and train on what there is (0: no limit)
    vocab_subset: int = 8192  # 0: the full LM head
    layers: int = 1
    feature_layers: tuple[int, ...] = ()  # decoder layers (1-based) whose outputs the head reads as well
    steps: int = 2000
    seq_len: int = 256  # positions per training window
    lr: float = 1e-3
    feature_weight: float = 1.0
    distill_weight: float = 1.0
    unroll: int = 2
    holdout: float = 0.05
    eval_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("generate_batch", "batch_size", "max_new_tokens", "max_prompt_tokens", "layers", "steps",
                     "seq_len", "unroll", "eval_every", "self_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.self_prompts < 0:
            raise ValueError(f"self_prompts must be >= 0, got {self.self_prompts}")
        if self.sampled_answers < 0:
            raise ValueError(f"sampled_answers must be >= 0, got {self.sampled_answers}")
        if self.vocab_subset < 0:
            raise ValueError(f"vocab_subset must be >= 0 (0: the full LM head), got {self.vocab_subset}")
        if len(set(self.feature_layers)) != len(self.feature_layers) or any(i < 1 for i in self.feature_layers):
            raise ValueError(f"feature_layers must be distinct layer numbers >= 1, got {list(self.feature_layers)}")
        if self.unroll > self.seq_len:
            raise ValueError(f"unroll ({self.unroll}) must be at most seq_len ({self.seq_len}): a window of seq_len "
                             f"positions has no position for a draft {self.unroll} tokens ahead")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        for name in ("feature_weight", "distill_weight"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not 0 <= self.data_minutes < math.inf:
            raise ValueError(f"data_minutes must be a finite number >= 0 (0: no limit), got {self.data_minutes}")
