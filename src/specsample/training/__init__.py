"""Self-distillation of a draft head on the CPU: generate, extract features, train, evaluate.

0. Optionally the target writes prompts of its own (Magpie): sampled from where
   a user's message begins in its chat template. They add the variety of
   requests that more answers to the same prompts do not (`generate`).
1. The target answers the training prompts with batched greedy `generate`
   (much faster per token than one sequence at a time).
2. One teacher-forced forward pass over each prompt + answer gives the target's
   final normed hidden states (the features), and with `feature_layers` the
   outputs of those decoder layers too (EAGLE-3 fuses low, middle and high
   layers: the final state is shaped for the next token only, earlier layers
   say more about the context); they are stored in float16 shards, so an
   interrupted run resumes where it stopped (`generate`; read back by `dataset`).
3. The head learns to predict the next feature from (feature, next token), as
   EAGLE does: a regression loss on the feature plus a distillation loss between
   the target's and the head's distributions over the head's token subset. With
   `unroll` > 1 it also trains on its own predicted features, each pass attending
   to exactly what drafting step d attends to (the target's features up to the
   anchor, its own predictions after it: HASS, EAGLE-3's training-time test)
   (`objective`).
4. A held-out split of the sequences estimates the greedy mean accepted length at
   K = 4 during training; at the end the head drafts for the real engine on
   held-out prompts and the measured figures are reported (`train`).

Prompts are read by `specsample.prompts`, as the benchmarks read them.
"""

from specsample.training.dataset import data_shards
from specsample.training.options import TrainOptions
from specsample.training.train import train

__all__ = ["TrainOptions", "data_shards", "train"]
