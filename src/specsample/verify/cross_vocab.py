"""Drafts of a draft model with another tokenizer, made verifiable exactly (pure functions).

After Timor et al. (2025), lossless speculative decoding for heterogeneous vocabularies. Terms
as in `verify.chain`; the *draft vocabulary* is the draft model's, and what the target verifies
is always made of target tokens.

- String-level exact match (`retokenized_draft`): the draft model's tokens are decoded to text,
  the *continuation*, which the target's tokenizer encodes into draft_tokens of the target's
  vocabulary. They are verified as point masses (draft_probs None): draft token x at position i
  is accepted with probability target_probs[i, x], else the recovered token is drawn from
  target_probs[i] without x. The draft model drafts greedily, so the draft is a function of the
  context and this is rejection sampling of a point mass: the output follows the target exactly
  at every temperature, however the two tokenizers split the text.
- Token-level intersection (`intersection_probs`): the draft model's distribution over its
  vocabulary, restricted to the tokens whose string the target's vocabulary has too
  (`vocabulary.SharedVocabulary`), renormalised and carried over to the target's ids, is a
  distribution over target tokens. Draft tokens drawn from it are verified with it as
  draft_probs by modified rejection sampling (`verify.chain.rejection_sample`), exact as for any
  drafter with probabilities. The draft model's mass on tokens the target lacks is given up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from specsample.vocabulary import SharedVocabulary


def intersection_probs(draft_vocab_probs: Tensor, shared: SharedVocabulary) -> Tensor:
    """draft_probs [target_width] from the draft model's probabilities [draft_vocab]: the mass of
    the shared tokens, renormalised, on their target ids. All zeros where the draft model puts no
    mass on a shared token (then it drafts nothing)."""
    mass = torch.zeros(shared.target_width, dtype=torch.float32)  # [target_width]
    mass.index_add_(0, shared.target_ids, draft_vocab_probs[shared.draft_ids].float())
    total = mass.sum()
    return mass / total if total > 0 else mass


def retokenized_draft(tokenizer: PreTrainedTokenizerBase, tail_ids: Sequence[int], continuation: str) -> list[int]:
    """draft_tokens (target ids) for the text `continuation` after the target tokens `tail_ids`
    (the last few of the text).

    The tokens the target's tokenizer gives the continuation after the tail's text, where the
    tail keeps its own tokens; where it does not (the two texts' token boundaries do not line up,
    as when the tail ends inside a word the continuation completes), the tokens of the
    continuation alone. Cut to the longest prefix whose text, after the tail's, is a prefix of
    the continuation and ends on a whole character (a token holding part of a UTF-8 character
    counts only with the tokens that complete it).
    """
    tail = list(tail_ids)
    tail_text = decode(tokenizer, tail)
    before = encode(tokenizer, tail_text)
    after = encode(tokenizer, tail_text + continuation)
    candidate = after[len(before) :] if after[: len(before)] == before else encode(tokenizer, continuation)
    expected = tail_text + continuation
    kept = 0
    for n in range(1, len(candidate) + 1):
        text = decode(tokenizer, tail + candidate[:n])
        if not expected.startswith(text.rstrip("\ufffd")):
            break
        if not text.endswith("\ufffd"):
            kept = n
    return candidate[:kept]


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
