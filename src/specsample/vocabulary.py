"""Comparing two tokenizers: the same vocabulary, or the tokens two vocabularies share by their strings.

A draft model may come with another tokenizer than the target's (another model family). Which one
it has is read from the two tokenizers, never from an option: the same vocabulary (every token
string at the same id) lets the draft model's tokens and probabilities be verified as they are
(`drafters.draft_model`); another one needs them carried over to the target's tokens
(`drafters.cross_text`, `drafters.cross_vocab`).

A token's *string* is the text it adds when decoded after an anchor token ("a"). Tokenizers write a
leading space in their own way (byte-level BPE's "Ġ", SentencePiece's "▁"), so two vocabularies are
compared by these strings, not by their token names; and some decoders (Llama 2's, Mistral's,
TinyLlama's) strip the leading space of a whole text, so a token decoded alone would lose its own
("▁the" would read "the", the string of the token that has no space). Tokens without a string of
their own are left out: special tokens, the empty string, and tokens that hold part of a UTF-8
character (byte-level pieces and byte-fallback tokens of non-ASCII bytes decode to U+FFFD alone). A
byte-fallback token of an ASCII byte decodes to the same string as an ordinary token; a string's
tokens are then told apart by the one its tokenizer encodes it to (`token_strings`).
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


ANCHOR = "a"  # decoded before each token: a decoder that strips a text's first space strips the anchor's


def token_strings(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    """The string of every token that has one, to its ids. Where several tokens share a string (Gemma 3's
    byte-fallback token <0x31> and its ordinary "1" both decode to "1"), the one the tokenizer encodes
    the string to comes first: that is the one a model reads and writes; the others follow by id."""
    special = special_ids(tokenizer)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    anchor = tokenizer.encode(ANCHOR, add_special_tokens=False)
    prefix = tokenizer.decode(anchor, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    texts = decoded(tokenizer, [[*anchor, i] for i in ids])
    strings: dict[str, list[int]] = {}
    for i, text in zip(ids, texts):
        text = text[len(prefix):] if text.startswith(prefix) else ""
        if text and "\ufffd" not in text:
            strings.setdefault(text, []).append(i)
    for text, same in strings.items():
        if len(same) > 1:
            encoded = encoded_token(tokenizer, text, anchor)
            if encoded in same:
                same.sort(key=lambda i: (i != encoded, i))
    return strings


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokenizer's special tokens: its named ones (BOS, EOS, ...) and every token added as special
    (Gemma 3's <end_of_turn> among its 6,000 others, which `all_special_ids` leaves out)."""
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(tokenizer.all_special_ids) | added


def decoded(tokenizer: PreTrainedTokenizerBase, sequences: list[list[int]]) -> list[str]:
    """Each of `sequences` decoded, special tokens and spaces as they are; through a fast tokenizer's own
    `decode_batch` where it has one (transformers' `batch_decode` spends 2 s of Gemma 3's 262,144 on
    converting each list)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(sequences, skip_special_tokens=False)
    return tokenizer.batch_decode(sequences, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encoded_token(tokenizer: PreTrainedTokenizerBase, text: str, anchor: list[int]) -> int | None:
    """The one token `tokenizer` encodes `text` to, alone or after the anchor (where a leading space of
    the text's own would be read as a word's start: Llama 2's " the" alone is "▁", "▁the"); None if neither
    is one token."""
    alone = tokenizer.encode(text, add_special_tokens=False)
    after = tokenizer.encode(ANCHOR + text, add_special_tokens=False)
    after = after[len(anchor):] if after[: len(anchor)] == anchor else []
    return next((ids[0] for ids in (alone, after) if len(ids) == 1), None)


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
