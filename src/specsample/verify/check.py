"""A statistical certificate that a configuration preserves the target distribution, and a check that
a seed gives it the text plain decoding gives.

For a few fixed contexts, sample the first two new tokens many times through
the speculative path (the engine with the configured drafter and K) and
compare them with the target's exact probabilities from its own forward
passes, under the same temperature / top-p / top-k transform:
- the first token against target_probs after the context;
- the second token, among the samples whose first token was x, against
  target_probs after the context and x (for the most frequent first tokens).
Each comparison is a chi-square goodness-of-fit test over bins of tokens
fixed by the exact probabilities (`chi_square_p`). The verdict rejects losslessness
when any p-value falls below alpha / (number of tests) (Bonferroni), so the
family-wise false alarm rate is at most alpha.

Each sample allows a draft of min(K, 2) tokens at its first step, so both
tested tokens can be accepted draft tokens. Every sample of a context starts
with the same prefill; `PrefixCache` answers a repeated prefill by rolling the
target's cache back to it, which halves the time on a real model.
The certificate draws from one generator (`sampling.GeneratorSource`), as requests
without a seed do, so it tests modified rejection sampling.

`check_identity` tests the promise of requests with a seed: for each context
and each of many seeds it generates through plain decoding (no drafter, K = 0)
and through the configuration, both with the seed's numbers keyed by output
position (`sampling.CoupledSource`), and requires the two token sequences to be
identical. One differing pair rejects.

`BROKEN` is a verifier that accepts every draft token: `certify` and
`check_identity` with it are the self-tests that each check rejects it
(`specsample check --broken`, `specsample check --identity --broken`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np
import torch
from scipy.stats import chisquare
from torch import Tensor
from tqdm import tqdm

from specsample.api import SpecSampler
from specsample.drafters import Drafter, NoDrafter
from specsample.engine import decode
from specsample.models import Target
from specsample.models.target import RecordsFeatures, require
from specsample.policy import FixedK, KPolicy
from specsample.sampling import (
    CoupledSource, GeneratorSource, RandomSource, SamplingParams, gumbel_max, probs_from_logits, sample,
)
from specsample.stats import Stats
from specsample.tree import children_of
from specsample.verify.chain import ChainVerifier, Verdict
from specsample.verify.tree import TreeVerifier

ALPHA = 1e-3
CONTEXTS = (
    "Name a color.",
    "Write the first word of a story about the sea.",
    "What is the capital of France?",
)
MIN_CONDITIONAL_SAMPLES = 50  # fewer samples of a first token: no test of the second token after it
LOW_ACCEPTANCE = 0.05  # below it, a check notes that the accept rule was hardly exercised
WEAK_SAMPLES = 1000  # fewer token pairs a context: a PASS says little (300 missed a real bug that 1,000 caught)


class PrefixCache:
    """A Target that answers a prefill of the tokens it last prefilled by rolling back to them.

    Positions before the cache length are never rewritten by `score`, so the
    cached prefix stays valid, and so do the features a backend keeps for it
    (`RecordsFeatures` indexes them by position).
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self.vocab_size = target.vocab_size
        self.max_length = target.max_length
        self.prefix = torch.empty(0, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.target.length

    def prefill(self, token_ids: Tensor) -> None:
        if self.target.length >= len(self.prefix) > 0 and torch.equal(token_ids, self.prefix):
            self.target.rollback(len(self.prefix))
            return
        self.target.prefill(token_ids)
        self.prefix = token_ids.clone()

    def extend(self, token_ids: Tensor) -> None:
        self.target.extend(token_ids)  # the prefix stays a prefix of what the cache holds

    def score(self, token_ids: Tensor) -> Tensor:
        return self.target.score(token_ids)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)

    def record_features(self, layers: Iterable[int]) -> None:
        require(self.target, RecordsFeatures, "a draft head").record_features(layers)
        self.prefix = torch.empty(0, dtype=torch.long)  # the kept prefix lacks the new layers

    def features(self, start: int, end: int, layers: Sequence[int] = ()) -> Tensor:
        return self.target.features(start, end, layers)

    def __getattr__(self, name: str):
        """A backend's other capabilities (layerskip runs the target's `forward` over a subset of its `layers`)."""
        return getattr(self.target, name)


def load_sampler(
    model: str | None,
    drafter: str | None,
    *,
    backend: str = "auto",
    trust_remote_code: bool = False,
    threads: int | None = None,
) -> SpecSampler:
    """A SpecSampler (drafter None: the default configuration) whose target, as its drafter sees it
    too, reuses a repeated prefill; `backend` resolved as `SpecSampler.load` resolves it."""
    return SpecSampler.load(model, drafter, backend=backend, trust_remote_code=trust_remote_code, threads=threads,
                            wrap=PrefixCache)


MIN_EXPECTED = 5.0  # expected count of each cell of a chi-square test (Cochran's rule)


def chi_square_p(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of counts [cells] to probabilities [cells].

    A cell expected at least MIN_EXPECTED times is a bin of its own; the others are grouped, most likely
    first (ties by index), into consecutive bins of at least MIN_EXPECTED expected, the last one's
    shortfall joining the bin before. The bins follow from `probs` alone (never from the counts), so
    the test keeps its level, and a thinly spread distribution is still tested: at a temperature of 10,000 over 49,152
    tokens, 100 samples make about 20 bins, where pooling every small cell into one remainder made a
    single bin and p = 1 whatever was drawn. An outcome of probability zero that was observed gives
    p = 0; when all the mass is in one bin (greedy decoding) and every sample fell there, p = 1.
    """
    expected = probs / probs.sum() * observed.sum()
    possible = expected > 0
    if observed[~possible].sum() > 0:
        return 0.0
    bins = cell_bins(expected[possible])  # [possible cells]
    obs = np.bincount(bins, weights=observed[possible])
    exp = np.bincount(bins, weights=expected[possible])
    if len(obs) == 1:
        return 1.0
    return float(chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue)


def sequence_chi_square_p(observed: np.ndarray, probs: np.ndarray, vocab: int) -> float:
    """`chi_square_p` of counts of sequences of L tokens [vocab**L] (lexicographic order) against their
    probabilities, with the marginals of the prefixes of 1..L-1 tokens tested too: the smallest of the L
    p-values times L (Bonferroni), at most 1. A flaw at one position (an acceptance test biased by a few
    percent) moves its marginal's few bins far more than the joint test's thousand, which it can pass."""
    length = round(math.log(len(probs), vocab)) if len(probs) > 1 else 1
    if vocab**length != len(probs) or len(observed) != len(probs):
        raise ValueError(f"{len(probs)} cells are not the sequences of a vocabulary of {vocab}")
    p_values = []
    for prefix in range(1, length + 1):
        shape = (vocab**prefix, vocab ** (length - prefix))
        p_values.append(chi_square_p(observed.reshape(shape).sum(1), probs.reshape(shape).sum(1)))
    return min(1.0, length * min(p_values))


def cell_bins(expected: np.ndarray) -> np.ndarray:
    """The bin of each cell [cells] for `chi_square_p`: cells expected MIN_EXPECTED or more alone, the
    rest grouped most likely first into bins of at least MIN_EXPECTED (the last one's remainder, if
    short, joins the bin before)."""
    order = np.argsort(-expected, kind="stable")
    bins = np.empty(len(expected), dtype=np.int64)
    current, filled = -1, MIN_EXPECTED
    for cell in order.tolist():
        if filled >= MIN_EXPECTED:
            current, filled = current + 1, 0.0
        bins[cell], filled = current, filled + expected[cell]
    if filled < MIN_EXPECTED and current > 0:
        bins[bins == current] = current - 1
    return bins


@dataclass(frozen=True)
class TokenTest:
    context: str
    position: str  # "first token" or "second token | first = <token>"
    samples: int
    p_value: float


@dataclass
class Certificate:
    tests: list[TokenTest]
    alpha: float
    stats: Stats  # drafting and acceptance over all samples
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def threshold(self) -> float:
        """Per-test significance level: alpha / number of tests (Bonferroni)."""
        return self.alpha / max(1, len(self.tests))

    @property
    def rejected(self) -> bool:
        """True when some test gives evidence that the distribution is not preserved."""
        return any(t.p_value < self.threshold for t in self.tests)


def certify(
    sampler: SpecSampler,
    policy: KPolicy,
    params: SamplingParams,
    *,
    contexts: Sequence[str] = CONTEXTS,
    samples: int = 2000,
    seed: int = 0,
    conditionals: int = 2,
    chat: bool = True,
    alpha: float = ALPHA,
    progress: bool = False,
    verifier: ChainVerifier = ChainVerifier(),
) -> Certificate:
    """Sample `samples` token pairs per context through the speculative path and test them."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    random = GeneratorSource(torch.Generator().manual_seed(seed))
    stats, tests, start = Stats(), [], perf_counter()
    for context in contexts:
        prompt_ids = torch.tensor(sampler.encode(context, chat), dtype=torch.long)
        runs = tqdm(range(samples), desc=context[:24], unit="sample", leave=False, disable=not progress)
        pairs = [sample_pair(sampler, policy, prompt_ids, params, random, stats, verifier) for _ in runs]
        tests += context_tests(sampler, context, prompt_ids, params, pairs, conditionals)
    return Certificate(tests, alpha, stats, perf_counter() - start, exercised(stats) + too_few(samples, params))


def too_few(samples: int, params: SamplingParams) -> list[str]:
    """A note where a sampled check's PASS says little: fewer than WEAK_SAMPLES token pairs a context."""
    if samples >= WEAK_SAMPLES or params.greedy:
        return []
    return [f"{samples} token pairs a context detect only gross deviations (300 missed a recovery drawn from the "
            f"target instead of the residual, 1,000 caught it): use --samples {WEAK_SAMPLES} or more"]


def exercised(stats: Stats) -> list[str]:
    """Notes on how little of the speculative path a check ran: no draft tokens (plain decoding only), or
    draft tokens accepted less than LOW_ACCEPTANCE of the time, so that the accept rule was hardly tested (an
    `ngram` draft of the chat template's next `<|im_start|>` under top-p 0.9: 6,012 drafted, none accepted)."""
    if stats.drafted_tokens == 0:
        return ["the drafter proposed no tokens: only plain decoding was exercised"]
    if stats.acceptance_rate < LOW_ACCEPTANCE:
        return [f"{stats.accepted_tokens} of {stats.drafted_tokens} draft tokens were accepted: the accept rule was "
                "hardly exercised, mostly the recovery; a drafter or sampling options whose drafts the target keeps "
                "make a stronger check"]
    return []


def sample_pair(
    sampler: SpecSampler,
    policy: KPolicy,
    prompt_ids: Tensor,
    params: SamplingParams,
    random: RandomSource,
    stats: Stats,
    verifier: ChainVerifier,
) -> tuple[int, int]:
    """The first two new tokens of one speculative generation (no EOS stop)."""
    steps = decode(
        sampler.target, sampler.drafter, policy, prompt_ids, params,
        max_new_tokens=3, eos_token_ids=frozenset(), random=random, stats=stats, verifier=verifier,
    )
    tokens: list[int] = []
    for new in steps:
        tokens += new
        if len(tokens) >= 2:
            break
    steps.close()
    return tokens[0], tokens[1]


def context_tests(
    sampler: SpecSampler,
    context: str,
    prompt_ids: Tensor,
    params: SamplingParams,
    pairs: list[tuple[int, int]],
    conditionals: int,
) -> list[TokenTest]:
    """The first-token test and second-token tests after the most frequent first tokens."""
    vocab = sampler.target.vocab_size
    first = Counter(a for a, _ in pairs)
    tests = [TokenTest(context, "first token", len(pairs),
                       chi_square_p(counts(first, vocab), exact_probs(sampler, prompt_ids, params)))]
    for token, n in first.most_common(conditionals):
        if n < MIN_CONDITIONAL_SAMPLES:
            break
        second = Counter(b for a, b in pairs if a == token)
        target_probs = exact_probs(sampler, torch.cat([prompt_ids, torch.tensor([token])]), params)
        name = sampler.model.tokenizer.decode([token])
        tests.append(TokenTest(context, f"second token | first = {name!r}", n,
                               chi_square_p(counts(second, vocab), target_probs)))
    return tests


def counts(counter: Counter, vocab: int) -> np.ndarray:
    out = np.zeros(vocab)
    for token, n in counter.items():
        out[token] = n
    return out


def exact_probs(sampler: SpecSampler, token_ids: Tensor, params: SamplingParams) -> np.ndarray:
    """The target's transformed next-token distribution after `token_ids` [n], from its forward pass."""
    target = sampler.target
    target.prefill(token_ids[:-1])
    logits = target.score(token_ids[-1:])[-1]  # [vocab]
    return probs_from_logits(logits, params).double().numpy()


def accept_all(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, generator: torch.Generator) -> Verdict:
    """A broken sampler: accepts every draft token, then draws the bonus token."""
    k = draft_tokens.shape[0]
    return Verdict(k, sample(target_probs[k], generator))


def accept_all_greedy(draft_tokens: Tensor, target_logits: Tensor) -> Verdict:
    """A broken greedy verifier: accepts every draft token, then the target's argmax."""
    k = draft_tokens.shape[0]
    return Verdict(k, int(target_logits[k].argmax()))


def accept_all_coupled(draft_tokens: Tensor, target_probs: Tensor, noise: Tensor) -> Verdict:
    """A broken coupled verifier: accepts every draft token, then the target's coupled token after them."""
    k = draft_tokens.shape[0]
    return Verdict(k, int(gumbel_max(target_probs[k], noise[k])))


def first_children(parents: Tensor) -> tuple[tuple[int, ...], int]:
    """The path down a tree through every node's first child, and the target's row after it: what the
    broken tree verifiers accept."""
    children, path, row = children_of(parents), [], 0
    while children[row]:
        path.append(children[row][0])
        row = path[-1] + 1
    return tuple(path), row


def accept_first_tree(draft_tokens, parents, draft_probs, target_probs, generator) -> Verdict:
    """A broken tree sampler: accepts the path of first children, then draws the bonus token."""
    path, row = first_children(parents)
    return Verdict(len(path), sample(target_probs[row], generator), path)


def accept_first_tree_greedy(draft_tokens, parents, target_logits) -> Verdict:
    """A broken greedy tree verifier: accepts the path of first children, then the target's argmax."""
    path, row = first_children(parents)
    return Verdict(len(path), int(target_logits[row].argmax()), path)


def accept_first_tree_coupled(draft_tokens, parents, target_probs, noise) -> Verdict:
    """A broken coupled tree verifier: accepts the path of first children, then the coupled token after it."""
    path, row = first_children(parents)
    return Verdict(len(path), int(gumbel_max(target_probs[row], noise(len(path)))), path)


# the `check --broken` self-test, broken in every mode, for chains and trees
BROKEN = ChainVerifier(
    sample=accept_all, coupled=accept_all_coupled, greedy=accept_all_greedy,
    tree=TreeVerifier(sample=accept_first_tree, coupled=accept_first_tree_coupled, greedy=accept_first_tree_greedy),
)


@dataclass(frozen=True)
class SeedRun:
    context: str
    seed: int
    plain: list[int]  # plain decoding's new tokens with the seed
    speculative: list[int]  # the configuration's

    @property
    def identical(self) -> bool:
        return self.plain == self.speculative

    def first_difference(self) -> int:
        """Index of the first differing token (the shorter length if one is a prefix of the other);
        for a pair that is not identical."""
        pairs = zip(self.plain, self.speculative)
        return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(self.plain), len(self.speculative)))


@dataclass
class IdentityCheck:
    runs: list[SeedRun]
    stats: Stats  # drafting and acceptance of the configuration's runs
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def differing(self) -> list[SeedRun]:
        return [run for run in self.runs if not run.identical]

    @property
    def rejected(self) -> bool:
        """True when some seed's text differs from plain decoding's: the promise is broken."""
        return bool(self.differing)


def check_identity(
    sampler: SpecSampler,
    policy: KPolicy,
    params: SamplingParams,
    *,
    contexts: Sequence[str] = CONTEXTS,
    seeds: Sequence[int] = range(20),
    max_new_tokens: int = 32,
    chat: bool = True,
    progress: bool = False,
    verifier: ChainVerifier = ChainVerifier(),
) -> IdentityCheck:
    """For each context and seed, plain decoding's tokens and the configuration's, both with the seed's
    numbers keyed by output position (`CoupledSource`): the promise is that they are identical."""
    if not seeds:
        raise ValueError("give at least one seed")
    eos = sampler.model.eos_token_ids
    stats, runs, start = Stats(), [], perf_counter()
    for context in contexts:
        prompt_ids = torch.tensor(sampler.encode(context, chat), dtype=torch.long)
        for seed in tqdm(seeds, desc=context[:24], unit="seed", leave=False, disable=not progress):
            plain = new_tokens(sampler.target, NoDrafter(), FixedK(0), prompt_ids, params, CoupledSource(seed),
                               max_new_tokens, eos, Stats(), ChainVerifier())
            speculative = new_tokens(sampler.target, sampler.drafter, policy, prompt_ids, params, CoupledSource(seed),
                                     max_new_tokens, eos, stats, verifier)
            runs.append(SeedRun(context, seed, plain, speculative))
    return IdentityCheck(runs, stats, perf_counter() - start, exercised(stats))


def new_tokens(
    target: Target,
    drafter: Drafter,
    policy: KPolicy,
    prompt_ids: Tensor,
    params: SamplingParams,
    random: RandomSource,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    stats: Stats,
    verifier: ChainVerifier,
) -> list[int]:
    """The new tokens of one whole generation."""
    steps = decode(target, drafter, policy, prompt_ids, params, max_new_tokens=max_new_tokens,
                   eos_token_ids=eos_token_ids, random=random, stats=stats, verifier=verifier)
    return [token for step in steps for token in step]


def render_identity(check: IdentityCheck, broken: bool = False, shown: int = 5) -> str:
    """Identical pairs per context, the first `shown` differing ones, and the verdict as text."""
    lines = [f"{'context':<48} {'identical to plain decoding':>28}"]
    for context in dict.fromkeys(run.context for run in check.runs):
        mine = [run for run in check.runs if run.context == context]
        lines.append(f"{context[:48]:<48} {sum(run.identical for run in mine):>20} of {len(mine):<5}")
    for run in check.differing[:shown]:
        lines.append(f"differs: {run.context[:32]!r} seed {run.seed}, from token {run.first_difference()} "
                     f"({len(run.plain)} and {len(run.speculative)} tokens)")
    s = check.stats
    lines.append(f"drafted tokens {s.drafted_tokens}, acceptance rate {s.acceptance_rate:.3f}, "
                 f"mean accepted length {s.mean_accepted_length:.2f}, {check.seconds:.1f} s")
    lines += [f"note: {note}" for note in check.notes]
    if check.rejected:
        lines.append(f"REJECTED: {len(check.differing)} of {len(check.runs)} seeded outputs differ from plain decoding's")
    else:
        lines.append(f"PASS: all {len(check.runs)} seeded outputs are token-identical to plain decoding's")
    if broken:
        outcome = "works" if check.rejected else "FAILED: the broken sampler was not caught"
        lines.append(f"self-test with a sampler that always accepts: {outcome}")
    return "\n".join(lines)


def render(certificate: Certificate, broken: bool = False) -> str:
    """The p-values and the verdict as text."""
    lines = [f"{'context':<48} {'test':<36} {'samples':>7} {'p-value':>9}"]
    for t in certificate.tests:
        lines.append(f"{t.context[:48]:<48} {t.position[:36]:<36} {t.samples:>7} {t.p_value:>9.3g}")
    s = certificate.stats
    lines.append(f"drafted tokens {s.drafted_tokens}, acceptance rate {s.acceptance_rate:.3f}, "
                 f"{certificate.seconds:.1f} s")
    lines += [f"note: {note}" for note in certificate.notes]
    rule = (f"family-wise alpha {certificate.alpha:g} (Bonferroni over {len(certificate.tests)} tests: "
            f"each p-value against {certificate.threshold:.2g})")
    if certificate.rejected:
        verdict = "REJECTED: the sampled tokens do not follow the target distribution"
    else:
        verdict = "PASS: no evidence against losslessness at these sample counts (more samples detect smaller deviations)"
    lines.append(f"{verdict}, {rule}")
    if broken:
        outcome = "works" if certificate.rejected else "FAILED: the broken sampler was not caught"
        lines.append(f"self-test with a sampler that always accepts: {outcome}")
    return "\n".join(lines)
