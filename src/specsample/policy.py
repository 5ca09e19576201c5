"""The choice of K, the speculation length, before each verification step."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from specsample.sampling import integer
from specsample.stats import Step
from specsample.tree import depths


CONFIDENCE_BINS = 10  # a drafter's confidence is calibrated per tenth of its range
CALIBRATION_PRIOR = 4.0  # pseudo-observations behind each calibration: of a bin, on the line; of the line, on identity
COST_EVIDENCE_STEPS = 2  # drafting steps before the drafter's cheapest one bounds the optimism about its cost
FLOOR_HALF_LIFE = 128  # steps without a draft over which that bound first halves (`draft_floor`)
RANK_DECAY = 0.5  # a tree node's prior acceptance: prior_acceptance * RANK_DECAY ** (its sibling rank)
PRIOR_COST_WEIGHT = 3  # the machine's measured f(n)/f(1) (`see_cost_curve`) counts as this many passes
IDLE_RECHECK = 8  # while K = 0, the model is re-evaluated once in this many plain steps
PEEK_MOST = 8  # after misses, a plain step looks at a lookup drafter's next token once in this many (`Peeks`)
OUTLIER = 1.5  # a pass timed above this many times its moving average counts as this many (`smoothed`)


@runtime_checkable
class KPolicy(Protocol):
    def begin(self) -> None:
        """A new request starts."""
        ...

    def choose(self) -> int:
        """K for the next step (0: decode one token without drafting)."""
        ...

    def keep(self, confidence: Tensor) -> int:
        """How many tokens of a draft to verify, given the drafter's confidence in each [k]."""
        ...

    def keep_tree(self, parents: Tensor) -> Tensor:
        """Which nodes of a point-mass tree draft to verify, given its `parents` [n]: their indices,
        ascending, a set that holds each kept node's parent and earlier siblings (so still a tree, whose
        nodes keep their depths and sibling ranks)."""
        ...

    def observe(self, step: Step) -> None:
        """The outcome of the step just taken."""
        ...

    def estimates(self) -> dict:
        """What the policy believes now, for the statistics."""
        ...


@runtime_checkable
class SeesBatch(Protocol):
    """A K policy that chooses K knowing the batch its request runs in (batch.py)."""

    def see_batch(self, cost: PassCost, other_rows: float, other_tokens: float, others: int) -> None:
        """Before `choose`: the batch's pass cost f(rows), and the rows, expected tokens and number of the
        other requests of the step."""
        ...


@runtime_checkable
class Peeks(Protocol):
    """A K policy that learns at the steps it leaves plain (K = 0) from a look at a lookup drafter's next
    token (`engine.peek`, greedy requests), which costs no verification: whether the target then emitted
    that token is exactly whether a draft of it would have been accepted (at any temperature: a point
    mass on x is accepted with probability target_prob(x), the probability that the target emits x)."""

    def wants_peek(self) -> bool:
        """At a plain step: whether to look at the drafter's next token this time."""
        ...

    def observe_peek(self, drafted: bool, accepted: bool) -> None:
        """After a plain step: whether the drafter had a token, and whether the step emitted it."""
        ...


@runtime_checkable
class SeesCostCurve(Protocol):
    """A policy that starts from the target's cost curve measured on this machine (`cost_curve.machine_ratios`)."""

    def see_cost_curve(self, ratios: Mapping[int, float]) -> None: ...


@runtime_checkable
class SeesDraftCost(Protocol):
    """A K policy told, before a request, what a draft token costs relative to a target pass
    (the drafter's `DeclaresCost`), so that it never tries a drafter that cannot pay."""

    def see_draft_cost(self, relative: float) -> None:
        """A draft token costs `relative` times a target pass over one token."""
        ...


class FixedK:
    """Always the same K."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def begin(self) -> None:
        pass

    def choose(self) -> int:
        return self.k

    def keep(self, confidence: Tensor) -> int:
        return len(confidence)

    def keep_tree(self, parents: Tensor) -> Tensor:
        return torch.arange(len(parents))

    def observe(self, step: Step) -> None:
        pass

    def estimates(self) -> dict:
        return {"policy": "fixed", "k": self.k}


class HeuristicK:
    """The schedule of transformers' assisted generation: K + 2 after a fully
    accepted draft, K - 1 (never below 1) after a rejection; unchanged when the
    drafter proposed nothing. Starts again from `k_start` at each request."""

    def __init__(self, k_start: int = 4, k_max: int = 16) -> None:
        if not 1 <= k_start <= k_max:
            raise ValueError(f"need 1 <= k_start <= k_max, got {k_start} and {k_max}")
        self.k_start, self.k_max = k_start, k_max
        self.k = k_start

    def begin(self) -> None:
        self.k = self.k_start

    def choose(self) -> int:
        return self.k

    def keep(self, confidence: Tensor) -> int:
        return len(confidence)

    def keep_tree(self, parents: Tensor) -> Tensor:
        return torch.arange(len(parents))

    def observe(self, step: Step) -> None:
        if step.drafted == 0:
            return
        grown = self.k + 2 if step.accepted == verified_positions(step) else self.k - 1  # a tree: its deepest path
        self.k = max(1, min(self.k_max, grown))

    def estimates(self) -> dict:
        return {"policy": "heuristic", "k": self.k}


class CostModelK:
    """The K that maximises expected tokens per second, measured online.

    A step that asks for K draft tokens emits 1 + sum_{i<=K} P(accepted >= i)
    tokens on average and costs the drafting (what asking for a draft costs,
    `ask_seconds`, plus seconds per drafted token times the expected draft
    length d) plus f(1 + v), the target's time to score
    1 + v positions, v the expected tokens of the draft verified (all that were
    drafted, but where `keep` cuts a draft). P(accepted >= i), P(drafted >= i) and
    P(verified >= i), given K >= i, are
    products of per-position rates P(>= i | >= i - 1), counted with exponential
    forgetting (`decay` per drafting step, `idle_decay` per plain one, `carry`
    at a new request) on top of a prior. The cost curve f(n) is f(1), a moving
    average of the plain steps' seconds, times f(n)/f(1), a moving average per
    n of each step's seconds over the f(1) of its time, made nondecreasing,
    interpolated between measured n and flat beyond them, so an unmeasured
    larger K looks cheap and gets tried; f(1) is measured by a plain first
    step. A pass costs more over a longer context, and plain steps measure
    f(1) again while K = 0: kept as ratios, the longer passes, last measured
    over a longer context (a summary's prompt), follow f(1) down to a short
    prompt's, instead of holding K at 0 with their stale cost. K = 0, plain
    decoding, wins when drafting does not pay. While it does, the model is
    re-evaluated once every IDLE_RECHECK plain steps, and their forgetting is
    applied then, all at once: what changes between two plain steps is a slow
    decay, and plain decoding's step must cost what `--drafter none`'s does.
    So is a K > 0 at which the drafter had nothing to propose (a lookup drafter
    over a text without repeats): K is kept, not re-chosen, for up to
    IDLE_RECHECK steps that draft nothing, while each still counts as a step
    that asked for K; a step that drafts is always followed by a new choice.

    The drafting's measured cost fades while K = 0, toward a floor: the cheapest
    cost per draft token of any step, so that a drafter whose every draft token
    cost a target pass is not tried again at each re-evaluation. The floor fades
    too, slower, halving over FLOOR_HALF_LIFE steps without a draft: a process
    whose first drafts all paid for cold caches (the drafter's weights read from
    disk, its buffers first touched) would otherwise keep K at 0 for good (two
    such drafts did, whatever came after). A return that finds no cheaper draft
    token doubles the half-life; one that does resets it. So a drafter that
    never pays costs a draft every 128, 256, 512, ... plain steps.

    Trying costs: before a drafter's cost and acceptance are known, a long draft
    may waste many target passes' worth of time (a draft model's K forwards). So
    K grows at most to twice the largest K asked so far (1, 2, 4, ...): each
    guess is tested on a draft at most twice as long as the evidence behind it.
    A drafter that declares its cost c per draft token relative to a target pass
    (`see_draft_cost`) is judged on it from the first step: the unmeasured drafting
    is priced at c f(1) rather than free, and returns to it as measurements decay,
    so a drafter with c >= 1, which no acceptance repays (K tokens all accepted give
    (K + 1) / (f(K + 1)/f(1) + K c) <= 1 times plain decoding's speed, f nondecreasing),
    is never asked to draft: the prior acceptance is below 1.

    At K = 0 the first position is also measured without a verification row where the engine
    shows the policy a lookup drafter's next token (`observe_peek`, greedy requests): a step that
    emits it is a draft of one token that would have been accepted. The looks back off after misses
    (`wants_peek`), and a hit has the model evaluated at once, so K follows the runs of text an
    answer copies instead of waiting up to IDLE_RECHECK steps for its next probe.

    A drafter that reports its confidence in each draft token gets its draft
    verified token by token while each adds to the expected tokens per second of
    the verification pass (`keep`). Confidences are calibrated online, since a
    drafter close to the target (its own int8 copy) is accepted far more often
    than its own probabilities say: the acceptance measured per tenth of the
    confidence range, shrunk toward a line fitted to every verified token
    (`calibration_line`), itself shrunk toward the drafter's own figure. Each
    prior is worth `CALIBRATION_PRIOR` observations. Per tenth alone, a drafter
    whose confidences spread over the range learns each tenth slowly, and in the
    meantime its drafts are cut after they are drafted: the int8 copy, accepted
    at 0.95 with confidences of 0.1 to 1, drafted 16 tokens to have 1 verified,
    and the K policy, charged for the 16, settled on K = 1 (t = 1: 1.12x plain
    decoding against 1.45x at K = 4, AMD EPYC, AVX2). A cut draft's tokens are
    each paid for as drafted, but its verification costs f(1 + v) for the v
    verified, and the first token cut after an accepted one counts neither as
    accepted nor as rejected: it was never verified. So a step is expected to
    emit 1 + sum_i P(accepted >= i | verified) P(not cut >= i), the second
    measured over the drafted positions, but for cuts made while the calibration
    rests on fewer verified tokens than its prior's weight: those say what the
    prior made of a draft's confidences, and a position past the K then chosen is
    measured again only at a larger K (the copy at t = 1, cut at its second token
    at its second step, held K at 1 for 35 steps).

    Tree drafts (`Draft.parents`): K is the node budget, and the subtree that is
    verified (`keep_tree`: nodes best first, each with its parent and earlier
    siblings) is the one with the most expected tokens
    per second of verification: node i is accepted with probability the product,
    over its path, of the acceptance measured at each node's depth and sibling
    rank (`tree_reached`, `tree_accepted`, decayed like the counts above, from a
    prior of `prior_acceptance` times RANK_DECAY per rank), and n nodes cost
    f(1 + n). Which nodes are verified then depends on the tree's shape, never
    on a draw, so a point-mass tree stays exact.
    """

    def __init__(
        self,
        k_max: int = 16,
        decay: float = 0.9,
        idle_decay: float = 0.98,
        prior_acceptance: float = 0.7,
        prior_weight: float = 0.25,
        smoothing: float = 0.2,
        carry: float = 0.5,
        peek_most: int = PEEK_MOST,
    ) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if peek_most < 1:
            raise ValueError(f"peek_most must be >= 1, got {peek_most}")
        self.k_max, self.decay, self.idle_decay, self.smoothing = k_max, decay, idle_decay, smoothing
        self.prior_acceptance, self.prior_weight, self.carry = prior_acceptance, prior_weight, carry
        # [position i - 1] decayed counts of the steps that asked for >= i tokens and
        self.drafted_reached = [0.0] * k_max  # drafted >= i - 1,
        self.drafted_ge = [0.0] * k_max  # of them, drafted >= i;
        self.verified_reached = [0.0] * k_max  # verified >= i - 1,
        self.verified_ge = [0.0] * k_max  # of them, verified >= i;
        self.uncut_reached = [0.0] * k_max  # drafted >= i and verified >= i - 1,
        self.uncut_ge = [0.0] * k_max  # of them, verified >= i (not cut by `keep`);
        self.accepted_reached = [0.0] * k_max  # accepted >= i - 1,
        self.accepted_ge = [0.0] * k_max  # of them, accepted >= i
        self.f1: float | None = None  # moving average of a plain step's seconds
        self.relative_cost: dict[int, float] = {}  # n positions scored -> moving average of f(n) / f(1)
        self.verify_count: dict[int, int] = {}  # n positions scored -> steps measured
        self.ratio_fit: tuple[list[int], list[float]] | None = None  # nondecreasing f(n)/f(1), refitted when they move
        self.draft_seconds = 0.0  # decayed totals over steps that drafted
        self.drafted_tokens = 0.0
        self.asking_steps = 0.0  # decayed count of the steps that asked for K >= 1,
        self.empty_steps = 0.0  # of them, those that got no draft token,
        self.empty_seconds = 0.0  # and their drafting seconds: what asking costs (`ask_seconds`)
        self.cheapest_draft_token = math.inf  # the lowest seconds per draft token of any step so far
        self.drafting_steps = 0  # steps that drafted a token, ever
        self.undrafted_steps = 0  # steps since the last one that drafted a token
        self.floor_half_life = FLOOR_HALF_LIFE  # of the cheapest draft token's bound, in those steps
        self.declared_draft_cost: float | None = None  # a draft token's seconds over f(1), as the drafter declares
        self.largest_k = 0  # the largest K asked so far
        # [tenth of the confidence range] verified draft tokens there, and of them accepted
        self.confidence_reached = np.zeros(CONFIDENCE_BINS)
        self.confidence_accepted = np.zeros(CONFIDENCE_BINS)
        # over every verified draft token: count, sums of confidence, its square, accepted, accepted x confidence
        self.confidence_moments = np.zeros(5)
        self.kept_confidence: np.ndarray | None = None  # [n] of the draft prefix now being verified
        self.tree_reached: dict[tuple[int, int], float] = {}  # (depth, rank) -> decayed tree nodes reached there
        self.tree_accepted: dict[tuple[int, int], float] = {}  # of them accepted
        self.idle_pending = 0  # plain steps whose forgetting is not yet applied
        self.idle_skips = 0  # plain steps chosen since the model was last evaluated
        self.predicted_f1 = False  # whether that evaluation knew f(1)
        self.idle = False  # whether the last step scored the pending token alone (K = 0, or nothing drafted)
        self.peek_most, self.peek_every, self.unpeeked = peek_most, 1, 0  # plain steps between looks (`wants_peek`)
        self.k = k_max
        self.begin()

    def begin(self) -> None:
        """A new prompt may suit the drafter more or less: earlier evidence counts `carry` times."""
        self.scale_counts(self.carry)
        self.predict()
        self.idle_skips = IDLE_RECHECK  # and a new request's first step is chosen afresh

    def see_cost_curve(self, ratios: Mapping[int, float]) -> None:
        """Start f(n)/f(1) at each n not measured yet from `ratios`, the target's curve measured on this
        machine, worth PRIOR_COST_WEIGHT passes; the passes this policy times then move it."""
        for n, ratio in ratios.items():
            if n not in self.verify_count:
                self.relative_cost[n], self.verify_count[n] = ratio, PRIOR_COST_WEIGHT
                self.ratio_fit = None

    def see_draft_cost(self, relative: float) -> None:
        """The drafter's declared cost per draft token, relative to f(1): the price of the drafting not yet measured."""
        if not relative >= 0:
            raise ValueError(f"a draft cost must be >= 0, got {relative}")
        self.declared_draft_cost = relative

    def choose(self) -> int:
        if self.idle and self.predicted_f1 and self.idle_skips < IDLE_RECHECK - 1:
            self.idle_skips += 1
            return self.k
        self.predict()
        # Plain decoding is measured first: every other cost is judged against f(1).
        limit = max(1, 2 * self.largest_k) if self.f1 is not None else 0
        self.k = max(range(min(limit, self.k_max) + 1), key=self.rates.__getitem__)
        return self.k

    def keep(self, confidence: Tensor) -> int:
        """Verify token after token while each adds to the expected tokens per second of verification
        (the drafting is spent already); token i counts with the product of the calibrated confidences
        through it. A stopping rule: whether token i is kept depends on confidences up to i only,
        which are known before token i is drawn, so the choice cannot favour some draws over others."""
        raw = confidence.double().numpy()
        through = np.cumprod(self.calibrated(raw))  # [k] P(the first i + 1 tokens are accepted)
        seconds = self.target_seconds(np.arange(1.0, len(raw) + 2))  # [k + 1] f(1 + n) for n kept
        n, tokens = 0, 1.0
        while n < len(raw) and (tokens + through[n]) / seconds[n + 1] > tokens / seconds[n]:
            tokens += through[n]
            n += 1
        self.kept_confidence = raw[:n]
        return n

    def keep_tree(self, parents: Tensor) -> Tensor:
        """The nodes with the most expected tokens per second of their verification pass.

        Nodes are taken best first, by their acceptance capped by their parent's and their earlier
        sibling's place (`tree_priority`), so every set taken holds each node's parent and earlier
        siblings, and the best-paying number of them is kept. Not a prefix in node order: a drafter
        that lists a position's alternatives before the next position's likely token (the quantized
        copy's tree) has the alternatives left out where they pay less than going deeper."""
        if not len(parents):
            return torch.arange(0)
        accepted = self.node_acceptance(parents)  # [n] P(node i is accepted)
        order = np.argsort(-tree_priority(parents, accepted), kind="stable")  # [n] best first, ties by index
        tokens = 1 + np.concatenate([[0.0], np.cumsum(accepted[order])])  # [n + 1] with the first n taken
        seconds = self.target_seconds(np.arange(1.0, len(parents) + 2))  # [n + 1] f(1 + n)
        return torch.from_numpy(np.sort(order[: int(np.argmax(tokens / seconds))]))

    def node_acceptance(self, parents: Tensor) -> np.ndarray:
        """[n] P(node i is accepted): the product over its path of the acceptance at (depth, rank)."""
        through: list[float] = []
        ranks: dict[int, int] = {}  # parent -> children so far
        for depth, parent in zip(depths(parents).tolist(), parents.tolist()):
            rank = ranks[parent] = ranks.get(parent, -1) + 1
            above = 1.0 if parent < 0 else through[parent]
            through.append(above * self.tree_rate(depth, rank))
        return np.array(through)

    def tree_rate(self, depth: int, rank: int) -> float:
        """P(a node at (depth, rank) is accepted | its parent is), measured, shrunk toward the prior."""
        prior = self.prior_acceptance * RANK_DECAY**rank
        reached, accepted = self.tree_reached.get((depth, rank), 0.0), self.tree_accepted.get((depth, rank), 0.0)
        return (accepted + self.prior_weight * prior) / (reached + self.prior_weight)

    def observe_tree(self, step: Step) -> None:
        """Count the tree nodes the step's verification reached, and accepted, by depth and rank."""
        for key in self.tree_reached:
            self.tree_reached[key] *= self.decay
            self.tree_accepted[key] *= self.decay
        for depth, rank, accepted in step.reached():
            self.tree_reached[depth, rank] = self.tree_reached.get((depth, rank), 0.0) + 1
            self.tree_accepted[depth, rank] = self.tree_accepted.get((depth, rank), 0.0) + accepted

    def calibrated(self, confidence: np.ndarray) -> np.ndarray:
        """The acceptance rate measured at these confidences [k], shrunk toward them."""
        bins = confidence_bins(confidence)
        reached, accepted = self.confidence_reached[bins], self.confidence_accepted[bins]
        intercept, slope = self.calibration_line()
        line = np.clip(intercept + slope * confidence, 0.0, 1.0)
        return (accepted + CALIBRATION_PRIOR * line) / (reached + CALIBRATION_PRIOR)

    def calibration_line(self) -> tuple[float, float]:
        """(intercept, slope) of acceptance against confidence: least squares over the verified draft
        tokens and `CALIBRATION_PRIOR` pseudo-tokens on the identity line (half at confidence 0, never
        accepted, half at 1, always), so that with no evidence it is the drafter's own figure."""
        half = CALIBRATION_PRIOR / 2
        n, c, cc, a, ac = self.confidence_moments + np.array([2 * half, half, half, half, half])
        slope = (n * ac - c * a) / (n * cc - c * c)  # the pseudo-tokens at 0 and 1 keep this finite
        return (a - slope * c) / n, slope

    def observe(self, step: Step) -> None:
        # Whether a cut by `keep` counts: not while the calibration rests on its prior (class docstring).
        calibrated = self.kept_confidence is None or self.confidence_moments[0] >= CALIBRATION_PRIOR
        self.observe_confidence(step)
        if step.parents is not None:
            self.observe_tree(step)
        self.observe_cost(step.drafted + 1, step.verify_seconds)
        self.idle = step.drafted == 0
        drafted = step.drafted + step.cut  # each paid for, verified or not
        self.observe_draft_cost(drafted, step.draft_seconds)
        if self.k == 0:
            self.idle_pending += 1  # forgotten at the next evaluation (`forget_idle`)
            return
        asked = self.k if step.asked is None else min(self.k, step.asked)
        if asked == 0:  # a plain step because one token was left: nothing learned of the drafter
            return
        self.forget_idle()
        self.scale_counts(self.decay)
        self.largest_k = max(self.largest_k, asked)
        # Every verified position accepted and some cut: the first cut one was not verified, so not rejected
        # either. A tree's positions are its depths: its verified subtree fully accepted is its deepest path.
        seen = step.accepted if step.cut and step.accepted == verified_positions(step) else step.accepted + 1
        self.draft_seconds = self.decay * self.draft_seconds + step.draft_seconds
        self.drafted_tokens = self.decay * self.drafted_tokens + drafted
        self.asking_steps = self.decay * self.asking_steps + 1
        self.empty_steps = self.decay * self.empty_steps + (drafted == 0)
        self.empty_seconds = self.decay * self.empty_seconds + (step.draft_seconds if drafted == 0 else 0.0)
        for i in range(asked):  # position i + 1, asked for
            self.drafted_reached[i] += i <= drafted
            self.drafted_ge[i] += i < drafted
            self.verified_reached[i] += i <= step.drafted
            self.verified_ge[i] += i < step.drafted
            self.uncut_reached[i] += i < step.drafted or (calibrated and i == step.drafted < drafted)
            self.uncut_ge[i] += i < step.drafted
            self.accepted_reached[i] += i < seen
            self.accepted_ge[i] += i < step.accepted

    def observe_draft_cost(self, drafted: int, seconds: float) -> None:
        """A step drafted `drafted` tokens in `seconds`: the cheapest draft token so far, and how fast its
        bound fades (class docstring: a return after FLOOR_HALF_LIFE / 2 or more steps without a draft
        that finds no cheaper token doubles the half-life; a cheaper token resets it)."""
        if not drafted:
            self.undrafted_steps += 1
            return
        per_token = seconds / drafted
        if per_token < self.cheapest_draft_token:
            self.cheapest_draft_token, self.floor_half_life = per_token, FLOOR_HALF_LIFE
        elif self.undrafted_steps >= FLOOR_HALF_LIFE // 2:
            self.floor_half_life *= 2
        self.drafting_steps += 1
        self.undrafted_steps = 0

    def draft_floor(self) -> float:
        """The least seconds per draft token the estimate may fade to: none until COST_EVIDENCE_STEPS
        steps have drafted, then the cheapest draft token seen, halving over `floor_half_life` steps
        without a draft."""
        if self.drafting_steps < COST_EVIDENCE_STEPS:
            return 0.0
        return self.cheapest_draft_token * 0.5 ** (self.undrafted_steps / self.floor_half_life)

    def wants_peek(self) -> bool:
        """Whether this plain step looks at the drafter's next token (`Peeks`): after a hit every step,
        after each miss half as often, down to once in `peek_most` steps: a look costs about 80 us with
        the CPU's caches cold after a pass (3% of the bundled model's plain step), worth it where the
        answer copies text and the hits come in runs, not between them."""
        self.unpeeked += 1
        if self.unpeeked < self.peek_every:
            return False
        self.unpeeked = 0
        return True

    def observe_peek(self, drafted: bool, accepted: bool) -> None:
        """A plain step's look at a lookup drafter's next token (`Peeks`): evidence on the first draft
        position as from a step that asked for one token, bought without a verification row, so a
        lookup drafter's run of matches (text the answer copies) is seen while K = 0, not only at the
        next probe. A hit has the next `choose` evaluate the model at once rather than keep K = 0 for
        up to IDLE_RECHECK steps."""
        self.drafted_reached[0] += 1
        self.drafted_ge[0] += drafted
        self.verified_reached[0] += 1
        self.verified_ge[0] += drafted
        self.uncut_reached[0] += drafted
        self.uncut_ge[0] += drafted
        self.accepted_reached[0] += 1
        self.accepted_ge[0] += accepted
        if accepted:
            self.idle_skips = IDLE_RECHECK
        self.peek_every = 1 if accepted else min(2 * self.peek_every, self.peek_most)

    def observe_cost(self, n: int, seconds: float) -> None:
        """One pass over n positions took `seconds`: update f(1), or f(n)/f(1) against the f(1) of now."""
        if n == 1:
            self.f1 = seconds if self.f1 is None else smoothed(self.f1, seconds, self.smoothing)
            if 1 not in self.relative_cost:
                self.relative_cost[1], self.ratio_fit = 1.0, None
        else:
            ratio = seconds / (self.f1 or seconds)
            self.relative_cost[n] = smoothed(self.relative_cost.get(n, ratio), ratio, self.smoothing)
            self.ratio_fit = None
        self.verify_count[n] = self.verify_count.get(n, 0) + 1

    def observe_confidence(self, step: Step) -> None:
        """Count the verified tokens of a kept draft prefix (those up to the first rejection) by confidence."""
        kept, self.kept_confidence = self.kept_confidence, None
        if kept is None or len(kept) != step.drafted:
            return
        verified = min(step.accepted + 1, step.drafted)
        confidence = kept[:verified]
        bins = confidence_bins(confidence)
        np.add.at(self.confidence_reached, bins, 1.0)
        accepted = (np.arange(verified) < step.accepted).astype(float)
        np.add.at(self.confidence_accepted, bins, accepted)
        self.confidence_moments += [verified, confidence.sum(), confidence @ confidence, accepted.sum(), confidence @ accepted]

    def forget_idle(self) -> None:
        """Apply the forgetting of the plain steps since the last call: the counts, and the drafter's cost,
        decay toward the prior and its cheapest step, so that one slow early measurement does not keep
        K at 0 for good, but a drafter whose every draft token cost as much as a target pass is not
        tried again and again."""
        if self.idle_pending:
            factor = self.idle_decay**self.idle_pending
            self.scale_counts(factor)
            for name in ("draft_seconds", "drafted_tokens", "asking_steps", "empty_steps", "empty_seconds"):
                setattr(self, name, getattr(self, name) * factor)
            self.idle_pending = 0

    def scale_counts(self, factor: float) -> None:
        """Forget: every decayed count times `factor`."""
        for counts in (
            self.drafted_reached, self.drafted_ge, self.verified_reached, self.verified_ge,
            self.uncut_reached, self.uncut_ge, self.accepted_reached, self.accepted_ge,
        ):
            counts[:] = [c * factor for c in counts]

    def predict(self) -> None:
        """Expected tokens per step, draft length and tokens per second for K = 0..k_max.

        Plain Python over k_max + 1 entries: it runs at every drafting step, just after a target pass has
        evicted it from the CPU's caches, where numpy's per-call overhead would cost more than the sums."""
        self.forget_idle()
        self.idle_skips, self.predicted_f1 = 0, self.f1 is not None
        self.accepted_if_verified = self.chain(self.accepted_ge, self.accepted_reached, self.prior_acceptance)
        uncut = self.chain(self.uncut_ge, self.uncut_reached, 1.0)
        self.tokens_per_step = [1 + a for a in running_sums([a * c for a, c in zip(self.accepted_if_verified, uncut)])]
        self.draft_length = self.cumulative(self.drafted_ge, self.drafted_reached, 1.0)  # [K]
        self.verified_length = self.cumulative(self.verified_ge, self.verified_reached, 1.0)  # [K]
        # prior_weight pseudo-tokens stand for what has not been measured: at the declared cost where
        # the drafter declares one, else free until the drafter has drafted in COST_EVIDENCE_STEPS
        # steps; then never below the cheapest cost per token seen, as it fades (`draft_floor`).
        floor = self.draft_floor()
        if self.declared_draft_cost is not None and self.f1 is not None:
            floor = max(floor, self.declared_draft_cost * self.f1)
        prior_seconds = self.prior_weight * floor
        self.ask_cost = self.ask_seconds()
        token_seconds = max(0.0, self.draft_seconds - self.ask_cost * self.asking_steps)
        self.seconds_per_draft_token = (token_seconds + prior_seconds) / (self.drafted_tokens + self.prior_weight)
        self.rates = self.expected_rates()

    def expected_rates(self, other_tokens: float = 0.0) -> list[float]:
        """[K] expected tokens per second of a step that asks for K: its tokens and `other_tokens` (of the
        other requests of a batch) over the drafting, what asking costs, and the target's pass."""
        verify = self.target_seconds([1 + v for v in self.verified_length])
        return [
            (other_tokens + t) / (self.seconds_per_draft_token * d + f + (self.ask_cost if k else 0.0))
            for k, (t, d, f) in enumerate(zip(self.tokens_per_step, self.draft_length, verify))
        ]

    def ask_seconds(self) -> float:
        """What a step that asks for a draft pays whether or not it gets one: the drafting seconds of the
        asking steps that got no draft token (a lookup drafter without a match: its search, and Token
        Recycling's refresh of its table from the pass), 0 until one is measured. Priced per draft token
        instead, it was spread over the tokens of the few steps that drafted and then weighted by how
        rarely a step drafts: Token Recycling at t = 0 on math and QA, which drafts in about 1 asking
        step in 3 and is accepted in 1 in 30, was expected 0.1% faster than plain decoding at K = 1 and
        asked at about 1 step in 15, where each ask cost 0.35 ms and its one-node pass 1.47 f(1)
        (bundled model, blocks, tuned prompts, Intel Xeon)."""
        return self.empty_seconds / self.empty_steps if self.empty_steps > 1e-9 else 0.0

    def cumulative(self, counts: list[float], reached: list[float], prior: float) -> list[float]:
        """[sum_{i<=K} P(count >= i)] for K = 0..k_max (`chain`)."""
        return running_sums(self.chain(counts, reached, prior))

    def chain(self, counts: list[float], reached: list[float], prior: float) -> list[float]:
        """[P(count >= i)] for i = 1..k_max, each the product over j <= i of P(count >= j | count >= j - 1).

        `prior_weight` pseudo-steps stand for what has not been seen: at the first position with
        P = prior, at each later one with the estimate of the position before it. A later position
        is reached only past an accepted one, so it is measured least; with a fixed prior there, a
        drafter measured at 0.14 on its first token (a lookup drafter at temperature 1) still looked
        worth 8 tokens, 0.3 x (1 + 0.7 + 0.7^2 + ...), and was asked for them about once in ten steps.
        As the evidence decays (slowly while K = 0) the estimates return to the prior, so drafting is
        tried again now and then."""
        pseudo = self.prior_weight
        through, out = 1.0, []
        for c, r in zip(counts, reached):
            prior = (c + pseudo * prior) / (r + pseudo)
            through *= prior
            out.append(through)
        return out

    def target_seconds(self, n: Sequence[float]) -> list[float]:
        """f(n) at (fractional) n: the measured seconds, interpolated, flat beyond the measured n;
        1.0 before any measurement. Plain Python, like `predict`, which calls it at every step."""
        if not self.relative_cost:
            return [1.0] * len(n)
        measured, curve = self.cost_curve()
        return [interpolate(x, measured, curve) for x in n]

    def cost_curve(self) -> tuple[list[int], list[float]]:
        """The measured n and f(n) there: a longer pass never costs less than a shorter one, so the
        moving averages of f(n)/f(1) are fitted by a nondecreasing curve, each weighted by its number
        of measurements (up to 10), so that one noisy step at a rarely used n moves little.
        Refitted only when a ratio moves (a plain step moves f(1) alone: the fit is scaled)."""
        if self.ratio_fit is None:
            measured = sorted(self.relative_cost)
            ratios = [self.relative_cost[m] for m in measured]
            weights = [min(self.verify_count[m], 10) for m in measured]
            self.ratio_fit = measured, nondecreasing(ratios, weights)
        measured, fit = self.ratio_fit
        f1 = self.f1 or 1.0
        return measured, [f1 * r for r in fit]

    def estimates(self) -> dict:
        k = self.k
        return {
            "policy": "cost-model",
            "k": k,
            "expected_tokens_per_step": self.tokens_per_step[k],
            "expected_draft_length": self.draft_length[k],
            "expected_verified_length": self.verified_length[k],  # less than the draft where `keep` cuts it
            "expected_tokens_per_second": self.rates[k],
            "target_ms": {n: 1e3 * float(f) for n, f in zip(*self.cost_curve())} if self.relative_cost else {},
            "draft_ms_per_token": 1e3 * self.seconds_per_draft_token,
            "draft_floor_ms": 1e3 * self.draft_floor(),  # the least it may fade to while K = 0
            "ask_ms": 1e3 * self.ask_cost,  # what a step that asks for a draft pays whether or not it gets one
            "declared_draft_cost": self.declared_draft_cost,  # a draft token over f(1), as the drafter declares it
            "p_accepted_through": np.diff(self.tokens_per_step).tolist(),  # [i - 1]: P(first i accepted | K >= i)
            "p_accepted_if_verified": self.accepted_if_verified,  # [i - 1]: the same where none of them is cut
            # [tenth of the confidence range] acceptance rate measured there (drafters that report confidence)
            "calibrated_confidence": self.calibrated((np.arange(CONFIDENCE_BINS) + 0.5) / CONFIDENCE_BINS).tolist(),
        }


class PassCost:
    """f(R): the seconds of one target pass over R rows, the rows of every request of a batch (batch.py),
    measured online by the batch: a moving average per R, fitted nondecreasing and interpolated. Beyond
    the largest R measured it follows `prior`, the target's f(n)/f(1) measured on this machine for one
    sequence (`cost_curve.machine_ratios`), from there, as a lone request's own policy sees it
    (`CostModelK.see_cost_curve`); without one it is flat, so more rows look free until measured and
    get tried.

    Where the target's slots pass a draft on its own (`Slots.drafts_pass_alone`, llama.cpp: one pass
    takes one row of every request, a request's further rows a pass of their own), R counts requests:
    only passes of one row each are measured, and a request's draft of d rows adds f(1) x the prior's
    f(d)/f(1), f(1) taken from the measured pass over the prior's ratio at its R (`step`)."""

    def __init__(self, smoothing: float = 0.2, prior: Mapping[int, float] | None = None, drafts_alone: bool = False) -> None:
        self.smoothing, self.drafts_alone = smoothing, drafts_alone
        self.seconds: dict[int, float] = {}  # rows -> moving average of a pass's seconds
        self.count: dict[int, int] = {}  # rows -> passes measured
        self.curve: tuple[list[int], list[float]] | None = None  # the fit, refitted when a pass is measured
        self.prior = (sorted(prior), [prior[n] for n in sorted(prior)]) if prior else None  # (n, f(n)/f(1))

    def observe(self, rows: int, seconds: float, requests: int) -> None:
        """A pass of `rows` rows of `requests` requests took `seconds`."""
        if self.drafts_alone and rows != requests:  # its drafts' own passes are priced by the prior
            return
        self.seconds[rows] = smoothed(self.seconds.get(rows, seconds), seconds, self.smoothing)
        self.count[rows] = self.count.get(rows, 0) + 1
        self.curve = None

    @property
    def measured(self) -> bool:
        return bool(self.seconds)

    def __call__(self, rows: Sequence[float]) -> np.ndarray:
        """f at (fractional) `rows`; 1.0 before any measurement."""
        if not self.seconds:
            return np.ones(len(rows))
        if self.curve is None:
            measured = sorted(self.seconds)
            self.curve = measured, nondecreasing([self.seconds[r] for r in measured], [min(self.count[r], 10) for r in measured])
        rows = np.asarray(rows, dtype=float)
        out = np.interp(rows, *self.curve)
        (measured, fit), beyond = self.curve, rows > self.curve[0][-1]
        if self.prior is not None and beyond.any():
            out[beyond] = fit[-1] * np.interp(rows[beyond], *self.prior) / np.interp(measured[-1], *self.prior)
        return out

    def step(self, other_rows: float, others: int, rows: Sequence[float]) -> np.ndarray:
        """Seconds of the batch's pass with one request's `rows` (1 + a draft length, each) beside
        `others` other requests scoring `other_rows` rows."""
        if not self.drafts_alone:
            return self([other_rows + x for x in rows])
        common = float(self([others + 1])[0])  # one row of every request
        f1 = common / self.ratio(others + 1)
        return np.array([common + (f1 * self.ratio(x - 1) if x > 1 else 0.0) for x in rows])

    def ratio(self, n: float) -> float:
        """The prior's f(n)/f(1) (1 without a prior)."""
        return float(np.interp(n, *self.prior)) if self.prior is not None else 1.0


class BatchCostModelK(CostModelK):
    """The cost model for a request in a batch: the K that maximises the batch's expected tokens per
    second, the other requests' rows and tokens taken as they were at their last step.

    A step of the batch costs f(R), R the rows of every request (`PassCost`, measured by the batch
    at each R), and emits the tokens of every request; this request's K adds the draft tokens it verifies to R
    and its expected accepted tokens to the tokens. Where extra rows are free (f flat: a few requests,
    weights streamed once whatever the rows) K is as for one request; where they cost as much as a
    request's row (f linear in R: many requests, compute-bound), a draft must be accepted more
    often than the batch's tokens per row to pay, and K turns down, to 0. Acceptance and drafting
    cost are measured per request as by `CostModelK`.

    A request alone in the batch (no other rows) is chosen for exactly as by `CostModelK`, on its own
    curve of f(n)/f(1): the batch's f(R) is kept in seconds, and after a long prompt's passes its
    larger R, no longer measured while K = 0, would price a short prompt's drafts as the long one's
    (one client of a `--max-batch 8` server drafted 63, 2, 4 and 0 tokens over four requests where the
    one-at-a-time server drafted 135, 81, 85 and 56).
    """

    def __init__(self, **options) -> None:
        self.cost: PassCost | None = None
        self.other_rows, self.other_tokens, self.others = 0.0, 0.0, 0
        super().__init__(**options)

    def see_batch(self, cost: PassCost, other_rows: float, other_tokens: float, others: int) -> None:
        """Before `choose`: the batch's cost curve, and the rows, expected tokens and number of the other
        requests."""
        self.cost, self.other_rows, self.other_tokens, self.others = cost, other_rows, other_tokens, others

    @property
    def batched(self) -> bool:
        """Whether the step runs other requests' rows, and the batch's pass cost is measured."""
        return self.cost is not None and self.cost.measured and self.other_rows > 0

    def predict(self) -> None:
        super().predict()
        if self.batched:
            self.rates = self.expected_rates(self.other_tokens)  # of the whole batch

    def target_seconds(self, n: Sequence[float]) -> np.ndarray:
        """f(other rows + n) of the batch, once measured; before, or alone in it, as for one request."""
        if not self.batched:
            return super().target_seconds(n)
        return self.cost.step(self.other_rows, self.others, n)

    def estimates(self) -> dict:
        return {**super().estimates(), "policy": "cost-model-batch", "other_rows": self.other_rows}


def verified_positions(step: Step) -> int:
    """The positions a step verified: its draft tokens, or for a tree its deepest node's depth plus 1."""
    if step.parents is None:
        return step.drafted
    return int(depths(step.parents).max()) + 1 if len(step.parents) else 0


def tree_priority(parents: Tensor, accepted: np.ndarray) -> np.ndarray:
    """[n] each node's acceptance `accepted` [n], capped by its parent's priority and its previous
    sibling's: nonincreasing down every path and along every node's siblings, so the nodes of highest
    priority (ties to the lower index) are closed under parent and earlier sibling."""
    priority = accepted.copy()
    last: dict[int, int] = {}  # parent -> its latest child so far
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            priority[i] = min(priority[i], priority[parent])
        if parent in last:
            priority[i] = min(priority[i], priority[last[parent]])
        last[parent] = i
    return priority


def running_sums(values: Sequence[float]) -> list[float]:
    """[0, v1, v1 + v2, ...]: the sums of the first K values for K = 0..len(values)."""
    total, sums = 0.0, [0.0]
    for value in values:
        total += value
        sums.append(total)
    return sums


def smoothed(average: float, value: float, smoothing: float) -> float:
    """The moving average after `value`, counted as at most OUTLIER times the average: a pass the OS
    preempted (10 ms where 3 is usual) would otherwise raise f(1) by a third for several steps and make
    every longer pass, timed against it, look free; a real change of speed (a longer context) still
    moves the average within a few steps."""
    return average + smoothing * (min(value, OUTLIER * average) - average)


def nondecreasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares nondecreasing fit of `values` (isotonic regression, pool adjacent
    violators): what scipy.optimize.isotonic_regression computes, without its per-call overhead
    on a curve of a few entries fitted at every step."""
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, entries) of pooled runs
    for mean, weight in zip(values, weights):
        entries = 1
        while blocks and blocks[-1][0] > mean:
            last_mean, last_weight, last_entries = blocks.pop()
            mean = (last_mean * last_weight + mean * weight) / (last_weight + weight)
            weight, entries = weight + last_weight, entries + last_entries
        blocks.append((mean, weight, entries))
    return [mean for mean, _, entries in blocks for _ in range(entries)]


def interpolate(x: float, xs: list[int], ys: list[float]) -> float:
    """y at x on the piecewise linear curve through (xs, ys) (xs increasing), flat outside it:
    numpy.interp for one point, without its per-call conversions."""
    i = bisect.bisect_right(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def confidence_bins(confidence: np.ndarray) -> np.ndarray:
    """The tenth of [0, 1] each confidence falls in, 1.0 in the last."""
    return np.clip((confidence * CONFIDENCE_BINS).astype(int), 0, CONFIDENCE_BINS - 1)


AUTO_POLICIES = {"auto": CostModelK, "auto:cost": CostModelK, "auto:heuristic": HeuristicK}


def parse_k(spec: str | int) -> KPolicy:
    """A K policy from the command line: an integer K >= 0, `auto` (the cost
    model, also `auto:cost`) or `auto:heuristic` (transformers' schedule)."""
    if isinstance(spec, str) and spec.strip().lower() in AUTO_POLICIES:
        return AUTO_POLICIES[spec.strip().lower()]()
    try:  # an integer, or a string of one: not 2.5, which int() would make 2, nor True
        return FixedK(int(spec) if isinstance(spec, str) else integer(spec, "k"))
    except ValueError:
        pass
    forms = ", ".join(AUTO_POLICIES)
    raise ValueError(f"k must be an integer >= 0 or one of {forms}, got {spec!r}")


def parse_batch_k(spec: str | int) -> KPolicy:
    """The K policy of a request in a batch: as `parse_k`, with the cost model aware of the batch
    (`BatchCostModelK`) for `auto` and `auto:cost`."""
    if isinstance(spec, str) and AUTO_POLICIES.get(spec.strip().lower()) is CostModelK:
        return BatchCostModelK()
    return parse_k(spec)
