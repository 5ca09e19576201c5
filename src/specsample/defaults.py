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
- A backend whose quantized copy is not declared cheap (`CopyCost`): `suffix`. The fast backend
  on a GGUF file's own 4- to 8-bit blocks (`--backend gguf`) has only its int8 copy, which streams
  more bytes than the target. The llamacpp
  backend's copy (a lower-bit GGUF from llama.cpp's quantizer) runs on the same AVX-512 CPU
  but costs about a full target pass on the bundled model (docs/llamacpp-backend.md), where
  the fast backend's int8 copy, with which `suffix+quantized` measured best, costs 0.29.
- Any other backend (no quantized copy, or the fast backend on torch ops): the lookup drafter
  `suffix` with `--k auto`, which needs nothing from the backend and costs next to nothing.

The choice reads declared capabilities of the target (models/target.py),
never its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsample.models.target import CopyCost, QuantizedCopies, Target

# A quantized copy cheaper than this share of a target pass may draft by default: the fast
# backend's int8 copy costs 3.6 ms against a 12.5 ms pass (0.29, BENCHMARKS.md), and that is
# the copy with which `suffix+quantized` measured best.
CHEAP_COPY = 0.3


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
    if isinstance(target, CopyCost) and not cheap(target.copy_cost):
        return Configuration("suffix", "auto", f"default: {costly_copy(target.copy_cost)}; a lookup drafter under the cost model")
    if isa == "avx512":
        return Configuration("suffix+quantized", "auto", "default: the best measured on the fast backend with AVX-512")
    return Configuration(
        "none", "auto",
        f"default: speculation on {isa} kernels is not yet measured to pay on such a machine "
        "(it slowed decoding with earlier kernels): plain decoding",
    )


def cheap(cost: float | None) -> bool:
    """A declared copy cost low enough for the copy to draft by default (CHEAP_COPY)."""
    return cost is not None and cost <= CHEAP_COPY


def costly_copy(cost: float | None) -> str:
    """Why a declared copy does not draft by default."""
    if cost is None:
        return "this backend's quantized copy is not measured to be cheaper than the target"
    return f"this backend's quantized copy costs {cost:.2f} of a target pass (measured), more than {CHEAP_COPY}"


def given(drafter: str, k: str = "4") -> Configuration:
    """A configuration the user chose."""
    return Configuration(drafter, k, "given")
