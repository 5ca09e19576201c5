"""Batched decoding: the decode loop of engine.py as a step over several running requests.

Each running request holds a slot of the target's `Slots` (models/target.py): a KV cache of its
own, which, as in engine.py, holds every token of its text but the pending one. A step asks each
request's drafter for its draft (K by its slot's policy), scores [pending, draft_tokens] of every
request in one target pass (each slot its own rows after its own context: the weights stream once
for all of them), verifies each request on its own rows with its own `SamplingParams` and
`RandomSource`, rolls each slot back to its accepted length and emits each request's tokens.

Requests join (`add`: their slot's prefill) and leave (`remove`) between steps, so a server admits
waiting requests into the running batch (continuous batching). With `prefill_chunk`, a prompt longer
than that is prefilled a chunk at a time, one chunk before each step, so the running requests go on
while it prefills rather than waiting for the whole of it (chunked prefill). A row's logits do not depend on the
other rows of the pass (`Slots`), so a request's tokens are those engine.decode gives it alone, for
a greedy request and for a request with a seed, whatever else runs and whenever it joined.

Each slot keeps a drafter and a K policy, used by one request after another: the drafters are forks
of one drafter (`drafters.base.Forks`), so lookup drafters share what they learn across requests
(the suffix drafter's tree of earlier ones). The batch measures f(rows), the seconds of its pass
over all its rows (`policy.PassCost`, beyond the rows measured from `cost_prior`, the target's
f(n)/f(1) on this machine); a policy that sees the batch (`policy.SeesBatch`, `auto` in a
batch) chooses K knowing it and the other requests' rows, and drafts less where rows stop being free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from time import perf_counter

from torch import Tensor

from specsample.drafters.base import Draft, Drafter, end_request, forked, plain_draft
from specsample.drafters.prediction import with_prediction
from specsample.engine import answer_step, check_lengths, cut_at_eos, kept, looks, observe, peek, scored_rows, tell_peek
from specsample.models.target import Slots
from specsample.policy import KPolicy, PassCost, SeesBatch
from specsample.sampling import RandomSource, SamplingParams
from specsample.stats import Stats
from specsample.verify import ChainVerifier


@dataclass(eq=False)
class Request:
    """One request of a batch: what it asks for, and where it is."""

    prompt_ids: Tensor  # [n]
    params: SamplingParams
    max_new_tokens: int
    random: RandomSource
    stats: Stats = field(default_factory=Stats)
    slot: int | None = None  # while prefilling or running
    prefilled: int = 0  # positions of the prompt but its last token in its slot's cache
    pending: int = 0  # the last token of the text, not yet in the slot's cache
    produced: int = 0  # tokens emitted so far
    done: bool = False  # ended by an EOS token or max_new_tokens
    rows: int = 1  # rows it scored at its last step (1 before its first)
    emitted: int = 1  # tokens it emitted at its last step
    looks: bool = False  # whether its plain steps look at its drafter (`engine.looks`)
    prediction: list[int] | None = None  # token ids of a predicted answer, drafted from first (`drafters.prediction`)


@dataclass
class Totals:
    """What a batch has done so far: its steps, the rows they scored, and where their time went."""

    steps: int = 0
    rows: int = 0  # rows scored, summed over steps
    step_seconds: float = 0.0  # whole steps: drafting, the pass, verifying
    pass_seconds: float = 0.0  # the target passes alone
    prefill_seconds: float = 0.0  # prompts prefilled by `add` and, chunk after chunk, by `step`


@dataclass
class Planned:
    """A running request's part of a step: its draft, and the numbers it is drawn and verified with."""

    request: Request
    draft: Draft
    scored: Tensor  # [pending, draft_tokens]: the rows the pass scores for it
    numbers: RandomSource
    start: int  # the slot's length before the pass
    draft_seconds: float
    peeked: Tensor | None = None  # at a plain step, the lookup drafter's next token (`engine.peek`)
    cut: int = 0  # draft tokens the policy left unverified (`KPolicy.keep`)
    chosen: int | None = None  # the K the policy chose (`KPolicy.choose`)
    asked: int | None = None  # the K asked of the drafter, within the tokens left and the slot's rows


class Batch:
    """Running requests sharing one target pass per step, at most `slots.count` at once."""

    def __init__(
        self,
        slots: Slots,
        drafter: Drafter,
        policy: Callable[[], KPolicy],
        *,
        eos_token_ids: frozenset[int],
        verifier: ChainVerifier = ChainVerifier(),
        cost_prior: Mapping[int, float] | None = None,
        prefill_chunk: int | None = None,
        lock: AbstractContextManager = nullcontext(),
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.slots, self.eos_token_ids, self.verifier = slots, eos_token_ids, verifier
        self.lock = lock  # held by add, remove and step: the drafter's forks share its state (a reentrant lock)
        self.prefill_chunk = prefill_chunk  # positions a prompt prefills at a time (None: all at once)
        self.forks = [forked(drafter) for _ in range(slots.count)]  # per slot
        self.drafters = list(self.forks)  # per slot: its request's drafter, the fork after any prediction
        self.plain = [plain_draft(d) for d in self.drafters]  # per slot: its drafter's plain-step draft
        self.policies = [policy() for _ in range(slots.count)]  # per slot
        self.free = list(range(slots.count - 1, -1, -1))  # slots without a request, next last
        self.prefilling: list[Request] = []  # in their slots, their prompts not all prefilled yet, oldest first
        self.running: list[Request] = []
        self.rows = 0  # rows scored by the last step
        # f(rows) of this batch's passes, for the policies that see the batch
        self.cost = PassCost(prior=cost_prior, drafts_alone=slots.drafts_pass_alone)
        self.totals = Totals()

    @property
    def full(self) -> bool:
        return not self.free

    @property
    def busy(self) -> bool:
        """Whether a request is in the batch, prefilling or running."""
        return bool(self.prefilling or self.running)

    def add(self, request: Request) -> None:
        """Start `request` in a free slot: prefill its prompt but the last token (its first
        `prefill_chunk` positions, the rest in later steps). ValueError for a request that does not fit
        the context window or when every slot is taken."""
        check_lengths(self.slots, request.prompt_ids.shape[0], request.max_new_tokens)
        if not self.free:
            raise ValueError(f"all {self.slots.count} slots are taken")
        with self.lock:
            start = perf_counter()
            request.slot = self.free.pop()
            request.stats.prompt_tokens = request.prompt_ids.shape[0]
            self.prefilling.append(request)
            try:
                request.prefilled = self.slots.prefill(request.slot, request.prompt_ids[:-1], self.prefill_chunk)
                self._prefilled(request, start)
            except BaseException:  # the slot stays free
                self.remove(request)
                raise

    def _prefill_some(self) -> None:
        """The next chunk of the oldest prompt still prefilling, one a step even when no request runs, so that
        the batch's owner admits and drops requests (a client gone mid-prefill) between any two chunks."""
        if not self.prefilling:
            return
        start, request = perf_counter(), self.prefilling[0]
        chunk = request.prompt_ids[request.prefilled : -1][: self.prefill_chunk]  # [<= prefill_chunk]
        self.slots.extend(request.slot, chunk)
        request.prefilled += chunk.shape[0]
        self._prefilled(request, start)

    def _prefilled(self, request: Request, start: float) -> None:
        """A request whose prompt is all in its slot starts running (its drafter and policy begin); the
        prefill since `start` is counted."""
        if request.prefilled == request.prompt_ids.shape[0] - 1:
            slot = request.slot
            if request.prediction is not None or self.drafters[slot] is not self.forks[slot]:
                drafter = self.forks[slot] if request.prediction is None else with_prediction(self.forks[slot], request.prediction)
                self.drafters[slot], self.plain[slot] = drafter, plain_draft(drafter)
            self.drafters[slot].begin(request.prompt_ids, request.params)
            self.policies[slot].begin()
            request.pending = int(request.prompt_ids[-1])
            request.looks = looks(self.drafters[slot], self.policies[slot], request.params)
            self.prefilling.remove(request)
            self.running.append(request)
        seconds = perf_counter() - start
        request.stats.prefill_seconds += seconds
        self.totals.prefill_seconds += seconds

    def remove(self, request: Request) -> None:
        """Take `request` out of the batch (ended, or cancelled between steps) and free its slot."""
        with self.lock:
            if request in self.prefilling:
                self.prefilling.remove(request)
            elif request in self.running:
                self.running.remove(request)
                request.stats.policy = self.policies[request.slot].estimates()
                end_request(self.drafters[request.slot])
            else:
                return
            self.free.append(request.slot)
            request.slot = None

    def step(self) -> list[tuple[Request, list[int]]]:
        """One verification step of every running request, after the next chunk of a prompt still
        prefilling: each running request's new tokens. Requests that ended (EOS, max_new_tokens) are
        marked `done` and leave the batch."""
        with self.lock:
            return self._step()

    def _step(self) -> list[tuple[Request, list[int]]]:
        self._prefill_some()
        if not self.running:
            return []
        start = perf_counter()
        self.rows = sum(request.rows for request in self.running)  # as planned so far
        planned = [self._plan(request) for request in self.running]
        scoring = perf_counter()
        logits = self.slots.score([(p.request.slot, p.scored) for p in planned])  # [k_i + 1, vocab] each
        pass_seconds = perf_counter() - scoring
        self.cost.observe(self.rows, pass_seconds, len(planned))
        out = [(p.request, self._verify(p, rows, pass_seconds)) for p, rows in zip(planned, logits)]
        seconds = perf_counter() - start
        for request, _ in out:
            request.stats.decode_seconds += seconds
            if request.done:
                self.remove(request)
        self._count(pass_seconds, seconds)
        return out

    def _count(self, pass_seconds: float, step_seconds: float) -> None:
        totals = self.totals
        totals.steps, totals.rows = totals.steps + 1, totals.rows + self.rows
        totals.pass_seconds += pass_seconds
        totals.step_seconds += step_seconds

    def _plan(self, request: Request) -> Planned:
        """The request's draft: K by its slot's policy, at most what max_new_tokens leaves and what a slot
        scores in one pass."""
        start = perf_counter()
        policy, drafter = self.policies[request.slot], self.drafters[request.slot]
        if isinstance(policy, SeesBatch):
            other_tokens = sum(r.emitted for r in self.running) - request.emitted
            policy.see_batch(self.cost, self.rows - request.rows, other_tokens, len(self.running) - 1)
        chosen = policy.choose()
        k = min(chosen, request.max_new_tokens - request.produced - 1, self.slots.max_rows - 1)
        numbers = request.random.at(request.produced)  # offset i: output position produced + i
        draft = drafter.propose(k, numbers).trunk() if k > 0 else self.plain[request.slot]  # slots score chains
        peeked = peek(drafter, policy, k, numbers) if request.looks else None
        draft, cut = kept(draft, policy)  # a chain: cut only on its confidences
        self.rows += len(draft) + 1 - request.rows
        request.rows = len(draft) + 1
        seconds = perf_counter() - start
        scored = scored_rows(request.pending, draft)
        return Planned(request, draft, scored, numbers, self.slots.length(request.slot), seconds, peeked, cut, chosen, k)

    def _verify(self, planned: Planned, logits: Tensor, pass_seconds: float) -> list[int]:
        """Verify one request's draft on its logits [k + 1, vocab], roll its slot back and record the step.
        The draft's `observe_logits` hook, where it has one, sees its rows, timed as drafting (engine.py)."""
        request, draft = planned.request, planned.draft
        observing = observe(draft, planned.scored, logits)
        start = perf_counter()
        verdict = self.verifier(draft.tokens, draft.probs, logits, request.params, planned.numbers)
        self.slots.rollback(request.slot, planned.start + 1 + verdict.accepted)
        emitted = draft.tokens[: verdict.accepted].tolist() + [verdict.next_token]
        self.drafters[request.slot].observe(emitted)
        new = cut_at_eos(emitted, self.eos_token_ids)
        verify_seconds = pass_seconds + perf_counter() - start  # the shared pass, then its own verification
        step = answer_step(draft, verdict, new, planned.draft_seconds + observing, verify_seconds, planned.cut,
                           planned.chosen, planned.asked)
        request.stats.record(step)
        self.policies[request.slot].observe(step)
        tell_peek(self.policies[request.slot], planned.peeked, emitted)
        request.produced += len(new)
        request.emitted = len(new)
        request.pending = verdict.next_token
        request.done = new[-1] in self.eos_token_ids or request.produced >= request.max_new_tokens
        return new


def drain(batch: Batch, requests: Iterable[Request], feed: Callable[[Request, list[int]], bool]) -> None:
    """Run `requests` through `batch` until all have ended, each joining as soon as a slot frees
    (continuous batching). `feed` takes a request's new tokens after each step and says whether the
    request stops there (a stop string), besides ending by EOS or max_new_tokens."""
    waiting = deque(requests)
    try:
        while waiting or batch.busy:
            while waiting and not batch.full:
                batch.add(waiting.popleft())
            for request, new in batch.step():
                if feed(request, new):
                    batch.remove(request)
    except BaseException:  # an error or Ctrl-C mid-run: the requests end, and their drafters' state with them
        for request in [*batch.prefilling, *batch.running]:
            batch.remove(request)
        raise
