"""The decode loop on tiny models: greedy identity with transformers, limits, EOS, seeds."""

from __future__ import annotations

import pytest
import torch

from specsample import engine
from specsample.drafters import DraftModelDrafter, NoDrafter
from specsample.engine import decode
from specsample.models import TransformersTarget, make_target
from specsample.models.loading import LoadedModel
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats, Step

from conftest import tiny_llama

VOCAB = 64
PROMPT = torch.tensor([5, 17, 33, 2, 60, 8])
GREEDY = SamplingParams(temperature=0)
BACKENDS = {
    "transformers": TransformersTarget,
    "auto": lambda m: make_target(LoadedModel(m, None, "tiny", frozenset(), 0.0)),
}


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(VOCAB, seed=0)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(VOCAB, seed=1)


def run(target, drafter, *, k=4, max_new_tokens=20, params=GREEDY, eos=frozenset(), seed=0, stats=None):
    stats = stats if stats is not None else Stats()
    steps = decode(
        target, drafter, FixedK(k), PROMPT, params, max_new_tokens=max_new_tokens,
        eos_token_ids=eos, random=GeneratorSource(torch.Generator().manual_seed(seed)), stats=stats,
    )
    return [t for step in steps for t in step]


def hf_greedy(model, max_new_tokens, eos=None):
    out = model.generate(
        PROMPT[None], attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), do_sample=False,
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
    )
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("use_draft", [False, True])
def test_greedy_is_token_identical_to_transformers_generate(target_model, draft_model, backend, k, use_draft):
    make = BACKENDS[backend]
    drafter = DraftModelDrafter(make(draft_model)) if use_draft else NoDrafter()
    assert run(make(target_model), drafter, k=k, max_new_tokens=30) == hf_greedy(target_model, 30)


def test_self_drafting_accepts_everything(target_model):
    stats = Stats()
    tokens = run(make_target_of(target_model), DraftModelDrafter(make_target_of(target_model)), k=4, max_new_tokens=21, stats=stats)
    assert tokens == hf_greedy(target_model, 21)
    assert stats.acceptance_rate == 1.0
    assert stats.steps == 5  # 4 steps of k=4 + bonus, then one of k=0
    assert stats.mean_accepted_length == pytest.approx(21 / 5)


def test_the_transformers_backend_passes_its_cache_without_a_deprecation_warning(target_model):
    """transformers 5.24 renamed `past_key_values` to `cache` and warns on every pass given the old name."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(TransformersTarget(target_model), NoDrafter(), k=0, max_new_tokens=5) == hf_greedy(target_model, 5)


def make_target_of(model):
    return BACKENDS["auto"](model)


@pytest.mark.parametrize("backend", ["auto", "transformers"])
def test_a_prompt_prefilled_in_parts_scores_as_one_prefilled_at_once(target_model, backend, monkeypatch):
    """`engine.prefill` with `cancelled` (a server's request): the prompt in parts of PREFILL_PART positions,
    asking before each further part; the next token's logits as after one prefill (the kernels: bitwise)."""
    monkeypatch.setattr(engine, "PREFILL_PART", 16)
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(3))
    whole, parts = BACKENDS[backend](target_model), BACKENDS[backend](target_model)
    whole.prefill(ids[:-1])
    asks = []
    assert engine.prefill(parts, ids[:-1], lambda: asks.append(1) or False)
    assert parts.length == whole.length == 99 and len(asks) == 6  # before the parts at 16, 32, .., 96
    expected, got = whole.score(ids[-1:]), parts.score(ids[-1:])
    assert torch.equal(got, expected) if backend == "auto" else torch.allclose(got, expected, atol=1e-5)


def test_a_request_cancelled_while_its_prompt_prefills_stops_there_and_yields_nothing(target_model, monkeypatch):
    monkeypatch.setattr(engine, "PREFILL_PART", 16)
    target, asks = make_target_of(target_model), []
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(3))
    steps = decode(target, NoDrafter(), FixedK(0), ids, GREEDY, max_new_tokens=5, eos_token_ids=frozenset(),
                   random=GeneratorSource(torch.Generator().manual_seed(0)), stats=Stats(),
                   cancelled=lambda: asks.append(1) or len(asks) == 2)
    assert list(steps) == [] and len(asks) == 2 and target.length == 32
    assert run(target, NoDrafter(), k=0) == run(make_target_of(target_model), NoDrafter(), k=0)  # the next request


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_reached_mid_draft_is_never_overshot(target_model, max_new_tokens):
    tokens = run(make_target_of(target_model), DraftModelDrafter(make_target_of(target_model)), k=5, max_new_tokens=max_new_tokens)
    assert tokens == hf_greedy(target_model, 30)[:max_new_tokens]


def test_eos_inside_a_draft_ends_the_output(target_model):
    reference = hf_greedy(target_model, 30)
    eos = reference[6]
    first = reference.index(eos)
    stats = Stats()
    tokens = run(make_target_of(target_model), DraftModelDrafter(make_target_of(target_model)), k=5, eos=frozenset({eos}),
                 stats=stats)
    assert tokens == reference[: first + 1]
    assert tokens == hf_greedy(target_model, 30, eos=eos)
    # the target itself drafts, so every draft token is accepted, those past the EOS too; they are not counted
    assert stats.generated_tokens == len(tokens) and stats.accepted_tokens <= len(tokens)


def test_an_answer_ending_inside_a_step_takes_the_steps_later_tokens_out_of_the_counts():
    """A stop string's last token inside a step: the step's later tokens, accepted or not, leave the counts."""
    stats = Stats()
    stats.record(Step(drafted=4, accepted=4, emitted=5, draft_seconds=0.0, verify_seconds=0.0))
    stats.record(Step(drafted=6, accepted=5, emitted=6, draft_seconds=0.0, verify_seconds=0.0))
    stats.answer_ends(2)
    assert (stats.generated_tokens, stats.accepted_tokens, stats.drafted_tokens) == (7, 6, 10)
    assert stats.accepted_at == [2, 2, 1, 1] and sum(stats.accepted_at) == stats.accepted_tokens
    assert stats.drafted_at == [2, 2, 1, 1]  # the second draft's tokens after the answer's end: not rejections
    with pytest.raises(ValueError, match="cannot end after 7 tokens of a step that emitted 6"):
        stats.answer_ends(7)


def test_draft_tokens_after_an_eos_are_not_rejections():
    """An EOS as the second accepted token of a 4-token draft ends the answer there: positions 2 and 3
    were not rejected (nor accepted), so the acceptance by position does not count them."""
    stats = Stats()
    stats.record(Step(drafted=4, accepted=1, emitted=2, draft_seconds=0.0, verify_seconds=0.0))  # recovered at 1
    stats.record(Step(drafted=4, accepted=2, emitted=2, draft_seconds=0.0, verify_seconds=0.0))  # EOS accepted at 1
    assert stats.drafted_at == [2, 2, 1, 1] and stats.accepted_at == [2, 1, 0, 0]
    assert stats.acceptance_by_position == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("use_draft", [False, True])
def test_seeded_sampling_is_reproducible(target_model, draft_model, use_draft):
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def once(seed):
        drafter = DraftModelDrafter(make_target_of(draft_model)) if use_draft else NoDrafter()
        return run(make_target_of(target_model), drafter, params=params, max_new_tokens=25, seed=seed)

    assert once(11) == once(11)
    assert once(11) != once(12)


def test_statistics_count_drafts(target_model, draft_model):
    stats = Stats()
    tokens = run(make_target_of(target_model), DraftModelDrafter(make_target_of(draft_model)), k=3, max_new_tokens=30, stats=stats)
    assert stats.generated_tokens == len(tokens) == 30
    assert stats.drafted_tokens >= stats.accepted_tokens
    assert stats.generated_tokens == stats.accepted_tokens + stats.steps
    assert sum(stats.drafted_at) == stats.drafted_tokens and sum(stats.accepted_at) == stats.accepted_tokens
    assert stats.drafted_at[0] <= stats.steps
    assert 0 <= stats.acceptance_rate <= 1
    assert stats.decode_seconds >= stats.draft_seconds + stats.verify_seconds


def test_steps_count_the_draft_tokens_the_policy_left_unverified(target_model, draft_model):
    class KeepTwo(FixedK):
        def __init__(self) -> None:
            super().__init__(5)
            self.steps = []

        def keep(self, confidence: torch.Tensor) -> int:
            return min(2, len(confidence))

        def observe(self, step) -> None:
            self.steps.append(step)

    policy, stats = KeepTwo(), Stats()
    steps = decode(
        make_target_of(target_model), DraftModelDrafter(make_target_of(draft_model)), policy, PROMPT, GREEDY,
        max_new_tokens=20, eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator()), stats=stats,
    )
    assert len([t for step in steps for t in step]) == 20
    produced = 0
    for step in policy.steps:
        asked = min(5, 20 - produced - 1)
        assert (step.drafted, step.cut) == (min(2, asked), asked - min(2, asked))
        produced += step.emitted
    assert stats.drafted_tokens == sum(step.drafted for step in policy.steps)  # the verified ones


def test_context_window_is_enforced(target_model):
    with pytest.raises(ValueError, match="context window"):
        run(make_target_of(target_model), NoDrafter(), max_new_tokens=200)


class PlainRecordingCostModel:
    """The cost model's looks at the drafter (`policy.Peeks`), recorded, at steps it always leaves plain
    (K = 0, whatever the timings), one at each."""

    def __new__(cls):
        from specsample.policy import CostModelK

        class Recording(CostModelK):
            def choose(self) -> int:
                return 0

            def observe_peek(self, drafted: bool, accepted: bool) -> None:
                self.peeks.append((drafted, accepted))
                super().observe_peek(drafted, accepted)

        policy = Recording(k_max=4, peek_most=1)  # a look at every plain step
        policy.peeks = []
        return policy


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_steps_of_a_greedy_request_look_at_a_lookup_drafter_without_changing_the_text(
    target_model, temperature, monkeypatch
):
    """At K = 0 a greedy request shows the cost model the lookup drafter's next token for the text so far
    and whether the step emitted it; the text is plain decoding's. A sampled request does not look."""
    import specsample.engine as engine
    from specsample.drafters import NgramDrafter

    target = TransformersTarget(target_model)
    params = SamplingParams(temperature=temperature)
    prompt = torch.tensor([5, 17, 33, 5, 17, 33, 5, 17])
    policy, steps, looks = PlainRecordingCostModel(), [], []
    tell_peek = engine.tell_peek
    monkeypatch.setattr(engine, "tell_peek", lambda p, peeked, emitted: (
        peeked is not None and looks.append((len(steps), peeked.tolist())), tell_peek(p, peeked, emitted)))
    steps += decode(target, NgramDrafter(), policy, prompt, params, max_new_tokens=40, eos_token_ids=frozenset(),
                    random=GeneratorSource(torch.Generator().manual_seed(0)), stats=Stats())
    if temperature:
        assert looks == [] and policy.peeks == []
        return
    plain = decode(target, NoDrafter(), FixedK(0), prompt, params, max_new_tokens=40, eos_token_ids=frozenset(),
                   random=GeneratorSource(torch.Generator()), stats=Stats())
    assert [t for s in steps for t in s] == [t for s in plain for t in s]
    assert len(looks) >= 3 and len(policy.peeks) == len(looks)
    for (j, peeked), told in zip(looks, policy.peeks):
        replay = NgramDrafter()
        replay.begin(torch.cat([prompt, torch.tensor([t for s in steps[:j] for t in s], dtype=torch.long)]), params)
        assert len(steps[j]) == 1 and peeked == replay.lookup(1)  # a plain step, the drafter's next token
        assert told == (bool(peeked), bool(peeked) and peeked[0] == steps[j][0])
    assert {accepted for _, accepted in policy.peeks} == {True, False}  # hits and misses both checked


class ObservingDrafter(NoDrafter):
    """Proposes nothing, but asks to be shown each pass's logits, and takes `seconds` to look at them."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.shown = seconds, 0

    def propose(self, k, random):
        from specsample.drafters.base import Draft

        return Draft(torch.empty(0, dtype=torch.long), None, observe_logits=self.look)

    def look(self, scored, logits):
        import time

        self.shown += 1
        time.sleep(self.seconds)


def test_the_drafters_look_at_the_logits_counts_as_drafting_not_as_the_pass(target_model):
    """A step's `observe_logits` time is the drafter's: charged to the pass, a drafter asked for a draft
    it did not have would make f(1) look dearer and the K policy would never see what asking costs."""
    drafter, stats = ObservingDrafter(0.02), Stats()
    run(make_target_of(target_model), drafter, k=2, max_new_tokens=5, stats=stats)
    assert drafter.shown == stats.steps - 1 == 4  # the last step, one token short of the limit, asks for none
    assert stats.draft_seconds >= 4 * 0.02 > stats.verify_seconds


class SlowPrefill:
    """A target whose prefill takes `seconds` more, counting its prefills."""

    def __init__(self, target, seconds: float) -> None:
        self.target, self.seconds, self.prefills = target, seconds, 0
        self.vocab_size, self.max_length = target.vocab_size, target.max_length

    @property
    def length(self) -> int:
        return self.target.length

    def prefill(self, token_ids):
        import time

        self.prefills += 1
        time.sleep(self.seconds)
        self.target.prefill(token_ids)

    def score(self, token_ids):
        return self.target.score(token_ids)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)


def test_a_draft_model_is_prefilled_at_its_first_draft_and_never_if_it_never_drafts(target_model, draft_model):
    """A K policy that never drafts never pays for the draft model's prefill; one that drafts pays it once
    a request, at its first draft, counted as prefill and not as drafting (`Draft.setup_seconds`), so the
    policy does not price draft tokens with it."""
    slow = SlowPrefill(make_target_of(draft_model), 0.3)
    idle, drafting = Stats(), Stats()
    plain = run(make_target_of(target_model), DraftModelDrafter(slow), k=0, max_new_tokens=6, stats=idle)
    assert slow.prefills == 0 and idle.prefill_seconds < 0.3
    tokens = run(make_target_of(target_model), DraftModelDrafter(slow), k=3, max_new_tokens=6, stats=drafting)
    assert tokens == plain
    assert slow.prefills == 1
    assert drafting.prefill_seconds >= 0.3 > drafting.draft_seconds
    assert drafting.decode_seconds < 0.3


class RecordingK(FixedK):
    """FixedK that keeps the steps it is shown."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.steps: list[Step] = []

    def observe(self, step: Step) -> None:
        self.steps.append(step)


def test_a_step_tells_the_policy_the_k_asked_of_the_drafter_within_the_tokens_left(target_model):
    policy = RecordingK(5)
    target = make_target_of(target_model)
    steps = decode(target, DraftModelDrafter(make_target_of(target_model)), policy, PROMPT, GREEDY, max_new_tokens=8,
                   eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator()), stats=Stats())
    assert sum(len(new) for new in steps) == 8
    assert [(s.chosen, s.asked) for s in policy.steps] == [(5, 5), (5, 1)]  # self-drafting: 6 tokens, then 2 left
