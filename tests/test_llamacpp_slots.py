"""Slots on the llamacpp backend (`LlamaCppSlots`): llama.cpp's sequence ids, a KV cache stream each.

A row's logits in a pass with other slots' rows must be bitwise the target's own `score` of the
same tokens after the same prefill, whatever the other rows, their number and order (slots
consecutive or not, segments of unequal lengths, which llama.cpp splits into several passes);
then each request's tokens in a batch (`batch.Batch`) equal those it gets decoded alone, greedy
and seeded, on a tiny GGUF written here and on the bundled Q4_1 file.
"""

from __future__ import annotations

import pytest
import torch

from specsample.models.llamacpp import SLOT_ROWS, LlamaCppSlots, LlamaCppTarget, quantize
from specsample.models.loading import bundled_gguf
from specsample.models.target import Slots, SlottedTarget

from test_batch import (check_cancelled_request_frees_its_slot, check_chunked_prefill_batch_equals_alone,
                        check_greedy_batch_equals_alone, check_seeded_sampling_batch_equals_alone)
from test_llamacpp import VOCAB, tiny_gguf, tiny_model  # noqa: F401  (fixtures this module uses)
from test_slots import check_invariance, tokens

pytestmark = pytest.mark.llamacpp  # skipped without llama-cpp-python (conftest.py)


@pytest.fixture(scope="module")
def target(tiny_gguf) -> LlamaCppTarget:  # noqa: F811
    return LlamaCppTarget(tiny_gguf, n_threads=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_tiny_rows_are_batch_invariant(target, seed):
    assert isinstance(target, SlottedTarget)
    check_invariance(target, contexts=[5, 40, 1, 17, 90], news=[1, 4, 9, 0, 3], seed=seed)


def test_rows_of_slots_that_are_not_consecutive_nor_equal_are_invariant(target):
    """Slots 0, 2 and 5 of 6, 1, 6 and 2 new tokens: llama.cpp runs them as several passes, and each
    row is still the target's alone."""
    slots = target.slots(6)
    segments, expected = [], []
    for slot, (length, n) in zip((5, 0, 2), ((30, 2), (12, 6), (50, 1))):
        context, new = tokens(length, VOCAB, slot), tokens(n, VOCAB, 10 + slot)
        slots.prefill(slot, context)
        segments.append((slot, new))
        expected.append(alone_scores(target, context, new))
    for logits, want in zip(slots.score(segments), expected):
        assert torch.equal(logits, want)


def test_eight_slots_of_eight_rows_are_each_the_target_s_alone(tmp_path):
    """64 rows in one pass (eight requests verifying K = 7), which llama.cpp would run as one ubatch of its
    tiled K-quant products on a Q4_K_M copy of the bundled model (max |logit difference| 0.8 to 1.5, 3 of 8
    argmaxes changed): the context's ubatches stay below 64 rows."""
    path = quantize(bundled_gguf(), tmp_path / "Q4_K_M.gguf", "Q4_K_M", threads=1)
    target = LlamaCppTarget(path, n_threads=1, max_length=64)
    slots = target.slots(8)
    segments, expected = [], []
    for slot in range(8):
        context, new = tokens(20 + slot, 49152, slot), tokens(8, 49152, 10 + slot)
        slots.prefill(slot, context)
        segments.append((slot, new))
        expected.append(alone_scores(target, context, new).clone())
    for logits, want in zip(slots.score(segments), expected):
        assert torch.equal(logits, want)


def alone_scores(target: LlamaCppTarget, context: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    target.prefill(context)
    return target.score(new)


@pytest.mark.parametrize("name", ["none", "ngram", "suffix"])
def test_greedy_batch_equals_alone(target, name):
    check_greedy_batch_equals_alone(target, name)


def test_seeded_sampling_batch_equals_alone(target):
    check_seeded_sampling_batch_equals_alone(target)


def test_chunked_prefill_batch_equals_alone(target):
    check_chunked_prefill_batch_equals_alone(target)


def test_cancelled_request_frees_its_slot(target):
    check_cancelled_request_frees_its_slot(target)


def test_rollback_per_slot_and_bounds(target):
    slots = target.slots(2)
    assert isinstance(slots, Slots) and isinstance(slots, LlamaCppSlots)
    slots.prefill(0, tokens(10, VOCAB, 0))
    slots.prefill(1, tokens(3, VOCAB, 1))
    slots.rollback(0, 4)
    assert (slots.length(0), slots.length(1)) == (4, 3)
    with pytest.raises(ValueError, match="cannot roll slot 1 back to 5"):
        slots.rollback(1, 5)
    with pytest.raises(ValueError, match="not distinct"):
        slots.score([(0, tokens(1, VOCAB, 2)), (0, tokens(1, VOCAB, 3))])
    with pytest.raises(ValueError, match="not distinct"):
        slots.score([(2, tokens(1, VOCAB, 2))])
    with pytest.raises(ValueError, match=f"more than {SLOT_ROWS}"):
        slots.score([(1, tokens(SLOT_ROWS + 1, VOCAB, 2))])
    with pytest.raises(ValueError, match="exceed max_length"):
        slots.prefill(1, tokens(target.max_length + 1, VOCAB, 2))
    assert slots.length(1) == 0  # the refused prefill reset the slot, as a prefill does
    assert [t.shape for t in slots.score([(0, tokens(0, VOCAB, 0)), (1, tokens(2, VOCAB, 0))])] == [(0, VOCAB), (2, VOCAB)]
    assert [t.shape for t in slots.score([(0, tokens(0, VOCAB, 0))])] == [(0, VOCAB)]
    with pytest.raises(ValueError, match="at least one slot"):
        target.slots(0)


def test_bundled_rows_are_batch_invariant():
    """The bundled Q4_1 file, with caches past 512 positions (where flash attention, off here, would
    split one token's pass)."""
    check_invariance(LlamaCppTarget(bundled_gguf(), n_threads=1), contexts=[600, 7, 130, 60], news=[5, 1, 8, 3], seed=3)


def test_a_long_prompt_filled_chunk_by_chunk_in_a_slot_is_the_target_s():
    """A batch's chunked prefill on the bundled file: a 600-token prompt filled 100 positions a call, with
    another slot's rows scored between the calls, gives the next token the logits of the target's one
    prefill (its 256-position blocks take the tiled kernels: each is decoded whole once its last chunk
    arrives, `llamacpp.CachedSequence`)."""
    target = LlamaCppTarget(bundled_gguf(), n_threads=1, max_length=1024)
    ids, other = tokens(601, 49152, 4), tokens(40, 49152, 5)
    target.prefill(ids[:-1])
    expected = target.score(ids[-1:]).clone()
    slots = target.slots(2)
    slots.prefill(0, other[:30])
    assert slots.prefill(1, ids[:-1], budget=100) == 100
    for at in range(100, 600, 100):
        slots.score([(0, other[30 + at // 100 : 31 + at // 100])])
        slots.extend(1, ids[at : at + 100])
    assert slots.length(1) == 600
    assert torch.equal(slots.score([(1, ids[-1:])])[0], expected)


def test_generate_batch_equals_generate_on_llamacpp():
    """The Python API on the llamacpp backend: each completion of a batch is `generate`'s alone."""
    from specsample.api import SpecSampler

    sampler = SpecSampler.load(drafter="suffix", backend="llamacpp", threads=1)
    texts = ["Name three rivers.", "Count from one to twenty.", "Say hello."]
    greedy = dict(max_new_tokens=16, temperature=0, k=3)
    for text, completion in zip(texts, sampler.generate_batch(texts, max_batch=2, **greedy)):
        assert completion.token_ids == sampler.generate(text, **greedy).token_ids


def test_a_k_above_what_a_slot_scores_in_one_pass_is_cut_to_it():
    """K = 40 with a prediction that drafts that far: a slot scores at most SLOT_ROWS rows a pass, so the
    batch drafts SLOT_ROWS - 1 (it failed every running request), with generate's greedy tokens."""
    from specsample.api import SpecSampler

    sampler = SpecSampler.load(drafter="suffix", backend="llamacpp", threads=1)
    text = "one two three four five six seven eight nine ten " * 8
    greedy = dict(max_new_tokens=60, temperature=0, k=40, prediction=text)
    (completion,) = sampler.generate_batch(["Repeat: " + text], max_batch=2, **greedy)
    assert completion.token_ids == sampler.generate("Repeat: " + text, **greedy).token_ids
    assert 0 < max(completion.stats.chosen_k) and completion.stats.drafted_tokens <= (SLOT_ROWS - 1) * completion.stats.steps


def test_the_batching_server_on_llamacpp_answers_each_request_as_alone():
    """`serve --backend llamacpp --max-batch 3`: six concurrent streaming requests through the official
    `openai` client, each answer the one `generate` gives its prompt alone (greedy, and seeded)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from specsample.api import SpecSampler
    from specsample.server import create_app
    from test_server import metrics, serving

    sampler = SpecSampler.load(drafter="suffix", backend="llamacpp", threads=1)
    asks = [dict(prompt=f"List {n} fruits, one a line.", temperature=0 if n % 2 else 1.0, seed=n, max_tokens=12 + n)
            for n in range(2, 8)]

    def ask(client: openai.OpenAI, request: dict) -> str:
        chunks = client.completions.create(model="specsample", stream=True, **request)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    with serving(create_app(sampler, k="auto", max_queue=16, max_batch=3)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda request: ask(client, request), asks))
        samples = metrics(url)
    assert samples[("specsample_batch_size_sum", ())] / samples[("specsample_batch_size_count", ())] > 1  # batched
    for request, answer in zip(asks, answers):
        expected = sampler.generate(request["prompt"], max_new_tokens=request["max_tokens"], temperature=request["temperature"],
                                    seed=request["seed"], chat=False).text
        assert answer == expected, request
