"""Verification: pure functions that decide which draft tokens the target accepts (`chain`), and
the statistical certificate that a configuration keeps the target distribution (`check`)."""

from specsample.verify.chain import ChainVerifier, Verdict, greedy_verify, leading_true, rejection_sample, residual

__all__ = ["ChainVerifier", "Verdict", "greedy_verify", "leading_true", "rejection_sample", "residual"]
