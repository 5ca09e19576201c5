"""Comparing two tokenizers: the same vocabulary, or the tokens two vocabularies share by their strings.

A draft model may come with another tokenizer than the target's (another model family). Which one
it has is read from the two tokenizers, never from an option: the same vocabulary (every token
string at the same id) lets the draft model's tokens and probabilities be verified as they are
(`drafters.draft_model`); another one needs them carried over to the target's tokens
(`drafters.cross_text`, `drafters.cross_vocab`).

A token's *string* is the text it decodes to alone. Tokenizers write a leading space in their
own way (byte-level BPE's "Ġ", SentencePiece's "▁"), so two vocabularies are compared by these
strings, not by their token names. Tokens without a string of their own are left out: special
tokens, the empty string, and tokens that hold part of a UTF-8 character (byte-level pieces and
byte-fallback tokens of non-ASCII bytes decode to U+FFFD alone). A byte-fallback token of an ASCII
byte decodes to the same string as an ordinary token; a string's tokens are then told apart by the
one its tokenizer encodes it to (`token_strings`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

# A draft model whose vocabulary shares fewer token strings than this share of the smaller of the
# two vocabularies is refused: SmolLM2 (49,152 tokens) and Gemma 3 (262,144) share 46,031 strings,
# 94% of SmolLM2's; a vocabulary of another script or of whole words shares few.
MIN_SHARED = 0.1


def same_vocabulary(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> bool:
    """Whether the two tokenizers map every token to the same id."""
    return target.get_vocab() == draft.get_vocab()


def token_strings(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    """The string of every token that has one, to its ids. Where several tokens share a string (Gemma 3's
    byte-fallback token <0x31> and its ordinary "1" both decode to "1"), the one the tokenizer encodes
    the string to comes first: that is the one a model reads and writes; the others follow by id."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    strings: dict[str, list[int]] = {}
    for i, text in zip(ids, texts):
        if text and "\ufffd" not in text:
            strings.setdefault(text, []).append(i)
    for text, same in strings.items():
        if len(same) > 1:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] in same:
                same.sort(key=lambda i: (i != encoded[0], i))
    return strings


@dataclass(frozen=True)
class SharedVocabulary:
    """The draft tokens whose string is also a target token's, and the target token of each.

    `draft_ids` [n] and `target_ids` [n] pair them up (every draft token of a shared string maps to
    the target token of that string that its tokenizer encodes it to, so a string's draft mass
    lands where the target puts its own); `to_draft` [target_width] gives, for a shared target token,
    the draft token fed to the draft model for it (the one the draft's tokenizer encodes the string
    to; -1 for a target token not shared).
    """

    draft_ids: Tensor  # [n] int64
    target_ids: Tensor  # [n] int64
    to_draft: Tensor  # [target_width] int64
    target_width: int  # the target's logits width
    strings: int  # shared strings
    share: float  # shared strings / the smaller vocabulary's strings

    def __len__(self) -> int:
        return self.strings


def shared_vocabulary(
    target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, target_width: int, draft_width: int
) -> SharedVocabulary:
    """The tokens of `draft` (logits width `draft_width`) that `target` (width `target_width`) has too."""
    target_strings = within(token_strings(target), target_width)
    draft_strings = within(token_strings(draft), draft_width)
    shared = [s for s in draft_strings if s in target_strings]
    pairs = [(d, target_strings[s][0]) for s in shared for d in draft_strings[s]]
    draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
    target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
    to_draft = torch.full((target_width,), -1, dtype=torch.long)
    to_draft[[target_strings[s][0] for s in shared]] = torch.tensor([draft_strings[s][0] for s in shared], dtype=torch.long)
    smaller = max(1, min(len(target_strings), len(draft_strings)))
    return SharedVocabulary(draft_ids, target_ids, to_draft, target_width, len(shared), len(shared) / smaller)


def within(strings: dict[str, list[int]], width: int) -> dict[str, list[int]]:
    """`strings` with only the ids below `width` (a model's logits width), strings left without one dropped."""
    kept = {s: [i for i in ids if i < width] for s, ids in strings.items()}
    return {s: ids for s, ids in kept.items() if ids}


def check_shared(shared: SharedVocabulary, name: str) -> SharedVocabulary:
    """`shared`, or a one-line error when the vocabularies share almost nothing (`MIN_SHARED`)."""
    if shared.share < MIN_SHARED:
        raise ValueError(
            f"the draft model {name} has another tokenizer, and its vocabulary shares {shared.strings} token strings "
            f"({shared.share:.1%} of the smaller vocabulary) with the target's: too few to draft "
            f"(at least {MIN_SHARED:.0%} needed)"
        )
    return shared
