"""Batched decoding (batch.py): each request's tokens are those it gets decoded alone.

Requests run in a batch of fewer slots than requests, so later ones join as earlier ones end
(continuous batching); each one's greedy tokens, and its tokens under a seed at temperature 1, must
equal engine.decode's of the same request alone, whatever else shares its passes and whenever it
joined. A request removed mid-batch frees its slot for the next one and changes nothing for the
others. The bundled model on its GGUF blocks does the same on real prompts with the suffix drafter,
whose forks share one tree.
"""

from __future__ import annotations

import pytest
import torch

from specsample.batch import Batch, Request
from specsample.drafters import NgramDrafter, NoDrafter, SuffixDrafter
from specsample.drafters.base import Draft, Drafter
from specsample.drafters.recycle import RecycleDrafter
from specsample.drafters.suffix import SuffixTreeDrafter
from specsample.engine import decode
from specsample.models.llama import LlamaTarget
from specsample.policy import FixedK
from specsample.sampling import CoupledSource, RandomSource, SamplingParams
from specsample.stats import Stats

from conftest import needs_kernels, tiny_llama

pytestmark = needs_kernels

GREEDY = SamplingParams(temperature=0)
# suffix-tree and recycle: their trees are verified as their trunks in a batch (slots score chains), as trees alone
DRAFTERS = {"none": (NoDrafter, 0), "ngram": (NgramDrafter, 3), "suffix": (SuffixDrafter, 4), "suffix-tree": (SuffixTreeDrafter, 6),
            "recycle": (RecycleDrafter, 6)}


@pytest.fixture(scope="module")
def target() -> LlamaTarget:
    return LlamaTarget.from_hf(tiny_llama(64, seed=3, init_scale=0.5))


def prompts(count: int, vocab: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen) for _ in range(count)]


def alone(target, drafter: Drafter, k: int, prompt: torch.Tensor, params: SamplingParams, max_new: int,
          random: RandomSource, eos: frozenset[int] = frozenset()) -> list[int]:
    steps = decode(target, drafter, FixedK(k), prompt, params, max_new_tokens=max_new, eos_token_ids=eos,
                   random=random, stats=Stats())
    return [t for step in steps for t in step]


def run(batch: Batch, requests: list[Request], cancel: dict[int, Request] | None = None) -> dict[int, list[int]]:
    """Decode `requests` through `batch`, admitting each as soon as a slot is free; `cancel` removes
    a request after the given step. Tokens by request index."""
    waiting, out, step = list(requests), {id(r): [] for r in requests}, 0
    while waiting or batch.busy:
        while waiting and not batch.full:
            batch.add(waiting.pop(0))
        for request, new in batch.step():
            out[id(request)] += new
        step += 1
        if cancel and step in cancel:
            batch.remove(cancel[step])
    return {i: out[id(r)] for i, r in enumerate(requests)}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_batch_equals_alone(target, name):
    check_greedy_batch_equals_alone(target, name)


def check_greedy_batch_equals_alone(target, name: str) -> None:
    """Seven greedy requests of several lengths through 3 slots with drafter `name`: each one's tokens
    are engine.decode's alone, and every slot is free at the end."""
    make, k = DRAFTERS[name]
    ps = prompts(7)
    max_new = [5 + 6 * i for i in range(len(ps))]
    batch = Batch(target.slots(3), make(), lambda: FixedK(k), eos_token_ids=frozenset())
    requests = [Request(p, GREEDY, m, CoupledSource(0)) for p, m in zip(ps, max_new)]
    got = run(batch, requests)
    for i, (p, m) in enumerate(zip(ps, max_new)):
        assert got[i] == alone(target, make(), k, p, GREEDY, m, CoupledSource(0)), f"request {i}"
        assert requests[i].done and requests[i].stats.generated_tokens == m
    assert sorted(batch.free) == [0, 1, 2] and not batch.running


def test_a_tree_of_point_masses_reduces_to_its_trunk():
    tree = Draft.tree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2])  # 10 -> {12 -> 14, 13}, 11
    trunk = tree.trunk()
    assert trunk.tokens.tolist() == [10, 12, 14] and not trunk.is_tree
    sampled = Draft(torch.tensor([1, 2]), torch.full((2, 4), 0.25), parents=torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="point masses"):
        sampled.trunk()


class Oracle:
    """Drafts the target's own greedy continuation (point masses), so every draft token is accepted, those past
    an EOS too."""

    is_lookup = True

    def __init__(self, continuation: list[int]) -> None:
        self.continuation, self.at = continuation, 0

    def fork(self) -> "Oracle":
        return Oracle(self.continuation)

    def begin(self, prompt_ids: torch.Tensor, params: SamplingParams) -> None:
        self.at = 0

    def propose(self, k: int, random: RandomSource) -> Draft:
        return Draft(torch.tensor(self.continuation[self.at : self.at + k]), None)

    def observe(self, tokens: list[int]) -> None:
        self.at += len(tokens)


def test_a_batch_counts_no_accepted_token_past_an_eos(target):
    """As engine.decode: a request whose draft is accepted past its EOS counts only what it emitted."""
    prompt = prompts(1)[0]
    reference = alone(target, NoDrafter(), 0, prompt, GREEDY, 30, CoupledSource(0))
    eos = frozenset({reference[9]})
    first = reference.index(reference[9])
    expected = Stats()
    alone_tokens = [t for step in decode(target, Oracle(reference), FixedK(6), prompt, GREEDY, max_new_tokens=30,
                                          eos_token_ids=eos, random=CoupledSource(0), stats=expected) for t in step]
    batch = Batch(target.slots(1), Oracle(reference), lambda: FixedK(6), eos_token_ids=eos)
    request = Request(prompt, GREEDY, 30, CoupledSource(0))
    assert run(batch, [request])[0] == alone_tokens == reference[: first + 1]
    got = request.stats
    assert got.generated_tokens == first + 1  # the EOS an accepted draft token: no bonus token after it
    assert got.accepted_tokens + got.steps - 1 <= got.generated_tokens
    assert (got.accepted_tokens, got.steps, got.accepted_at) == (expected.accepted_tokens, expected.steps,
                                                                 expected.accepted_at)


def test_seeded_sampling_batch_equals_alone(target):
    """At temperature 1 with a seed, a request's tokens depend on its seed alone, not on its batch."""
    got = check_seeded_sampling_batch_equals_alone(target)
    assert any(5 in tokens for tokens in got.values())  # some request ended at its EOS token


def check_seeded_sampling_batch_equals_alone(target) -> dict[int, list[int]]:
    """Six requests at temperature 1 with seeds through 4 slots, EOS token 5: each one's tokens are
    engine.decode's alone; the tokens by request."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    ps = prompts(6)
    batch = Batch(target.slots(4), SuffixDrafter(), lambda: FixedK(3), eos_token_ids=frozenset({5}))
    requests = [Request(p, params, 40, CoupledSource(100 + i)) for i, p in enumerate(ps)]
    got = run(batch, requests)
    for i, p in enumerate(ps):
        assert got[i] == alone(target, SuffixDrafter(), 3, p, params, 40, CoupledSource(100 + i), frozenset({5}))
    return got


def test_cancelled_request_frees_its_slot(target):
    check_cancelled_request_frees_its_slot(target)


def check_cancelled_request_frees_its_slot(target) -> None:
    """A request removed after 3 steps leaves a prefix of its tokens alone; the next request takes its
    slot, and every other request's tokens are its tokens alone."""
    ps = prompts(5)
    batch = Batch(target.slots(2), NgramDrafter(), lambda: FixedK(3), eos_token_ids=frozenset())
    requests = [Request(p, GREEDY, 30, CoupledSource(0)) for p in ps]
    got = run(batch, requests, cancel={3: requests[1]})
    assert requests[1].slot is None and not requests[1].done and 0 < len(got[1]) < 30
    assert got[1] == alone(target, NgramDrafter(), 3, ps[1], GREEDY, 30, CoupledSource(0))[: len(got[1])]
    for i in (0, 2, 3, 4):  # request 2 took the cancelled one's slot
        assert got[i] == alone(target, NgramDrafter(), 3, ps[i], GREEDY, 30, CoupledSource(0)), f"request {i}"


def test_chunked_prefill_batch_equals_alone(target):
    check_chunked_prefill_batch_equals_alone(target)


def check_chunked_prefill_batch_equals_alone(target) -> None:
    """Prompts of up to 80 tokens prefilled 7 positions before each step (`prefill_chunk`), greedy and seeded,
    through 3 slots: each request's tokens are engine.decode's alone, the running requests step while a
    long prompt prefills, and a request removed while it prefills frees its slot."""
    gen = torch.Generator().manual_seed(11)
    ps = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (3, 80, 40, 1, 65, 8)]
    params = [GREEDY, SamplingParams(temperature=1.0)] * 3
    batch = Batch(target.slots(3), SuffixDrafter(), lambda: FixedK(3), eos_token_ids=frozenset(), prefill_chunk=7)
    requests = [Request(p, q, 20, CoupledSource(50 + i)) for i, (p, q) in enumerate(zip(ps, params))]
    waiting, out, overlapped = list(requests), {id(r): [] for r in requests}, 0
    while waiting or batch.busy:
        while waiting and not batch.full:
            batch.add(waiting.pop(0))
        prefilling = len(batch.prefilling)
        stepped = batch.step()
        overlapped += bool(stepped and prefilling and batch.prefilling)
        for request, new in stepped:
            out[id(request)] += new
    for i, (p, q) in enumerate(zip(ps, params)):
        assert out[id(requests[i])] == alone(target, SuffixDrafter(), 3, p, q, 20, CoupledSource(50 + i)), f"request {i}"
        assert requests[i].stats.prompt_tokens == p.shape[0] and requests[i].stats.prefill_seconds > 0
    assert overlapped > 0  # steps of running requests between a long prompt's chunks
    assert sorted(batch.free) == [0, 1, 2]
    long = Request(ps[1], GREEDY, 4, CoupledSource(0))
    batch.add(long)
    assert batch.prefilling == [long] and long.prefilled == 7 and not batch.running
    assert batch.step() == [] and long.prefilled == 14  # one chunk a step even alone: requests join and leave between
    batch.remove(long)
    assert long.slot is None and not batch.busy and sorted(batch.free) == [0, 1, 2]


def test_bad_requests_are_refused(target):
    batch = Batch(target.slots(1), NoDrafter(), lambda: FixedK(0), eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="context window"):
        batch.add(Request(torch.arange(10), GREEDY, target.max_length, CoupledSource(0)))
    with pytest.raises(ValueError, match="empty"):
        batch.add(Request(torch.tensor([], dtype=torch.long), GREEDY, 4, CoupledSource(0)))
    batch.add(Request(torch.arange(3), GREEDY, 4, CoupledSource(0)))
    with pytest.raises(ValueError, match="all 1 slots are taken"):
        batch.add(Request(torch.arange(3), GREEDY, 4, CoupledSource(0)))
    assert batch.free == []
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        Batch(target.slots(1), NoDrafter(), lambda: FixedK(0), eos_token_ids=frozenset(), prefill_chunk=0)


def test_drafters_with_a_model_cache_do_not_fork(target):
    from specsample.drafters import DraftModelDrafter

    with pytest.raises(ValueError, match="DraftModelDrafter keeps a model's cache"):
        Batch(target.slots(2), DraftModelDrafter(target), lambda: FixedK(2), eos_token_ids=frozenset())


def test_suffix_forks_share_what_they_learn():
    parent = SuffixDrafter()
    a, b = parent.fork(), parent.fork()
    a.begin(torch.tensor([1, 2, 3, 4, 5, 6]), GREEDY)
    b.begin(torch.tensor([9, 1, 2, 3]), GREEDY)
    assert b.lookup(3) == [4, 5, 6]  # b drafts from a's text
    a.begin(torch.tensor([7]), GREEDY)  # a files its first request under the shared history
    assert list(parent.history) == [[1, 2, 3, 4, 5, 6]] and parent.history_size == 6


@pytest.mark.parametrize("k", [0, 3])
def test_recycle_forks_share_one_table_refreshed_by_the_batch_passes(target, k):
    """Token Recycling's forks share the parent's table, and each request's rows of a batch pass refresh
    it, at plain steps (K = 0, `observe_plain`) and at drafting ones (`observe_logits`): entries of the
    full width come only from a refresh (at t = 1 nothing else writes the table)."""
    parent = RecycleDrafter()
    batch = Batch(target.slots(2), parent, lambda: FixedK(k), eos_token_ids=frozenset())
    assert all(fork.next is parent.next for fork in batch.drafters)
    params = SamplingParams(temperature=1.0)
    requests = [Request(p, params, 12, CoupledSource(i)) for i, p in enumerate(prompts(3))]
    run(batch, requests)
    refreshed = [row for row in parent.next.values() if len(row) == parent.width]
    assert len(refreshed) >= 12  # the distinct tokens scored over 3 x 12 steps: about 27 of 64 at K = 0


def test_bundled_model_batch_equals_alone():
    """The bundled model on its GGUF blocks, real prompts, the suffix drafter: greedy tokens in a batch of
    3 slots equal those of each request alone."""
    from specsample.models import gguf_blocks
    from specsample.models.loading import load_model
    from specsample.text import encode_prompt

    loaded = load_model()
    target = gguf_blocks.gguf_target(loaded.model, loaded.gguf)
    texts = ["List the planets of the solar system.", "Write a haiku about rain.", "What is 17 * 23?",
             "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"]
    ps = [torch.tensor(encode_prompt(loaded.tokenizer, text, True)) for text in texts]
    batch = Batch(target.slots(3), SuffixDrafter(), lambda: FixedK(4), eos_token_ids=loaded.eos_token_ids)
    requests = [Request(p, GREEDY, 24, CoupledSource(0)) for p in ps]
    got = run(batch, requests)
    for i, p in enumerate(ps):
        expected = alone(target, SuffixDrafter(), 4, p, GREEDY, 24, CoupledSource(0), loaded.eos_token_ids)
        assert got[i] == expected, f"prompt {texts[i]!r}"
    assert sum(r.stats.accepted_tokens for r in requests) > 0


@pytest.fixture(scope="module")
def sampler():
    from specsample.api import SpecSampler

    return SpecSampler.load(drafter="suffix", backend="gguf")


def test_generate_batch_equals_generate(sampler):
    """The Python API: each completion of a batch is `generate`'s of its prompt alone (greedy, and
    seeded at temperature 1), stop strings and max_new_tokens per request."""
    prompts = ["Name three rivers.", "Count from one to twenty.", "Say hello.", "What is a cat?", "Spell 'batch'."]
    greedy = dict(max_new_tokens=20, temperature=0, k=3, stop=[" is"])
    batched = sampler.generate_batch(prompts, max_batch=3, **greedy)
    for prompt, completion in zip(prompts, batched):
        alone = sampler.generate(prompt, **greedy)
        assert (completion.text, completion.token_ids, completion.finish_reason) == (
            alone.text, alone.token_ids, alone.finish_reason)
        assert completion.stats.generated_tokens == len(completion.token_ids)
    assert any(c.finish_reason == "stop" for c in batched)
    sampled = dict(max_new_tokens=16, temperature=1.0, k=3)
    batched = sampler.generate_batch(prompts[:3], max_batch=2, seeds=[1, 2, 3], **sampled)
    for prompt, seed, completion in zip(prompts, [1, 2, 3], batched):
        assert completion.token_ids == sampler.generate(prompt, seed=seed, **sampled).token_ids
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        sampler.generate_batch(prompts[:3], seeds=[1, 2])
    with pytest.raises(ValueError, match="takes a list of prompts, got one"):  # had answered "a", "b" and "c"
        sampler.generate_batch("abc", max_new_tokens=2)
    generated = sampler.generate_batch((p for p in prompts[:2]), **greedy)  # a generator of prompts
    assert [c.token_ids for c in generated] == [sampler.generate(p, **greedy).token_ids for p in prompts[:2]]
    with pytest.raises(ValueError, match="takes a list of prompts, got int"):
        sampler.generate_batch(3, max_new_tokens=2)
    with pytest.raises(ValueError, match="chat must be True or False, got 'no'"):  # "no" had read as True
        sampler.generate("Say hello.", chat="no", max_new_tokens=2)
    batch = sampler.batch(2, 3)  # a batch given, reused warm, as `bench batch` does
    for _ in range(2):
        again = sampler.generate_batch(prompts[:3], batch=batch, **greedy)
        assert [c.token_ids for c in again] == [sampler.generate(p, **greedy).token_ids for p in prompts[:3]]
    assert batch.totals.steps > 0 and not batch.running


def run_policy(cost, other_rows: int, steps: int = 60) -> list[int]:
    """K chosen by the batch-aware cost model over `steps` steps of a request in a batch whose other
    requests score `other_rows` rows for as many tokens, each draft token accepted with probability 0.8."""
    from specsample.policy import BatchCostModelK
    from specsample.stats import Step

    policy, rng, chosen = BatchCostModelK(), torch.Generator().manual_seed(0), []
    for _ in range(steps):
        policy.see_batch(cost, other_rows, other_rows, other_rows)
        k = policy.choose()
        accepted = int(torch.cumprod(torch.rand(k, generator=rng) < 0.8, 0).sum()) if k else 0
        policy.observe(Step(k, accepted, accepted + 1, 1e-6 * k, float(cost.step(other_rows, other_rows, [1 + k])[0])))
        chosen.append(k)
    return chosen


def test_batch_cost_model_turns_speculation_down_where_rows_cost():
    """Where a pass costs the same whatever its rows, the request drafts; where every row costs as much
    as another request's (compute-bound), a draft accepted 80% of the time does not pay: K goes to 0."""
    from specsample.policy import PassCost

    flat, linear = PassCost(), PassCost()
    for rows in range(1, 100):
        flat.observe(rows, 0.010, rows)
        linear.observe(rows, 0.001 * rows, rows)
    assert linear([4.5])[0] == pytest.approx(0.0045) and flat([500])[0] == pytest.approx(0.010)
    assert min(run_policy(flat, other_rows=15)[-20:]) >= 4
    assert max(run_policy(linear, other_rows=15)[-20:]) == 0


def test_batch_runs_the_batch_aware_policy(target):
    """`auto` in a batch (parse_batch_k): the batch measures f(rows) and each slot's policy sees it."""
    from specsample.policy import BatchCostModelK, parse_batch_k

    batch = Batch(target.slots(3), SuffixDrafter(), lambda: parse_batch_k("auto"), eos_token_ids=frozenset())
    ps = prompts(4)
    got = run(batch, [Request(p, GREEDY, 30, CoupledSource(0)) for p in ps])
    for i, p in enumerate(ps):
        assert got[i] == alone(target, SuffixDrafter(), 0, p, GREEDY, 30, CoupledSource(0))
    assert all(isinstance(policy, BatchCostModelK) and policy.cost is batch.cost for policy in batch.policies)
    assert batch.cost.measured and max(batch.cost.seconds) > 1


def test_totals_count_steps_rows_and_seconds(target):
    """A batch's `totals`: its steps, the rows they scored, its passes within its steps, its prefills."""
    batch = Batch(target.slots(2), NgramDrafter(), lambda: FixedK(2), eos_token_ids=frozenset())
    requests = [Request(p, GREEDY, 12, CoupledSource(0)) for p in prompts(3)]
    waiting, steps, rows = list(requests), 0, 0
    while waiting or batch.running:
        while waiting and not batch.full:
            batch.add(waiting.pop(0))
        batch.step()
        steps, rows = steps + 1, rows + batch.rows
    totals = batch.totals
    assert (totals.steps, totals.rows) == (steps, rows) and rows >= steps > 0
    assert 0 < totals.pass_seconds < totals.step_seconds
    assert totals.prefill_seconds == pytest.approx(sum(r.stats.prefill_seconds for r in requests))


def test_pass_cost_follows_the_machine_curve_beyond_the_rows_measured():
    """Unmeasured larger passes cost what the target's own curve says, from the largest measured, not nothing."""
    from specsample.policy import PassCost

    prior = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0}
    cost = PassCost(prior=prior)
    cost.observe(1, 0.004, 1)
    assert cost([1])[0] == pytest.approx(0.004)
    assert cost([2, 8])[0] == pytest.approx(0.0044) and cost([8])[0] == pytest.approx(0.008)
    cost.observe(4, 0.006, 4)
    assert cost([8])[0] == pytest.approx(0.006 * 2.0 / 1.3)  # from the largest measured, in the curve's proportion
    assert cost([2])[0] == pytest.approx(0.004 + 0.002 / 3)  # between measurements: interpolated
    assert PassCost()([8]) == pytest.approx([1.0]) and PassCost(prior=prior)([8]) == pytest.approx([1.0])


def test_where_drafts_pass_alone_a_draft_costs_a_pass_of_its_own():
    """llama.cpp's slots (`drafts_pass_alone`): a pass that carried drafts is not taken as f(R); beside the
    pass over one row of every request, a request's draft of d rows costs f(1) x the prior's f(d)/f(1),
    f(1) from the measured pass. Where each extra row costs half a pass, a draft accepted 80% of the time
    does not pay in a batch of 8: K goes to 0."""
    from specsample.policy import PassCost

    prior = {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 16: 8.5}  # each extra row half a pass
    cost = PassCost(prior=prior, drafts_alone=True)
    cost.observe(8, 0.045, 8)  # 8 requests, a row each: 4.5 f(1), so f(1) = 10 ms
    cost.observe(12, 0.080, 8)  # the same with drafts: their own passes inside, not f(12)
    assert cost.seconds == {8: 0.045}
    assert cost.step(7, 7, [1, 4]) == pytest.approx([0.045, 0.045 + 0.010 * 2.0])  # 3 draft rows: f(3)/f(1) = 2.0
    assert max(run_policy(cost, other_rows=7)[-20:]) == 0
    rows = PassCost(prior=prior)  # counted by rows, the pass with drafts is f(12)
    rows.observe(8, 0.045, 8)
    rows.observe(12, 0.080, 8)
    assert rows.step(7, 7, [1, 5]) == pytest.approx([0.045, 0.080])


def test_a_request_alone_in_a_batch_chooses_as_one_request_does():
    """With no other rows the batch-aware cost model follows the request's own cost curve, not the batch's
    f(R) in seconds: a batch curve measured where rows were dear (a long prompt's passes) does not hold K
    at 0 for the next request, which drafts as `CostModelK` does, step for step."""
    from specsample.policy import BatchCostModelK, CostModelK, PassCost
    from specsample.stats import Step

    dear = PassCost()
    for rows in range(1, 100):
        dear.observe(rows, 0.003 * rows, rows)  # every row as dear as a whole pass
    alone, plain, rng = BatchCostModelK(), CostModelK(), torch.Generator().manual_seed(0)
    chosen = []
    for _ in range(60):
        alone.see_batch(dear, 0, 0, 0)
        k = alone.choose()
        assert plain.choose() == k
        accepted = int(torch.cumprod(torch.rand(k, generator=rng) < 0.8, 0).sum()) if k else 0
        step = Step(k, accepted, accepted + 1, 1e-6 * k, 0.003 * (1 + 0.1 * k))  # the request's own passes: cheap rows
        alone.observe(step)
        plain.observe(step)
        chosen.append(k)
    assert min(chosen[-20:]) >= 4
    assert max(run_policy(dear, other_rows=15)[-20:]) == 0  # with other requests, the batch's curve decides


def test_a_stop_string_inside_a_step_ends_the_counts(sampler):
    """The step that completes a stop string drafted further (the suffix drafter has seen this answer):
    its later tokens are not in the completion, nor in its counts."""
    first = sampler.generate("Hi", max_new_tokens=12, temperature=0, k=8)
    stop = sampler.model.tokenizer.decode(first.token_ids[:1]).strip()
    stopped = sampler.generate("Hi", max_new_tokens=12, temperature=0, k=8, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.stats.drafted_tokens > len(stopped.token_ids)
    stats = stopped.stats
    assert stats.generated_tokens == len(stopped.token_ids) and stats.accepted_tokens <= stats.generated_tokens
    assert stats.mean_accepted_length == len(stopped.token_ids) / stats.steps


def test_a_generation_interrupted_by_another_raises_rather_than_mixing_texts(sampler):
    """The target holds one sequence: a generation resumed after another took a step raises `Interrupted`;
    the other's text is its own, and so is that of a generation started afterwards."""
    from specsample import Interrupted

    options = dict(max_new_tokens=10, temperature=0, k=3)
    alone = {p: sampler.generate(p, **options).text for p in ("Write a long story.", "Name three rivers.")}
    a = sampler.stream("Write a long story.", **options)  # a Generation is its own iterator
    next(a)
    assert sampler.generate("Name three rivers.", **options).text == alone["Name three rivers."]
    with pytest.raises(Interrupted, match="another generation on the same target ran after it"):
        next(a)
    with pytest.raises(Interrupted, match="ended before its completion"):  # not a bare AssertionError
        a.result()
    assert sampler.generate("Write a long story.", **options).text == alone["Write a long story."]
    closed = sampler.stream("Write a long story.", **options)
    next(closed)
    closed.chunks.close()
    with pytest.raises(Interrupted, match="ended before its completion"):
        closed.result()


def test_a_generation_cancelled_while_its_prompt_prefills_ends_with_no_chunk(sampler):
    """A server's client that leaves during a long prompt's prefill: `cancelled`, asked every PREFILL_PART
    positions, ends the generation there, with no chunk and no completion; the target then serves the
    next request as if nothing had happened, and a generation whose `cancelled` never says True gives
    the text of one that has none (the prompt prefilled in parts or at once: the same cache, bitwise)."""
    from specsample import Interrupted
    from specsample.engine import PREFILL_PART

    prompt = "Summarize: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(200))
    assert len(sampler.encode(prompt, True)) > 3 * PREFILL_PART
    options = dict(max_new_tokens=12, temperature=0, k=3)
    whole = sampler.generate(prompt, **options).text
    asks = []
    gone = sampler.stream(prompt, cancelled=lambda: asks.append(1) or len(asks) >= 2, **options)
    assert list(gone) == [] and sampler.target.length == 2 * PREFILL_PART  # True at the second ask
    with pytest.raises(Interrupted, match="ended before its completion"):
        gone.result()
    assert sampler.generate(prompt, cancelled=lambda: False, **options).text == whole
    assert sampler.generate("Name three rivers.", **options).text == sampler.generate("Name three rivers.", **options).text


def test_two_samplers_over_one_target_take_turns_as_one_does(sampler):
    """Samplers built over one target (`SpecSampler.build`, a drafter each) share its one sequence: a stream of
    one resumed after the other's step raises `Interrupted` (each had gone on from the other's cache)."""
    from specsample import Interrupted
    from specsample.api import SpecSampler

    other = SpecSampler.build(sampler.model, sampler.target, "ngram")
    options = dict(max_new_tokens=10, temperature=0, k=3)
    alone = sampler.generate("Write a long story.", **options).text
    a = sampler.stream("Write a long story.", **options)
    next(a)
    other.generate("Name three rivers.", **options)
    with pytest.raises(Interrupted, match="another generation on the same target ran after it"):
        next(a)
    assert sampler.generate("Write a long story.", **options).text == alone


def test_a_batch_run_that_fails_ends_its_requests(sampler, monkeypatch):
    """An error mid-`generate_batch` (or Ctrl-C) ends the batch's requests, so the suffix drafter's forks file
    them under its bounded history; thrown away running, they had stayed counted in its tree for good."""
    from specsample.batch import Batch

    batch = sampler.batch(2, 3)
    step = Batch.step
    calls = []

    def failing(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Batch, "step", failing)
    with pytest.raises(KeyboardInterrupt):
        sampler.generate_batch(["Name three rivers.", "Say hello.", "Count to ten."], batch=batch, max_new_tokens=12,
                               temperature=0)
    assert not batch.busy and len(batch.free) == 2


def test_measuring_the_cost_curve_interrupts_a_paused_generation_rather_than_corrupt_it():
    """The cost model's first request measures f(n) on the target's cache: a generation paused meanwhile
    raises `Interrupted`, as after another generation's step (it went on from the measurement's cache)."""
    from conftest import tiny_tokenizer
    from specsample import Interrupted
    from specsample.api import SpecSampler
    from specsample.models.loading import LoadedModel

    model = tiny_llama(64, seed=3, init_scale=0.5)
    loaded = LoadedModel(model, tiny_tokenizer(64), "tiny", frozenset({1}), 0.0)
    sampler = SpecSampler(loaded, LlamaTarget.from_hf(model), SuffixDrafter())
    options = dict(max_new_tokens=20, temperature=0, k=3, chat=False)
    paused = sampler.stream("w5 w9 w12 w5 w9 w12 w5 w9", **options)
    next(paused)
    sampler.stream("w3 w4", max_new_tokens=5, temperature=0, k="auto", chat=False)  # measures, never iterated
    with pytest.raises(Interrupted):
        paused.result()


def test_a_batch_leaves_a_paused_generation_be_once_the_cost_curve_is_remembered(sampler):
    """A batch's slots hold caches of their own: a sampler's first batch measures the target's cost curve
    (which interrupts a paused generation) only where this machine has not remembered it."""
    from specsample.api import SpecSampler

    sampler.cost_ratios()  # a GGUF file on a named backend: measured once on this machine, then remembered
    fresh = SpecSampler.load(drafter="suffix", backend="gguf")
    options = dict(max_new_tokens=12, temperature=0, k=3)
    alone = fresh.generate("Count from one to twenty.", **options)
    paused = fresh.stream("Count from one to twenty.", **options)
    next(paused)
    fresh.generate_batch(["Say hi.", "Name a color."], max_new_tokens=4, temperature=0, k=3)
    assert paused.result().token_ids == alone.token_ids


def test_a_batch_steps_under_the_sampler_s_lock_as_a_generation_does():
    """A batch's forks share the sampler's drafter state (the suffix tree) with its generations, so a batch
    drafts under the sampler's lock: a generation in another thread never drafts at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import tiny_tokenizer
    from specsample.api import SpecSampler
    from specsample.models.loading import LoadedModel

    free_while_drafting: list[bool] = []

    class Probe(SuffixDrafter):
        def propose(self, k, random):
            with ThreadPoolExecutor(1) as pool:  # another thread tries the lock
                free_while_drafting.append(pool.submit(sampler.turns.lock.acquire, False).result())
            return super().propose(k, random)

    model = tiny_llama(64, seed=3, init_scale=0.5)
    loaded = LoadedModel(model, tiny_tokenizer(64), "tiny", frozenset({1}), 0.0)
    sampler = SpecSampler(loaded, LlamaTarget.from_hf(model), Probe())
    sampler.generate_batch(["w5 w9 w12 w5 w9", "w3 w4 w3 w4"], max_batch=2, temperature=0, k=3, chat=False,
                           max_new_tokens=6)
    assert free_while_drafting and not any(free_while_drafting)


def test_a_batch_s_finished_requests_are_filed_under_the_suffix_history_and_evicted():
    """Each `generate_batch` makes a batch of forks sharing the sampler's suffix tree: its requests are filed
    under the shared history as they end (not at a next request their fork never gets), so the history's
    bound holds over many batches (their counts stayed in the tree for good)."""
    from conftest import tiny_tokenizer
    from specsample.api import SpecSampler
    from specsample.models.loading import LoadedModel

    model = tiny_llama(64, seed=3, init_scale=0.5)
    loaded = LoadedModel(model, tiny_tokenizer(64), "tiny", frozenset({1}), 0.0)
    drafter = SuffixDrafter(history_tokens=40)
    sampler = SpecSampler(loaded, LlamaTarget.from_hf(model), drafter)
    options = dict(max_batch=2, temperature=0, k=3, chat=False, max_new_tokens=8)
    sampler.generate_batch(["w5 w9 w12", "w3 w4"], **options)
    assert len(drafter.history) == 2  # both filed as they ended
    for round_ in range(4):
        sampler.generate_batch([f"w{round_} w{round_ + 9} w7", f"w{round_ + 20} w2"], **options)
        assert drafter.history_size <= 40


def test_generations_from_several_threads_never_mix_their_texts(sampler):
    """Each of four threads' `generate` either gives its prompt's text alone or raises `Interrupted`."""
    from concurrent.futures import ThreadPoolExecutor

    from specsample import Interrupted

    prompts = ["Write a long story.", "Name three rivers.", "Say hello.", "Count to five."]
    options = dict(max_new_tokens=16, temperature=0, k=3)
    alone = [sampler.generate(p, **options).text for p in prompts]

    def attempt(prompt: str) -> str | None:
        try:
            return sampler.generate(prompt, **options).text
        except Interrupted:
            return None

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(attempt, prompts))
    assert all(text in (None, expected) for text, expected in zip(texts, alone)), texts
    assert any(text is not None for text in texts)
