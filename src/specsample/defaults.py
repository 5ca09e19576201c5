"""The configuration used when the user names no drafter: the best lossless one measured for the
target's backend on this machine (BENCHMARKS.md), under the cost-model K policy.

- The fast backend on its AVX-512 kernels: `suffix+quantized` with `--k auto`, the fastest
  configuration measured on the bundled model at temperature 0 (BENCHMARKS.md); the cost model
  drops to plain decoding (K = 0) wherever drafting does not pay.
- The fast backend on kernels built without AVX-512: plain decoding. On an AVX2-only machine
  (AMD EPYC) the earlier kernels made a pass over n tokens cost about n single passes
  (f(8)/f(1) = 7.6) and every drafter slowed decoding (plain 8.0 tokens/s, `suffix` 5.5,
  `quantized` 4.8). The AVX2 kernels are rebuilt since (f(8)/f(1) about 1.5 on an AVX-512 machine
  forced to build them, docs/kernels-avx2.md), but speculation on them is not yet measured on an
  AVX2 machine: until it is, the default does not speculate there.
- Any other backend (no quantized copy, or the fast backend on torch ops): the lookup drafter
  `suffix` with `--k auto`, which needs nothing from the backend and costs next to nothing.

The choice reads declared capabilities of the target (models/target.py), never its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsample.models.target import QuantizedCopies, Target


@dataclass(frozen=True)
class Configuration:
    drafter: str  # a `--drafter` value
    k: str  # a `--k` value
    reason: str  # why, as reported in --json stats and /v1/models


def default_configuration(target: Target) -> Configuration:
    """The drafter and K policy for `target` when the user gives none."""
    isa = target.instruction_set if isinstance(target, QuantizedCopies) else None
    if isa is None:
        return Configuration(
            "suffix", "auto",
            "default: suffix+quantized needs a backend with a cheap quantized copy (the fast backend's C++ kernels); "
            "a lookup drafter under the cost model",
        )
    if isa == "avx512":
        return Configuration("suffix+quantized", "auto", "default: the best measured on the fast backend with AVX-512")
    return Configuration(
        "none", "auto",
        f"default: speculation on {isa} kernels is not yet measured to pay on such a machine "
        "(it slowed decoding with earlier kernels): plain decoding",
    )


def given(drafter: str, k: str = "4") -> Configuration:
    """A configuration the user chose."""
    return Configuration(drafter, k, "given")
