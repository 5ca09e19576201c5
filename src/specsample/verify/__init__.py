"""Verification: pure functions that decide which draft tokens the target accepts (`chain`: modified
rejection sampling and greedy; `tree`: the same over a tree of drafts; `coupled`: token comparison under numbers keyed by output position), and
the checks that a configuration keeps the target distribution and a seed's text (`check`)."""

from specsample.verify.chain import ChainVerifier, greedy_verify, rejection_sample, residual
from specsample.verify.tree import TreeVerifier, coupled_verify_tree, greedy_verify_tree, rejection_sample_tree
from specsample.verify.coupled import coupled_tokens, coupled_verify
from specsample.verify.verdict import Verdict, leading_true, match_tokens

__all__ = [
    "ChainVerifier", "Verdict", "coupled_tokens", "coupled_verify", "greedy_verify", "leading_true", "match_tokens",
    "rejection_sample", "residual", "TreeVerifier", "coupled_verify_tree", "greedy_verify_tree",
    "rejection_sample_tree",
]
