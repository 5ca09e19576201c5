"""Logits to probabilities (temperature, top-k, top-p, min-p), and the random numbers tokens are drawn with.

The engine applies the same transformation to the target's and the drafter's
logits, so speculative sampling reproduces the *transformed* target
distribution exactly. Temperature 0 means greedy: a point mass on the argmax.
All functions are pure; randomness comes only from an explicit source.

A request's randomness is one `RandomSource`, which the engine hands to its
drafter and its verifier at every step. There are two:

- `GeneratorSource`: independent draws from one `torch.Generator`, consumed in
  the order the step asks for them. The drafter's draws and the verifier's are
  unrelated, and verification is modified rejection sampling
  (`verify.chain.rejection_sample`).
- `CoupledSource`: the numbers of output position n (the n-th new token,
  counting from 0) are a function of (seed, n) alone: a counter-based stream
  (`position_noise`, SplitMix64 of a key of the seed and the position, and of the token).
  A token is the Gumbel-max of its distribution under that position's numbers
  (`gumbel_max`): plain decoding emits the target's; a drafter with
  probabilities draws its draft token at that position from its own
  draft_probs with the same numbers (coupled drafting), so it proposes the
  target's token wherever the two distributions' Gumbel-max agree; and
  verification compares tokens (`verify.coupled`). Every emitted token is then
  the token plain decoding emits at that position: a seeded request gives the
  same text whatever the drafter, K or K policy.

Why Gumbel-max rather than the inverse CDF of one uniform: both draw exactly
from a distribution given uniform numbers, but the inverse CDF couples two
distributions through the order of the vocabulary (a little mass moved
anywhere before token x shifts every cumulative sum after it, and the draft
and target tokens part), while argmax(log probs + Gumbel noise) is a function
of each token's own probability and number: two close distributions pick the
same token with probability at least (1 - TV) / (1 + TV), TV their total
variation distance, which is near the 1 - TV of the best coupling
(rejection sampling's acceptance).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from specsample.verify.chain import ChainVerifier, Verdict
    from specsample.verify.tree import TreeVerifier


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off

    def __post_init__(self) -> None:
        for name, kind in (("temperature", real), ("top_k", integer), ("top_p", real), ("min_p", real)):
            object.__setattr__(self, name, kind(getattr(self, name), name))  # numpy scalars become Python's
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)


def argmax(scores: Tensor) -> Tensor:
    """The index of the largest value along the last dimension of `scores` [..., n], as
    `torch.argmax(scores, -1)`: the first at a tie, a NaN counting as the largest.

    Greedy decoding takes it of every row a step scores, and greedy drafting of every draft token.
    For a float CPU tensor it runs in numpy, whose argmax is vectorized: torch 2.13's CPU argmax
    took 87 us over a 49k vocabulary row and 505 us over 9 rows, numpy's 5 and 42 (Intel Xeon,
    AVX-512), against a plain step of about 3.3 ms on the bundled model's blocks."""
    if scores.device.type == "cpu" and scores.dtype in NUMPY_ARGMAX_DTYPES and not scores.requires_grad:
        return torch.as_tensor(scores.numpy().argmax(-1))
    return scores.argmax(-1)


def greedy_tokens(logits: Tensor) -> Tensor:
    """The target's greedy tokens, `argmax` of `logits` [..., vocab]; a ValueError for NaN logits, as
    sampling from them is (`finite_limit`): argmax counts a NaN as the largest, so a row holding one
    would give its first NaN's token silently. Since it does, only the picked values need checking."""
    tokens = argmax(logits)
    if bool(logits.gather(-1, tokens.unsqueeze(-1)).isnan().any()):
        raise ValueError("the model's logits hold NaN: there is no greedy token")
    return tokens


SMALL_TEMPERATURE = 1e-20  # below, logits are shifted to a largest of 0 and divided in float64
LARGE_TEMPERATURE = 1e30  # above, too (float32 holds no T beyond 3.4e38, and -inf / inf is NaN)


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Transform logits [..., vocab] into float32 probabilities [..., vocab]. A row holding +inf (a float16
    overflow) gets its limit, an even split over its +inf entries (`finite_limit`)."""
    if params.greedy:
        probs = torch.zeros_like(logits, dtype=torch.float32)
        return probs.scatter_(-1, greedy_tokens(logits).unsqueeze(-1), 1.0)
    probs = transformed(logits.float(), params)
    if bool(probs[..., 0].isnan().any()):  # softmax made a row all NaN: its logits hold +inf, NaN or only -inf
        probs = transformed(finite_limit(logits.float()), params)
    return probs


def finite_limit(logits: Tensor) -> Tensor:
    """`logits` [..., vocab] with each row holding +inf replaced by 0 at its +inf entries and -inf elsewhere;
    a ValueError for a NaN logit or a row all -inf, which have no distribution."""
    if bool(logits.isnan().any()):
        raise ValueError("the model's logits hold NaN: there is no distribution to sample from")
    if not bool((logits > float("-inf")).any(-1).all()):
        raise ValueError("the model's logits are all -inf at a position: there is no distribution to sample from")
    infinite = logits.isposinf()
    limit = torch.full_like(logits, float("-inf")).masked_fill_(infinite, 0.0)
    return torch.where(infinite.any(-1, keepdim=True), limit, logits)


def transformed(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, top-k, softmax, top-p and min-p of float32 logits [..., vocab] (`probs_from_logits`)."""
    if not SMALL_TEMPERATURE <= params.temperature <= LARGE_TEMPERATURE:
        # logits / T would overflow to inf, and softmax give NaN; below about 1.4e-45 T itself is 0 in
        # float32. Shifted to a largest of 0 and divided in float64 (where T > 0 is never 0), the largest
        # stay 0 and the rest fall to -inf: the limit, a point mass on the argmax or an even split over a tie.
        # Above LARGE_TEMPERATURE, the finite ones fall to 0 and -inf stays -inf: near the uniform.
        logits = ((logits - logits.amax(-1, keepdim=True)).double() / params.temperature).float()
    else:
        logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0:
        keep = probs >= params.min_p * probs.amax(-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Rows:
    """The rows [width] of an [n, width] table, each made on first read and kept: a verification step's
    target_probs (`target_rows`), or a coupled source's noise.

    Verification reads rows only up to the first rejected draft token, so a step pays the sampling
    transform (and at a coupled source the noise and the Gumbel-max) for the rows it reaches, not for
    all k + 1. That work is about 0.2 ms a row over a 49k vocabulary with the CPU's caches cold after
    a pass, on the bundled model's blocks as much as the pass's own cost of an extra row (Intel Xeon,
    AVX-512), and a lookup drafter's draft at temperature 1 is mostly rejected at its first token.
    Indexing is by one row, as a tensor's `table[i]`, so the verifiers take either.
    """

    def __init__(self, count: int, make: Callable[[int], Tensor]) -> None:
        self.count, self.make = count, make
        self.made: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Tensor:
        if not 0 <= i < self.count:
            raise IndexError(f"row {i} of {self.count}")
        row = self.made.get(i)
        if row is None:
            row = self.made[i] = self.make(i)
        return row


def target_rows(logits: Tensor, params: SamplingParams) -> Rows:
    """The sampling distributions [vocab] of the rows of `logits` [n, vocab] (`probs_from_logits`), each
    computed when first read. A row's distribution does not depend on the other rows."""
    return Rows(logits.shape[0], lambda i: probs_from_logits(logits[i], params))


def draw_draft_token(probs: Tensor, offset: int, random: RandomSource, params: SamplingParams) -> int:
    """Draft token `offset`, drawn from its draft_probs `probs` [vocab] with `random.draw`; at
    temperature 0, where `probs` is a point mass, its token, with no draw: a seeded request's draw
    would make a row of noise for it (about 120 us over a 49k vocabulary) and an unseeded one would
    use a number for nothing."""
    return int(argmax(probs)) if params.greedy else random.draw(probs, offset)


def draft_confidence(logits: Tensor, probs: Tensor, params: SamplingParams) -> float:
    """A drafter's confidence in its next token: the peak of its distribution, its guess that the
    target keeps what it draws.

    The peak of the sampling distribution `probs` [vocab]; at temperature 0, where that is
    a point mass, of the softmax of the raw `logits` [vocab]. It is known before the token
    is drawn: a choice of which draft tokens to verify made on the drawn token's own
    probability would favour some tokens over others and bias the output.
    """
    return float((logits.float().softmax(-1) if params.greedy else probs).max())


TOP_P_CANDIDATES = 256  # the most likely tokens `_top_p` looks among first; then 16x as many, then all


def _top_p(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p.

    In canonical order (most likely first, equal probabilities by token id), a token is kept when
    the mass of the tokens before it, summed in float64 one after another, is below top_p (the sums
    never decrease, so the kept tokens are a prefix). The set is found among the
    TOP_P_CANDIDATES most likely tokens of each row (`topk`), and among 16x as many where the mass
    of some row's candidates above their smallest probability falls short of top_p, then among all
    (sorted): sorting a 49k vocabulary took 4.2 ms a row on AMD EPYC (AVX2), as long as the
    bundled model's forward pass, and its top 256 take 0.2. The set does not depend on how many
    candidates found it, nor on the other rows: every token more likely than the smallest
    candidate is a candidate, and ties are broken by token id.
    """
    vocab = probs.shape[-1]
    for k in candidate_counts(vocab):
        top, index = canonical_top(probs, k)  # [..., k] each
        mass_before = torch.nn.functional.pad(top.double().cumsum(-1)[..., :-1], (1, 0))  # [..., k]
        if k == vocab:
            break
        first_smallest = (top == top[..., -1:]).int().argmax(-1, keepdim=True)  # [..., 1]
        if bool((mass_before.gather(-1, first_smallest) >= top_p).all()):
            break
    kept = torch.zeros_like(probs).scatter_(-1, index, top.masked_fill(mass_before >= top_p, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def candidate_counts(vocab: int) -> Iterator[int]:
    """How many candidates `_top_p` tries in turn: TOP_P_CANDIDATES, 16x as many, ... while below a
    quarter of the vocabulary, then the whole vocabulary."""
    k = TOP_P_CANDIDATES
    while k < vocab // 4:
        yield k
        k *= 16
    yield vocab


def canonical_top(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely tokens of each row [..., vocab]: their probabilities and ids [..., k], most
    likely first and equal probabilities by id (topk leaves the order of ties to its algorithm; a
    stable sort keeps ids in order)."""
    if k == probs.shape[-1]:
        return probs.sort(dim=-1, descending=True, stable=True)
    top, index = probs.topk(k, dim=-1)
    index, order = index.sort(-1)
    top, order = top.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return top, index.gather(-1, order)


SAMPLE_BLOCK = 256  # tokens per block of `sample`'s two-level cumulative sum


def sample(probs: Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probabilities [vocab], normalized or not, by inverting their
    cumulative sum: one uniform draw and a binary search. torch.multinomial takes about 0.8 ms
    for one draw over a 49k vocabulary on the development CPU. The sum and the search run in
    numpy, on one thread: torch splits an op over 49k elements across its threads, and on a core
    another process keeps busy that one op was measured to wait about 6 ms. The sum is two-level:
    the cumulative sum of blocks of SAMPLE_BLOCK tokens finds the block, then the one within that
    block the token (a cumulative sum over all 49k took 145 us, sequential; this about 20). The block
    sums are one `reduceat`, which takes a last block shorter than the others as it is: padding the
    vocabulary to a multiple of SAMPLE_BLOCK copied it at every draw (120 us for Qwen's 152k
    tokens, 75 this way; 20 us for a 16-token vocabulary, 2 this way)."""
    weights = probs.numpy()  # [vocab]
    starts = np.arange(0, weights.shape[0], SAMPLE_BLOCK)  # [blocks]
    cdf = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))  # [blocks]
    u = float(torch.rand(1, generator=generator, dtype=torch.float64)) * cdf[-1]
    b = int(np.searchsorted(cdf, u, side="right"))
    if b == len(cdf):  # u rounded up to the total: the last block with mass
        b = int(np.flatnonzero(cdf < cdf[-1])[-1]) + 1 if cdf[0] < cdf[-1] else 0
    block = weights[starts[b] : starts[b] + SAMPLE_BLOCK]  # [SAMPLE_BLOCK], or fewer at the end
    inner = np.cumsum(block, dtype=np.float64)
    i = int(np.searchsorted(inner, u - (cdf[b - 1] if b else 0.0), side="right"))
    if i == len(block):  # the two sums of the block rounded apart: its last token with mass
        i = int(np.flatnonzero(block)[-1])
    return int(starts[b]) + i


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from OS entropy when seed is None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


GOLDEN = 0x9E3779B97F4A7C15  # the constants of kernels.cpp's specsample_gumbel_noise
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
POSITION_SALT = 0x632BE59BD9B4E019


def position_noise(seed: int, position: int, vocab: int) -> Tensor:
    """Standard Gumbel noise [vocab] float32 of output `position` of a request with `seed`.

    A counter-based stream: number j is -log(-log(u_j)), u_j = (the top 23 bits of
    mix64(key + (j + 1) GOLDEN) + 1/2) / 2**23, mix64 SplitMix64's output function and key a mix of
    the seed and the position (both mod 2**64). So no position's numbers depend on how many were
    drawn before it, a shorter vocabulary gets a prefix of a longer one's numbers, and no number is
    infinite (u_j within [2**-24, 1 - 2**-24], exact in float32). The bound has a price: the noise lies
    within [-2.8, 16.6], so under a seed a token below exp(-19.4), about 3.6e-9, of the most likely
    token's probability is never emitted (a total variation of at most vocab x 3.6e-9 from the target's
    distribution; without a seed, `GeneratorSource` draws exactly). Computed by the C++ kernels on the
    decoding thread's team (about 26 us for 49,152 tokens on 2 threads, 52 on one, AMD EPYC with
    AVX-512, bitwise the same with the AVX2 build, the portable build's 125 of 49,152 one ulp apart; numpy's
    Philox and two float64 logs took 220), else by
    `numpy_position_noise`, the same stream to float32 rounding: within 1e-6, but not bitwise (about
    4 numbers in 10 differ in their last bit), so a seed's text may differ between a process with the
    kernels and one without (SPECSAMPLE_NO_KERNELS), as between backends.
    """
    from specsample.models import kernels

    if kernels.available():
        return kernels.gumbel_noise(seed, position, vocab)
    return numpy_position_noise(seed, position, vocab)


def top_indices(logits: Tensor, k: int) -> Tensor:
    """The indices [rows, k] of the k largest of each row of `logits` [rows, vocab], largest first: on the
    C++ kernels where they run (`kernels.top_k`, one pass over each row: 19 us for a row of 49,152 and 31
    for nine, against 122 to 170 and 477 to 518 for torch.topk, Intel Xeon), else torch.topk (which may
    order equal entries otherwise)."""
    from specsample.models import kernels

    if kernels.available() and logits.dtype == torch.float32 and logits.stride(-1) == 1 and k <= min(64, logits.shape[-1]):
        return kernels.top_k(logits, k)
    return logits.topk(k, dim=-1).indices


def numpy_position_noise(seed: int, position: int, vocab: int) -> Tensor:
    """`position_noise` in numpy (uint64 arithmetic wraps mod 2**64; logs in float64, then rounded)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.uint64((seed + GOLDEN) % 2**64)) ^ _mix64(np.uint64((position % 2**64) ^ POSITION_SALT))
        z = _mix64(key + (np.arange(1, vocab + 1, dtype=np.uint64)) * np.uint64(GOLDEN))
    uniform = ((z >> np.uint64(41)).astype(np.float64) + 0.5) / 2**23  # [vocab]
    return torch.from_numpy((-np.log(-np.log(uniform))).astype(np.float32))


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 values."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX[0])
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX[1])
    return z ^ (z >> np.uint64(31))


def gumbel_max(probs: Tensor, noise: Tensor) -> Tensor:
    """The tokens argmax(log probs + noise) [...] of probabilities [..., vocab] (normalized or not) under
    Gumbel noise [..., vocab]: an exact draw from probs when the noise is standard Gumbel. A token
    of probability 0 is never chosen. In numpy, on one thread, as `sample`."""
    with np.errstate(divide="ignore"):  # log(0) = -inf
        scores = np.log(probs.numpy()) + noise.numpy()  # [..., vocab] in the dtype of probs and noise
    return torch.as_tensor(scores.argmax(-1))


class RandomSource(Protocol):
    """A request's random numbers, as the engine hands them to its drafter and verifier at each step.

    At each step the engine calls `at(position)`, `position` being the output position of the
    token after the pending one; offset i of the returned source is output position
    `position + i`. The drafter draws draft token i at offset i (`draw`); the verifier emits the
    target's token after i accepted draft tokens at offset i (`verify`).
    """

    def at(self, position: int) -> RandomSource:
        """The source as seen from output `position`."""
        ...

    def draw(self, probs: Tensor, offset: int) -> int:
        """A token drawn from `probs` [vocab] (normalized or not) at `offset`."""
        ...

    def verify(
        self, verifier: ChainVerifier, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor | Rows
    ) -> Verdict:
        """Verify a chain draft (`draft_tokens` [k], `draft_probs` [k, vocab] or None, `target_probs`
        [k + 1, vocab], a tensor or `Rows`) with the rule of `verifier` that fits these numbers."""
        ...

    def verify_tree(
        self, verifier: TreeVerifier, draft_tokens: Tensor, parents: Tensor, draft_probs: Tensor | None,
        target_probs: Tensor | Rows,
    ) -> Verdict:
        """Verify a tree draft (`verify.tree`: `parents` [n], `target_probs` [n + 1, vocab]) with the rule
        of `verifier` that fits these numbers."""
        ...


@dataclass(frozen=True)
class GeneratorSource:
    """Independent draws from one generator, in the order they are asked for; verification by
    modified rejection sampling (`verifier.sample`). The output is exactly distributed as the
    target's, but which tokens a seed gives depends on the drafter and K."""

    generator: torch.Generator

    def at(self, position: int) -> GeneratorSource:
        return self

    def draw(self, probs: Tensor, offset: int) -> int:
        return sample(probs, self.generator)

    def verify(
        self, verifier: ChainVerifier, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor | Rows
    ) -> Verdict:
        return verifier.sample(draft_tokens, draft_probs, target_probs, self.generator)

    def verify_tree(
        self, verifier: TreeVerifier, draft_tokens: Tensor, parents: Tensor, draft_probs: Tensor | None,
        target_probs: Tensor | Rows,
    ) -> Verdict:
        return verifier.sample(draft_tokens, parents, draft_probs, target_probs, self.generator)


class CoupledSource:
    """The numbers of each output position are `position_noise(seed, position)`; a token is their
    Gumbel-max (`gumbel_max`), and verification compares tokens (`verifier.coupled`).

    The noise of a position is computed once per request and shared by the sources `at` returns
    (the drafter's draw at a position and the verifier's use the same row); rows of positions
    before the latest `at` are dropped.
    """

    def __init__(self, seed: int, position: int = 0, rows: dict[int, Tensor] | None = None) -> None:
        self.seed = seed
        self.position = position
        self.rows = {} if rows is None else rows  # output position -> noise [vocab], shared by one request's sources

    def at(self, position: int) -> CoupledSource:
        for done in [p for p in self.rows if p < position]:
            del self.rows[done]
        return CoupledSource(self.seed, position, self.rows)

    def noise(self, offset: int, vocab: int) -> Tensor:
        """The Gumbel noise [vocab] of output position `position + offset`."""
        position = self.position + offset
        row = self.rows.get(position)
        if row is None or row.shape[0] < vocab:
            row = self.rows[position] = position_noise(self.seed, position, vocab)
        return row[:vocab]

    def draw(self, probs: Tensor, offset: int) -> int:
        return int(gumbel_max(probs, self.noise(offset, probs.shape[-1])))

    def verify(
        self, verifier: ChainVerifier, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor | Rows
    ) -> Verdict:
        vocab = target_probs[0].shape[-1]  # row 0 is read by every verification
        return verifier.coupled(draft_tokens, target_probs, Rows(len(target_probs), lambda i: self.noise(i, vocab)))

    def verify_tree(
        self, verifier: TreeVerifier, draft_tokens: Tensor, parents: Tensor, draft_probs: Tensor | None,
        target_probs: Tensor | Rows,
    ) -> Verdict:
        vocab = target_probs[0].shape[-1]
        return verifier.coupled(draft_tokens, parents, target_probs, lambda offset: self.noise(offset, vocab))


def real(value: object, what: str) -> float:
    """`value` as a float if it is a real number (a Python or numpy one; not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)


def integer(value: object, what: str) -> int:
    """`value` as an int if it is an integer (a Python or numpy one; not a bool, a float or a string)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def check_seed(seed: object, what: str = "seed") -> int:
    """The seed as an int, or a ValueError for one that is not a 64-bit unsigned integer (a generator
    would wrap it onto one that is; numpy's integers are taken as their value)."""
    seed = integer(seed, what)
    if not 0 <= seed < 2**64:
        raise ValueError(f"{what} must be an integer from 0 to 2**64 - 1, got {seed}")
    return seed


def request_source(seed: int | None) -> RandomSource:
    """A request's random source: coupled with a seed, so the seed gives the text plain decoding gives
    with it whatever the drafter and K; without one, independent draws from OS entropy verified by
    modified rejection sampling, whose acceptance is the best any coupling can have
    (docs/coupled-sampling.md has the measured difference). A seed is a 64-bit unsigned integer: others
    would wrap onto one of those, two seeds giving one text."""
    return GeneratorSource(make_generator(None)) if seed is None else CoupledSource(check_seed(seed))
