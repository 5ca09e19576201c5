"""The configuration used when the user names no drafter: the best lossless one measured for the
target's backend on this machine (BENCHMARKS.md), under the cost-model K policy.

- The fast backend on its AVX-512 or AVX2 kernels: `suffix+quantized` with `--k auto`, the fastest
  configuration measured on the bundled model's float32 weights at temperature 0 (BENCHMARKS.md: with
  AVX-512, and on an AMD EPYC with AVX2 only, where the earlier kernels made a pass over n tokens cost
  about n single passes and every drafter slowed decoding; with the AVX2 kernels of now it measured
  1.53x plain decoding there on tuned prompts, `suffix` 1.39x, and 1.42x on never-tuned ones); the
  cost model drops to plain decoding (K = 0) wherever drafting does not pay.
- The fast backend on its portable kernels (no AVX2): plain decoding. Their products are scalar C++,
  and no speculation is measured to pay on them.
- A backend whose quantized copy is not declared cheap (`CopyCost`): `suffix`. The fast backend
  on a GGUF file's own 4- to 8-bit blocks (`--backend gguf`) has only its int8 copy, which streams
  more bytes than the target. The llamacpp
  backend's copy (a lower-bit GGUF from llama.cpp's quantizer) runs on the same AVX-512 CPU
  but costs about a full target pass on the bundled model (docs/llamacpp-backend.md), where
  the fast backend's int8 copy, with which `suffix+quantized` measured best, costs 0.29, and its
  copy of float32 weights read from a GGUF file (the file's own blocks) 0.14.
- Any other backend (no quantized copy, or the fast backend on torch ops): the lookup drafter
  `suffix` with `--k auto`, which needs nothing from the backend and costs next to nothing.
- A target whose cache cannot roll back (`target.rolls_back`: a recurrent or hybrid model, Mamba,
  RWKV, Jamba, on llama.cpp): plain decoding, as speculation has no way to take back a rejected token.

The choice reads declared capabilities of the target (models/target.py),
never its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsample.models.target import CopyCost, QuantizedCopies, Target, rolls_back

# A quantized copy cheaper than this share of a target pass may draft by default: the fast
# backend's int8 copy costs 3.6 ms against a 12.5 ms pass (0.29, BENCHMARKS.md), and that is
# the copy with which `suffix+quantized` measured best.
CHEAP_COPY = 0.3
# Kernel instruction sets on which the fast backend's passes over several tokens cost little more than
# over one, and `suffix+quantized` measured fastest (BENCHMARKS.md).
VECTOR_KERNELS = ("avx512", "avx2")


@dataclass(frozen=True)
class Configuration:
    drafter: str  # a `--drafter` value
    k: str  # a `--k` value
    reason: str  # why, as reported in --json stats and /v1/models


def default_configuration(target: Target) -> Configuration:
    """The drafter and K policy for `target` when the user gives none."""
    if not rolls_back(target):
        return Configuration("none", "0", "default: plain decoding; this recurrent model's state cannot be rolled back "
                                          "past rejected draft tokens")
    isa = target.instruction_set if isinstance(target, QuantizedCopies) else None
    if isa is None:
        return Configuration(
            "suffix", "auto",
            "default: suffix+quantized needs a backend with a cheap quantized copy (the fast backend's C++ kernels); "
            "a lookup drafter under the cost model",
        )
    if isinstance(target, CopyCost) and not cheap(target.copy_cost):
        return Configuration("suffix", "auto", f"default: {costly_copy(target.copy_cost)}; a lookup drafter under the cost model")
    if isa in VECTOR_KERNELS:
        return Configuration("suffix+quantized", "auto", f"default: the best measured on the fast backend with {isa} kernels")
    return Configuration(
        "none", "auto",
        f"default: speculation on {isa} kernels (no vector instructions) is not measured to pay: plain decoding",
    )


def cheap(cost: float | None) -> bool:
    """A declared copy cost low enough for the copy to draft by default (CHEAP_COPY)."""
    return cost is not None and cost <= CHEAP_COPY


def costly_copy(cost: float | None) -> str:
    """Why a declared copy does not draft by default."""
    if cost is None:
        return "this backend's quantized copy is not measured to be cheaper than the target"
    return f"this backend's quantized copy costs {cost:.2f} of a target pass (measured), more than {CHEAP_COPY}"


def given(drafter: str, k: str | None = None) -> Configuration:
    """A configuration the user chose; K, where not given, 4 (0 for plain decoding, which drafts nothing)."""
    return Configuration(drafter, k if k is not None else "0" if drafter == "none" else "4", "given")
