"""A draft model with another tokenizer than the target's: detected, and verified exactly by both methods.

The tokenizers are made here: BPE tokenizers trained with `tokenizers` on a few paragraphs, the
target's SentencePiece-like (Metaspace, "▁"), the draft's byte-level ("Ġ", as GPT-2's), with other
merges, vocabulary sizes and ids. The models are tiny random Llamas; a draft model resembles its
target through `transplant` (the target's layers, and its rows for the tokens both vocabularies
share). The chi-square machinery, N_SAMPLES and ALPHA are test_lossless.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import uvicorn
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import test_lossless as lossless
from specsample.cli import main
from specsample.drafters import NoDrafter
from specsample.drafters.cross_vocab import cross_vocab_drafter
from specsample.drafters.draft_text import DraftText
from specsample.engine import decode
from specsample.models.loading import LoadedModel
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from specsample.verify import ChainVerifier
from specsample.verify.check import accept_all
from specsample.verify.cross_vocab import intersection_probs, retokenized_draft
from specsample.vocabulary import SharedVocabulary, same_vocabulary, shared_vocabulary, special_ids, token_strings

from conftest import tiny_llama

# Three letters and spaces: the target's vocabulary is small enough to enumerate (test_lossless.VOCAB).
SMALL = ["abc ab ba cab bca aab bb  ca", "a b c ab abc cba bac acb", "cc aa bb abab baba caca"] * 5
SMALL_DRAFT = ["bca cab  abc ba", "cba acb ab bac aa", "baba abab ccc a b"] * 5
RICH = [
    "Café déjà vu: naïve façade, 12 345 678 und Größe 9.75 €.",
    "Emoji 😀🎉 and 🚀 rockets   with    runs of spaces\tand tabs.",
    "The 3 quick brown foxes jumped over 42 lazy dogs in 2024.",
    "Ça coûte 1 000 000 ¥ — ñandú, São Paulo, Zürich, crème brûlée.",
] * 3
PROMPT_TEXT = "Café  😀 déjà 12 345   vu 🎉"


def metaspace_bpe(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A SentencePiece-like BPE: spaces as "▁", characters of the corpus as its alphabet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def byte_level_bpe(corpus: list[str], vocab_size: int, all_bytes: bool = True) -> PreTrainedTokenizerFast:
    """A GPT-2-like byte-level BPE (spaces as "Ġ"), its special tokens first so that its ids differ."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if all_bytes else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|end|>", "<|pad|>", "<|sep|>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")


def transplant(target: LlamaForCausalLM, vocab_size: int, shared: SharedVocabulary, seed: int) -> LlamaForCausalLM:
    """A draft model of `vocab_size` tokens that resembles `target`: its layers, its embedding and
    output rows on the shared tokens (plus noise); random rows elsewhere."""
    draft = tiny_llama(vocab_size, seed=seed, init_scale=lossless.INIT_SCALE)
    state = {k: v for k, v in target.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    draft.load_state_dict(state, strict=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for rows_of in (lambda m: m.model.embed_tokens.weight, lambda m: m.lm_head.weight):
            rows = rows_of(target)[shared.target_ids]
            rows_of(draft)[shared.draft_ids] = rows + 0.1 * rows.std() * torch.randn(rows.shape, generator=gen)
    return draft


def loaded(model, tokenizer) -> LoadedModel:
    return LoadedModel(model, tokenizer, "tiny", frozenset(), 0.0)


class Pair:
    """A target and a draft model with their two tokenizers."""

    def __init__(self, target_tokenizer, draft_tokenizer, seed: int = 0) -> None:
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_model = tiny_llama(len(target_tokenizer), seed=seed, init_scale=lossless.INIT_SCALE)
        shared = shared_vocabulary(target_tokenizer, draft_tokenizer, len(target_tokenizer), len(draft_tokenizer))
        self.draft_model = transplant(self.target_model, len(draft_tokenizer), shared, seed=seed + 1)

    def drafter(self, method: str):
        target = loaded(self.target_model, self.target_tokenizer)
        draft = loaded(self.draft_model, self.draft_tokenizer)
        return cross_vocab_drafter(method, target, lossless.as_target(self.target_model), draft, lossless.as_target(self.draft_model))


@pytest.fixture(scope="module")
def small() -> Pair:
    target_tokenizer = metaspace_bpe(SMALL, lossless.VOCAB)
    assert len(target_tokenizer) == lossless.VOCAB
    return Pair(target_tokenizer, byte_level_bpe(SMALL_DRAFT, 30, all_bytes=False))


@pytest.fixture(scope="module")
def rich() -> Pair:
    return Pair(metaspace_bpe(RICH, 160), byte_level_bpe(RICH, 330))


def test_another_tokenizer_is_detected_and_mapped_by_strings(small):
    t, d = small.target_tokenizer, small.draft_tokenizer
    assert same_vocabulary(t, t) and not same_vocabulary(t, d)
    shared = shared_vocabulary(t, d, len(t), len(d))
    assert len(shared) > 0.5 * len(t)
    assert not torch.equal(shared.draft_ids, shared.target_ids)  # other ids for the same strings
    for draft_id, target_id in zip(shared.draft_ids.tolist(), shared.target_ids.tolist()):
        assert d.decode([draft_id]) == t.decode([target_id])
        assert int(shared.to_draft[target_id]) == draft_id
    assert " ab" in {t.decode([i]) for i in shared.target_ids.tolist()}  # "▁ab" and "Ġab" are one string


def byte_fallback_tokenizer(pieces: list[str]) -> PreTrainedTokenizerFast:
    """A SentencePiece-like tokenizer with byte-fallback tokens (Gemma 3's kind): "<0x31>" decodes to "1" as the
    ordinary "1" does, and the tokenizer encodes "1" to the ordinary one. Ids in the order of `pieces`."""
    tok = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_a_string_two_tokens_decode_to_maps_to_the_one_its_tokenizer_encodes_it_to():
    """Gemma 3's byte tokens: the draft mass of both draft tokens of "1" lands on the target's ordinary "1", the
    one its tokenizer (and so its model) uses, and the draft model is fed its own ordinary "1"."""
    target = byte_fallback_tokenizer(["<eos>", "<0x31>", "<0x61>", "x", "1", "a"])
    draft = byte_fallback_tokenizer(["<eos>", "a", "<0x61>", "1", "<0x31>", "y"])
    assert target.encode("1", add_special_tokens=False) == [4] and target.decode([1]) == "1"
    shared = shared_vocabulary(target, draft, len(target), len(draft))
    assert len(shared) == 2  # "1" and "a"
    assert sorted(zip(shared.draft_ids.tolist(), shared.target_ids.tolist())) == [(1, 5), (2, 5), (3, 4), (4, 4)]
    assert shared.to_draft.tolist() == [-1, -1, -1, -1, 3, 1]
    draft_vocab_probs = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.0])
    assert intersection_probs(draft_vocab_probs, shared).tolist() == pytest.approx([0, 0, 0, 0, 0.7, 0.3])


def llama_style_bpe(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Llama 2's kind of SentencePiece BPE (Mistral's, TinyLlama's): "▁" before the text's first word, byte
    fallback, and a decoder that strips the decoded text's first space."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_a_word_keeps_its_leading_space_where_the_decoder_strips_a_text_s_first(rich):
    """Decoded alone, Llama 2's "▁cat" reads "cat" (its decoder strips a text's first space): its string is read
    after an anchor, " cat", so its mass lands on the byte-level vocabulary's "Ġcat", not on "cat", both ways."""
    llama, byte_level = llama_style_bpe(RICH, 220), rich.draft_tokenizer
    for target, draft in ((byte_level, llama), (llama, byte_level)):
        shared = shared_vocabulary(target, draft, len(target), len(draft))
        words = 0
        for draft_id, target_id in zip(shared.draft_ids.tolist(), shared.target_ids.tolist()):
            names = draft.convert_ids_to_tokens(draft_id), target.convert_ids_to_tokens(target_id)
            if all(len(name) > 1 and not name.startswith("<0x") for name in names):  # a word piece on both sides
                starts = [name[0] in "▁Ġ" for name in names]
                assert starts[0] == starts[1], names
                words += starts[0]
        assert words >= 5, words


def test_every_special_token_ends_a_text_draft_and_has_no_string(rich):
    """A token added as special (Gemma 3's <end_of_turn>) is not in transformers' `all_special_ids`: still, a
    text draft ends at it, and no target token shares its string."""
    tokenizer = byte_level_bpe(RICH, 330)
    tokenizer.add_tokens([AddedToken("<end_of_turn>", special=True)])
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end not in tokenizer.all_special_ids
    assert end in special_ids(tokenizer) and all(end not in ids for ids in token_strings(tokenizer).values())
    assert end in DraftText(lossless.as_target(rich.draft_model), rich.target_tokenizer, tokenizer).stops


def test_intersection_probs_restricts_and_renormalises(small):
    t, d = small.target_tokenizer, small.draft_tokenizer
    shared = shared_vocabulary(t, d, len(t), len(d))
    draft_vocab_probs = torch.rand(len(d), generator=torch.Generator().manual_seed(0))
    draft_vocab_probs /= draft_vocab_probs.sum()
    probs = intersection_probs(draft_vocab_probs, shared)  # [target vocab]
    assert probs.shape == (len(t),) and abs(float(probs.sum()) - 1) < 1e-6
    expected = torch.zeros(len(t))
    expected[shared.target_ids] = draft_vocab_probs[shared.draft_ids]
    torch.testing.assert_close(probs, expected / expected.sum())
    unshared = torch.ones(len(d), dtype=torch.bool)
    unshared[shared.draft_ids] = False
    only_unshared = unshared.float() / unshared.sum()
    assert float(intersection_probs(only_unshared, shared).sum()) == 0  # nothing to draft


@pytest.mark.parametrize(
    ("before", "continuation"),
    [("Café", " déjà vu"), ("Caf", "é 😀🎉 12"), ("runs", "   of    spaces"), ("12 3", "45 678"), ("😀", "🎉🚀 and")],
)
def test_retokenized_draft_continues_the_text(rich, before, continuation):
    for tokenizer in (rich.target_tokenizer, rich.draft_tokenizer):
        tail = tokenizer.encode(before)
        tokens = retokenized_draft(tokenizer, tail, continuation)
        assert tokens, (before, continuation)
        text = tokenizer.decode(tail + tokens)
        assert text == before + continuation  # here every character is in both vocabularies


def test_retokenized_draft_stops_at_a_partial_character(rich):
    tokenizer = rich.draft_tokenizer  # byte-level: an emoji is several tokens
    tail = tokenizer.encode("Emoji")
    whole = retokenized_draft(tokenizer, tail, " 😀")
    assert tokenizer.decode(tail + whole) == "Emoji 😀"
    # text that stops inside the emoji (its decoding ends in U+FFFD) keeps only whole characters
    partial = tokenizer.decode(tokenizer.encode(" 😀")[:-1])
    assert partial.endswith("\ufffd")
    assert tokenizer.decode(tail + retokenized_draft(tokenizer, tail, partial)) == "Emoji "


@pytest.mark.parametrize("method", ["text", "intersection"])
@pytest.mark.parametrize("name", ["t1", "t0.7-top_p0.9"])
def test_cross_vocab_drafting_keeps_the_target_distribution(small, method, name):
    params = lossless.PARAMS[name]
    check_it_drafts(small, method, params)
    observed = lossless.sampled_counts(small.target_model, small.drafter(method), params, seed=2024)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(small.target_model, params))
    assert p > lossless.ALPHA, f"{method} {name}: p = {p:.2e}"


@pytest.mark.parametrize("method", ["text", "intersection"])
def test_broken_verifier_is_rejected(small, method, monkeypatch):
    monkeypatch.setattr(lossless, "N_SAMPLES", 10_000)  # far more than accepting every draft token needs to show
    params = lossless.PARAMS["t1"]
    observed = lossless.sampled_counts(
        small.target_model, small.drafter(method), params, seed=2024, verifier=ChainVerifier(sample=accept_all)
    )
    p = lossless.chi_square_p(observed, lossless.exact_distribution(small.target_model, params))
    assert p < lossless.ALPHA, f"{method}: accept_all passed, p = {p:.2e}"


def check_it_drafts(pair: Pair, method: str, params: SamplingParams) -> None:
    """The test would be vacuous if the drafter never proposed, or the target never accepted."""
    stats = Stats()
    generator = torch.Generator().manual_seed(0)
    drafter = pair.drafter(method)
    for _ in range(200):
        for _ in decode(
            lossless.as_target(pair.target_model), drafter, FixedK(lossless.K), lossless.PROMPT, params,
            max_new_tokens=lossless.SEQ_LEN, eos_token_ids=frozenset(), random=GeneratorSource(generator), stats=stats,
        ):
            pass
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0, (stats.drafted_tokens, stats.accepted_tokens)


def greedy(pair: Pair, drafter, prompt: torch.Tensor, stats: Stats) -> list[int]:
    steps = decode(
        lossless.as_target(pair.target_model), drafter, FixedK(4), prompt, SamplingParams(temperature=0),
        max_new_tokens=60, eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats,
    )
    return [t for step in steps for t in step]


@pytest.mark.parametrize("direction", ["metaspace-target", "byte-level-target"])
@pytest.mark.parametrize("method", ["text", "intersection", "auto"])
def test_greedy_output_is_the_targets(rich, direction, method):
    pair = rich if direction == "metaspace-target" else Pair(rich.draft_tokenizer, rich.target_tokenizer, seed=3)
    prompt = torch.tensor(pair.target_tokenizer.encode(PROMPT_TEXT))
    plain = greedy(pair, NoDrafter(), prompt, Stats())
    stats = Stats()
    assert greedy(pair, pair.drafter(method), prompt, stats) == plain
    assert stats.drafted_tokens > 0


@pytest.fixture(scope="module")
def bad_drafts(tmp_path_factory) -> dict[str, Path]:
    """Draft model directories: one without tokenizer files, one whose vocabulary shares almost nothing
    with the tiny word-level target's (w0 .. w63)."""
    root = tmp_path_factory.mktemp("bad-drafts")
    tokenizer = metaspace_bpe(RICH, 160)
    no_tokenizer = root / "no-tokenizer"
    tiny_llama(160, seed=5).save_pretrained(no_tokenizer, safe_serialization=True)
    unrelated = root / "unrelated"
    tiny_llama(160, seed=6).save_pretrained(unrelated, safe_serialization=True)
    tokenizer.save_pretrained(unrelated)
    return {"no-tokenizer": no_tokenizer, "unrelated": unrelated}


@pytest.mark.parametrize(("draft", "message"), [("no-tokenizer", "tokenizer"), ("unrelated", "shares")])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_draft_model_gives_one_line_and_exit_2(capsys, monkeypatch, tiny_dir, bad_drafts, draft, message, command):
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: pytest.fail("served with a bad draft model"))
    args = ["generate", "w1 w2", "--no-chat"] if command == "generate" else ["serve"]
    with pytest.raises(SystemExit) as done:
        main([*args, "--model", str(tiny_dir), "--drafter", str(bad_drafts[draft])])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("method", ["text", "intersection"])
def test_the_draft_models_prefill_counts_as_prefill_not_as_drafting(rich, method):
    """The draft model fills its cache at the first draft (`DraftText.sync`); that prefill is the draft's
    `setup_seconds`, so the K policy does not price draft tokens with it."""
    from test_engine import SlowPrefill

    slow = SlowPrefill(lossless.as_target(rich.draft_model), 0.3)
    drafter = cross_vocab_drafter(method, loaded(rich.target_model, rich.target_tokenizer),
                                  lossless.as_target(rich.target_model), loaded(rich.draft_model, rich.draft_tokenizer), slow)
    slow.prefills = 0  # the factory timed the draft model's pass (`drafters.cost`)
    prompt = torch.tensor(rich.target_tokenizer.encode(PROMPT_TEXT))
    stats = Stats()
    assert greedy(rich, drafter, prompt, stats) == greedy(rich, NoDrafter(), prompt, Stats())
    assert slow.prefills == 1 and stats.drafted_tokens > 0
    assert stats.prefill_seconds >= 0.3 > stats.draft_seconds


def test_near_the_draft_models_window_it_drafts_what_fits(rich):
    """A text a few positions short of the draft model's window: of K = 8 the draft tokens that fit (the
    text and all but the last draft token) are drafted, not none; past the window, none."""
    text = rich.drafter("text").text
    window = lossless.as_target(rich.draft_model).max_length
    long_text = PROMPT_TEXT * (window // 4)

    def begin(characters: int) -> int:
        text.begin(rich.target_tokenizer.encode(long_text[:characters]))
        return len(text.encoding())

    n = next(n for n in range(1, len(long_text)) if begin(n) >= window - 4)  # a character adds at most 4 tokens
    length = begin(n)
    assert 1 < text.sync(8) == window - length + 1 < 8
    assert begin(len(long_text)) > window and text.sync(8) == 0
