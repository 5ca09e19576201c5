"""Exactness of the model drafters' sampled trees (drafters/draft_model.py, `quantized-tree`,
`draft-tree:PATH`): one verification step over the tree the real `DraftModelDrafter` draws
reproduces the target's distribution, by tests/test_tree_lossless.py's exact enumeration (tiny
vocabulary, every continuation of SEQ_LEN tokens, N_SAMPLES samples, chi-square at ALPHA, fixed
seeds). The draft model is `TableModel`, the draft table of those tests behind the calls the drafter
makes of a model (prefill, score, rollback), so the drafter's own code draws the chain and the
alternatives at its low-confidence positions, whose shape then varies with the drawn chain. A
drafter that reports the full distribution for an alternative (drawn without replacement from the
renormalized rest) must be rejected. Then the same drafter through the engine with neural models,
with alternatives at every position, so that most steps verify a tree, and with a broken tree
verifier, which must be rejected.
"""

from __future__ import annotations

import numpy as np
import torch

from specsample.drafters import draft_model
from specsample.drafters.draft_model import DraftModelDrafter
from specsample.engine import decode
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from specsample.tree import chain_parents
from specsample.verify import ChainVerifier
from specsample.verify.check import chi_square_p
from specsample.verify.tree import TreeVerifier
from test_tree_lossless import ALPHA, N_SAMPLES, PARAMS, PROMPT, Tables, complete, no_residual_update, target_logits

ENGINE_SAMPLES = 20_000  # sequences through the engine (a model step costs more than a table lookup)
CHAIN = 2  # draft-model passes: chain tokens (a tree of depth 2, its bonus token the third)


class TokenCache:
    """A model's cache as the list of tokens it was given, rolled back by length."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def prefill(self, token_ids: torch.Tensor) -> None:
        self.tokens = token_ids.tolist()

    def rollback(self, length: int) -> None:
        del self.tokens[length:]


class TableModel(TokenCache):
    """A draft model made of a table: logits [VOCAB] of the token after a context of tokens after PROMPT
    (`Tables.key`)."""

    max_length = 1 << 20  # a table has no context window of its own (`Target.max_length`)

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits  # [POSITIONS, VOCAB, VOCAB, VOCAB]

    def score(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = []
        for token in token_ids.tolist():
            self.tokens.append(token)
            rows.append(self.logits[Tables.key(tuple(self.tokens[len(PROMPT) :]))])
        return torch.stack(rows)  # [n, VOCAB]


def tree_counts(params: SamplingParams, threshold: float, seed: int = 99) -> tuple:
    """(observed counts, exact probabilities, the distinct shapes drawn) of N_SAMPLES one-step
    verifications of the drafter's trees."""
    tables = Tables()
    drafter = DraftModelDrafter(TableModel(tables.draft), width=3, threshold=threshold)
    gen = torch.Generator().manual_seed(seed)
    source, verifier, prompt = GeneratorSource(gen), TreeVerifier(), torch.tensor(PROMPT)
    outputs, shapes = [], set()
    for _ in range(N_SAMPLES):
        drafter.begin(prompt, params)
        draft = drafter.propose(CHAIN, source)
        parents = draft.parent_array()
        tokens = draft.tokens.tolist()
        logits = target_logits(tables, tokens, parents.tolist())
        shapes.add(tuple(parents.tolist()))
        verdict = verifier(draft.tokens, parents, draft.probs, logits, params, source)
        outputs.append([tokens[i] for i in verdict.path] + [verdict.next_token])
    return complete(tables, outputs, params, gen), tables.exact(params), len(shapes)


NAME = "t0.7-top_p0.9"  # top-p: a position may have fewer tokens with mass than the tree asks for


def test_sampled_model_trees_match_target_distribution():
    observed, exact, shapes = tree_counts(PARAMS[NAME], threshold=0.6)
    assert shapes >= 2  # the chain's confidence decides whether its second token gets alternatives
    p = chi_square_p(observed, exact)
    assert p > ALPHA, f"p = {p:.2e}"


def full_rows(logits, probs, first, count, offset, random, params):
    """Broken: alternatives drawn without replacement, but each reported as drawn from the full distribution."""
    return [(token, probs) for token, _ in REAL_SIBLINGS(logits, probs, first, count, offset, random, params)]


REAL_SIBLINGS = draft_model.siblings


def test_alternatives_reported_with_the_full_distribution_are_rejected(monkeypatch):
    monkeypatch.setattr(draft_model, "siblings", full_rows)
    observed, exact, _ = tree_counts(PARAMS[NAME], threshold=0.6)
    p = chi_square_p(observed, exact)
    assert p < ALPHA, f"full rows passed: p = {p:.2e}"


def engine_tree_counts(monkeypatch, verifier: ChainVerifier) -> tuple[np.ndarray, int, int]:
    """Counts through the engine (tests/test_lossless.py's machinery: the tiny target, a noisy copy as the
    draft model with alternatives at every position, `threshold` 1, K = 2, 3 new tokens), and how many
    of the steps verified a tree, of how many."""
    import test_lossless

    monkeypatch.setattr(test_lossless, "N_SAMPLES", ENGINE_SAMPLES)
    target_model = test_lossless.tiny_llama(test_lossless.VOCAB, seed=0, init_scale=test_lossless.INIT_SCALE)
    draft_model_ = test_lossless.noisy_copy(target_model, scale=0.1, seed=1)
    drafter = DraftModelDrafter(test_lossless.as_target(draft_model_), width=3, threshold=1.0)
    drafts = []
    propose = drafter.propose

    def counted(k, random):
        drafts.append(propose(k, random))
        return drafts[-1]

    drafter.propose = counted
    observed = test_lossless.sampled_counts(target_model, drafter, PARAMS["t1"], seed=777, verifier=verifier)
    trees = sum(not torch.equal(d.parent_array(), chain_parents(len(d))) for d in drafts)
    return observed, trees, len(drafts)


def test_engine_over_a_draft_model_tree_matches_target_distribution(monkeypatch):
    """Through the engine with neural models, trees at nearly every step: the engine's tree path (tree
    attention, the verifier, the cache moves and the draft model's rollback) keeps the target's
    distribution. ENGINE_SAMPLES, fewer than test_lossless draws, as tests/test_head.py."""
    import test_lossless

    observed, trees, steps = engine_tree_counts(monkeypatch, ChainVerifier())
    assert trees >= 0.5 * steps, (trees, steps)  # a test of trees, not of chains with a tree now and then
    p = test_lossless.chi_square_p(observed, test_lossless.exact_distribution(
        test_lossless.tiny_llama(test_lossless.VOCAB, seed=0, init_scale=test_lossless.INIT_SCALE), PARAMS["t1"]))
    assert p > ALPHA, f"p = {p:.2e}"


def test_engine_over_a_draft_model_tree_rejects_a_broken_tree_verifier(monkeypatch):
    """The same run with siblings accepted without the residual updated (tests/test_tree_lossless.py's
    `no_residual_update`) for tree steps only: rejected, so the test above sees the tree path."""
    import test_lossless

    observed, _, _ = engine_tree_counts(monkeypatch, ChainVerifier(tree=TreeVerifier(sample=no_residual_update)))
    p = test_lossless.chi_square_p(observed, test_lossless.exact_distribution(
        test_lossless.tiny_llama(test_lossless.VOCAB, seed=0, init_scale=test_lossless.INIT_SCALE), PARAMS["t1"]))
    assert p < ALPHA, f"no_residual_update passed through the engine: p = {p:.2e}"


class Bigram(TokenCache):
    """A model whose next-token logits [VOCAB] depend on the last token only, after `table` [token ->
    logits]. Serves as target (chains and trees) and as draft model."""

    max_length = 64

    def __init__(self, table: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.table = table
        self.vocab_size = len(next(iter(table.values())))

    def score(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.tokens += token_ids.tolist()
        return torch.stack([self.table[t] for t in token_ids.tolist()])  # [n, VOCAB]

    def score_tree(self, token_ids: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        return self.score(token_ids)  # a bigram's row depends on its own token, not on the tree

    def keep_path(self, start: int, nodes: list[int]) -> None:
        tree = self.tokens[start:]
        self.tokens = self.tokens[:start] + [tree[n] for n in nodes]


def bigram(rows: dict[int, list[float]]) -> Bigram:
    return Bigram({token: torch.tensor(row).clamp_min(1e-30).log() for token, row in rows.items()})


# Tokens A, B, C and the prompt's P. After P the draft is sure enough (0.85) to give no alternatives;
# after A sure again (a chain), after B unsure (alternatives: a tree).
FIRST_TOKEN = [0.95, 0.03, 0.02, 0.0]
BIGRAM_TARGET = {3: FIRST_TOKEN, 0: [0.02, 0.02, 0.94, 0.02], 1: [0, 0, 0, 1], 2: [0.25] * 4}
BIGRAM_DRAFT = {3: [0.85, 0.15, 0, 0], 0: [0.02, 0.02, 0.94, 0.02], 1: [0.3, 0.3, 0.2, 0.2], 2: [0.25] * 4}


class ConfidentPrefix(FixedK):
    """K fixed, verifying the draft's prefix of confidence at least 0.9: a cut on confidences known
    before each token is drawn (`Draft.confidence`), exact for any chain."""

    def keep(self, confidence: torch.Tensor) -> int:
        low = (confidence < 0.9).nonzero()
        return int(low[0]) if len(low) else len(confidence)


def first_token_p() -> float:
    """The chi-square p-value of the first tokens of ENGINE_SAMPLES generations through the engine with a
    tree-drafting DraftModelDrafter (width 3) over the bigrams, under `ConfidentPrefix`, at temperature 1."""
    drafter = DraftModelDrafter(bigram(BIGRAM_DRAFT), width=3)
    source = GeneratorSource(torch.Generator().manual_seed(0))
    counts = np.zeros(len(FIRST_TOKEN))
    for _ in range(ENGINE_SAMPLES):
        steps = decode(bigram(BIGRAM_TARGET), drafter, ConfidentPrefix(2), torch.tensor([3, 3]), PARAMS["t1"],
                       max_new_tokens=3, eos_token_ids=frozenset(), random=source, stats=Stats())
        counts[next(steps)[0]] += 1
        steps.close()
    return chi_square_p(counts, np.array(FIRST_TOKEN))


def test_a_sampled_tree_draft_is_never_cut_on_its_confidence():
    assert first_token_p() > ALPHA


def test_a_sampled_draft_cut_where_it_has_no_alternatives_is_rejected(monkeypatch):
    """Broken as the drafter was: a chain (which the K policy may cut) where no position got alternatives,
    so whether token 0 is verified depends on the peak after it, a function of token 0 itself."""
    monkeypatch.setattr(DraftModelDrafter, "chain_form", lambda self, no_alternatives: no_alternatives)
    assert first_token_p() < ALPHA
