"""The decode loop: draft, score in one target pass, verify, roll back, emit.

The target's cache always holds every token of the text except the last one,
the *pending* token. A step scores [pending, draft_tokens...] in one forward
pass (k + 1 positions), verifies the draft against those logits and rolls the
cache back to the accepted length; the recovered or bonus token becomes the
new pending token. Plain decoding is the same loop with k = 0.

The request's randomness is one `RandomSource`. At each step the engine gives
the drafter and the verifier the source as seen from the step's first output
position (`random.at(produced)`), so a source whose numbers are keyed by
output position (`sampling.CoupledSource`) gives every position the same
numbers whatever the drafter and K; the engine never asks which source or
which drafter it holds.

A draft may be a tree (`Draft.parents`, drafted only for targets that declare
`ScoresTrees`): the step scores [pending, nodes...] in one pass with tree
attention, verifies with `verify.tree`, and keeps the accepted path's keys and
values as the cache's next positions (`keep_path`); a tree whose nodes form one
path is verified as the chain it is. A draft that carries an `observe_logits`
hook is shown the pass's logits, and the time that takes is the drafter's (at a
plain step, a drafter that asks for them: `WatchesPlainSteps`). At a
plain step of a greedy request, a K policy that learns from it is shown a lookup
drafter's next token and whether the step emitted it (`peek`, `policy.Peeks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from time import perf_counter

import torch
from torch import Tensor

from specsample.drafters.base import Draft, Drafter, plain_draft
from specsample.models.target import ScoresTrees, Target
from specsample.policy import KPolicy, Peeks
from specsample.sampling import RandomSource, SamplingParams, integer
from specsample.stats import Stats, Step
from specsample.tree import chain_parents
from specsample.verify import ChainVerifier, TreeVerifier, Verdict

PREFILL_PART = 256  # positions of a prompt prefilled between two asks of `cancelled` (`prefill`)


def decode(
    target: Target,
    drafter: Drafter,
    policy: KPolicy,
    prompt_ids: Tensor,
    params: SamplingParams,
    *,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    random: RandomSource,
    stats: Stats,
    verifier: ChainVerifier = ChainVerifier(),
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each verification step until EOS or max_new_tokens. With `cancelled`, the
    prompt is prefilled in parts (`prefill`), and the request ends, yielding nothing, once it says True."""
    check_lengths(target, prompt_ids.shape[0], max_new_tokens)
    start = perf_counter()
    if not prefill(target, prompt_ids[:-1], cancelled):
        return
    drafter.begin(prompt_ids, params)
    policy.begin()
    stats.prompt_tokens = prompt_ids.shape[0]
    stats.prefill_seconds = perf_counter() - start
    pending, produced = int(prompt_ids[-1]), 0
    looking = looks(drafter, policy, params)
    plain = plain_draft(drafter)
    try:
        while produced < max_new_tokens:
            t_draft = perf_counter()
            chosen = policy.choose()
            k = min(chosen, max_new_tokens - produced - 1)
            numbers = random.at(produced)  # offset i: output position produced + i
            draft = drafter.propose(k, numbers) if k > 0 else plain
            peeked = peek(drafter, policy, k, numbers) if looking else None
            draft, cut = fitted(*kept(draft, policy), target.max_length - target.length - 1)
            t_verify = perf_counter()
            verdict, observing = verify(target, pending, draft, params, numbers, verifier)
            t_other = perf_counter()
            emitted = draft.tokens[verdict.nodes].tolist() + [verdict.next_token]
            drafter.observe(emitted)
            new = cut_at_eos(emitted, eos_token_ids)
            step = answer_step(draft, verdict, new, t_verify - t_draft + observing - draft.setup_seconds,
                               t_other - t_verify - observing, cut, chosen, k)
            stats.record(step)
            policy.observe(step)
            tell_peek(policy, peeked, emitted)
            stats.decode_seconds += perf_counter() - t_draft - draft.setup_seconds
            stats.prefill_seconds += draft.setup_seconds  # the drafter's prefill (`Draft.setup_seconds`)
            produced += len(new)
            yield new
            if new[-1] in eos_token_ids:
                return
            pending = verdict.next_token
    finally:  # also when the consumer stops early: the policy's estimates, once per request
        stats.policy = policy.estimates()


def prefill(target: Target, token_ids: Tensor, cancelled: Callable[[], bool] | None = None) -> bool:
    """Fill the target's cache with `token_ids` [n]: at once, or with `cancelled`, PREFILL_PART positions at
    a time, asking it before each further part, so that a request whose client has gone stops within a part
    rather than after the whole prompt (a server's abandoned 8,000-token prompt held it for 24 s). False if it
    was cancelled. The parts change no logits: the kernels' passes are batch invariant, and llama.cpp fills a
    prompt in blocks that are the same however it is cut into calls (`llamacpp.CachedSequence`)."""
    if cancelled is None:
        target.prefill(token_ids)
        return True
    target.prefill(token_ids[:PREFILL_PART])
    for begin in range(PREFILL_PART, token_ids.shape[0], PREFILL_PART):
        if cancelled():
            return False
        target.extend(token_ids[begin:begin + PREFILL_PART])
    return True


def kept(draft: Draft, policy: KPolicy) -> tuple[Draft, int]:
    """The part of `draft` the policy verifies, and how many draft tokens it leaves out (drafted, so
    paid for, but not verified): a prefix chosen on the drafter's confidences (`KPolicy.keep`), or for a
    tree of point masses a subtree chosen on its shape (`keep_tree`); a sampled tree's shape depends on
    its draws, so it is kept whole."""
    if draft.confidence is not None:
        short = draft.prefix(policy.keep(draft.confidence))
    elif draft.is_tree and draft.probs is None:
        short = draft.select(policy.keep_tree(draft.parents))
    else:
        return draft, 0
    return short, len(draft) - len(short)


def fitted(draft: Draft, cut: int, room: int) -> tuple[Draft, int]:
    """The draft's nodes that fit the `room` positions left in the target's window (after the pending
    token), and the cut grown by the rest. A chain never needs it (K is at most the tokens left to
    generate, which the window holds); a tree may have more nodes than K (a draft model's alternatives).
    Its first nodes are a tree, and the cut depends on the context's length alone, so verification stays exact."""
    if len(draft) <= room:
        return draft, cut
    return draft.prefix(room), cut + len(draft) - room


def verify(
    target: Target,
    pending: int,
    draft: Draft,
    params: SamplingParams,
    random: RandomSource,
    verifier: ChainVerifier,
) -> tuple[Verdict, float]:
    """Score [pending, draft_tokens] in one pass, verify with `random` (offset 0: the first draft
    position), and roll the cache back; also the seconds the draft's `observe_logits` took.

    A tree goes to `verify_tree` (tree attention), unless its nodes form one path (each node's parent
    the node before it, or no node: a tree the K policy cut to its trunk, a drafter with one
    continuation), which is verified here as a chain: `verify.tree`'s rule at one child a node is the
    chain's, and the chain's way costs less (the verification of a `suffix-tree` draft cut to one node
    took 4.52 ms as a tree, 3.68 as a chain, medians of `benchmarks/policy_trace.py`'s steps: bundled
    model, blocks, t = 1, Intel Xeon). Its verdict then names the accepted nodes as a tree's does, for
    the statistics by depth and rank."""
    if draft.is_tree and not torch.equal(draft.parents, chain_parents(len(draft))):
        return verify_tree(target, pending, draft, params, random, verifier.tree)
    start = target.length
    scored = scored_rows(pending, draft)  # [k + 1]
    logits = target.score(scored)  # [k + 1, vocab]
    observing = observe(draft, scored, logits)
    verdict = verifier(draft.tokens, draft.probs, logits, params, random)
    target.rollback(start + 1 + verdict.accepted)
    if draft.is_tree:
        verdict = replace(verdict, path=tuple(range(verdict.accepted)))
    return verdict, observing


def verify_tree(
    target: ScoresTrees,
    pending: int,
    draft: Draft,
    params: SamplingParams,
    random: RandomSource,
    verifier: TreeVerifier,
) -> tuple[Verdict, float]:
    """Score the tree [pending, nodes] (pending the root) in one pass, verify it with `random`, and keep
    the accepted path in the cache. Also the seconds the draft's `observe_logits` took."""
    start = target.length
    parents = torch.cat([torch.tensor([-1]), draft.parents + 1])  # [n + 1]: node i is row i + 1
    scored = scored_rows(pending, draft)  # [n + 1]
    logits = target.score_tree(scored, parents)  # [n + 1, vocab]
    observing = observe(draft, scored, logits)
    verdict = verifier(draft.tokens, draft.parents, draft.probs, logits, params, random)
    target.keep_path(start, [0] + [node + 1 for node in verdict.path])
    return verdict, observing


def observe(draft: Draft, scored: Tensor, logits: Tensor) -> float:
    """Show the pass's tokens `scored` [n + 1] and logits [n + 1, vocab] to the draft's `observe_logits`
    hook, if it has one; the seconds it took.

    The hook is the drafter's work (Token Recycling refreshes its table from every row it is shown), so
    the step counts it as drafting, not as the target's pass: timed as the pass, a step that asked Token
    Recycling for a draft it did not have (then 0.25 ms a row of torch.topk) took 15% longer than a
    plain step and was counted as f(1), and the K policy never saw what asking it cost (bundled model,
    blocks, t = 1, Intel Xeon)."""
    if draft.observe_logits is None:
        return 0.0
    start = perf_counter()
    draft.observe_logits(scored, logits)
    return perf_counter() - start


def scored_rows(pending: int, draft: Draft) -> Tensor:
    """The tokens a step scores: [pending, draft_tokens] [k + 1] (no concatenation at a plain step)."""
    return torch.cat([torch.tensor([pending]), draft.tokens]) if len(draft) else torch.tensor([pending])


def looks(drafter: Drafter, policy: KPolicy, params: SamplingParams) -> bool:
    """Whether a request's plain steps look at its drafter (`peek`): a greedy request, a lookup drafter
    and a K policy that learns from the looks (`policy.Peeks`). Decided once a request (a protocol's
    isinstance check costs about 10 us).

    Greedy requests only: at temperature 0 a lookup drafter's token is either what the answer copies
    or wrong, in runs, and the looks let the cost model follow them (tuned Spec-Bench prompts, in one
    process: 1.22x plain decoding against 1.16x without them, as fast as a fixed K = 4, AMD EPYC
    AVX-512); when sampling its token is emitted at a low, steady rate that the policy's probes
    measure already, and the looks, about 80 us each with the CPU's caches cold after a pass, cost
    1 to 3% of decoding (BENCHMARKS.md)."""
    return params.greedy and drafter.is_lookup and isinstance(policy, Peeks)


def peek(drafter: Drafter, policy: Peeks, k: int, random: RandomSource) -> Tensor | None:
    """At a plain step (k = 0) of a request that `looks`, the lookup drafter's next token ([0] or [1])
    when the policy wants a look; else None. A lookup's draft is a function of the context, not of a
    draw, so the look changes nothing the step emits."""
    if k == 0 and policy.wants_peek():
        return drafter.propose(1, random).trunk().tokens[:1]
    return None


def tell_peek(policy: Peeks, peeked: Tensor | None, emitted: list[int]) -> None:
    """Tell the policy what a `peek` of this step showed: whether the drafter had a token, and whether
    the step emitted it."""
    if peeked is not None:
        policy.observe_peek(len(peeked) > 0, len(peeked) > 0 and int(peeked[0]) == emitted[0])


def answer_step(draft: Draft, verdict: Verdict, new: list[int], draft_seconds: float, verify_seconds: float,
                cut: int, chosen: int | None, asked: int | None) -> Step:
    """A step's record as far as the answer goes: accepted draft tokens after an EOS (`new` ends there) are
    not emitted, so neither they nor their nodes on a tree's accepted path count as accepted (`Step.answered`)."""
    step = Step(len(draft), verdict.accepted, len(new), draft_seconds, verify_seconds, draft.parents, verdict.path, cut,
                chosen, asked)
    return step.answered(len(new))


def cut_at_eos(tokens: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """Tokens up to and including the first EOS token."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


def check_lengths(target: Target, prompt_tokens: int, max_new_tokens: int) -> None:
    if prompt_tokens < 1:
        raise ValueError("the prompt is empty")
    check_max_new_tokens(max_new_tokens)
    if prompt_tokens + max_new_tokens > target.max_length:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) and up to {max_new_tokens} new tokens exceed the context "
            f"window of {target.max_length} tokens"
        )


def check_max_new_tokens(max_new_tokens: int) -> int:
    """`max_new_tokens` if it is an integer >= 1, else a ValueError (2.5, "3" and True are not)."""
    max_new_tokens = integer(max_new_tokens, "max_new_tokens")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return max_new_tokens
