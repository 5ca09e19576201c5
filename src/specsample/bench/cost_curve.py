"""`bench cost-curve`'s targets and context: f(n)/f(1) for n = 1..16 over a realistic cache (real text,
200 tokens by default), measured by `specsample.cost_curve.measure`. The llamacpp backend times the GGUF
file at its own quantization on llama.cpp (its own threads, `threads`), the others its float32 weights
on torch's threads."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specsample.models import LoadedModel, make_target
from specsample.models.target import Target


def targets(loaded: LoadedModel, backends: Sequence[str], threads: int | None = None) -> dict[str, Target]:
    """A target per backend name, of the one model; `threads` for llama.cpp's passes (None: all cores)."""
    return {name: make_target(loaded, name, threads=threads) for name in backends}


def describe(targets: dict[str, Target]) -> list[str]:
    """One line per target: its class and threads (and llama.cpp's CPU variant)."""
    lines = []
    for name, target in targets.items():
        if hasattr(target, "n_threads"):  # LlamaCppTarget
            from specsample.models.llamacpp import system_info

            lines.append(f"{name}: {type(target).__name__}, {target.n_threads} threads, {system_info()}")
        else:
            lines.append(f"{name}: {type(target).__name__}, {torch.get_num_threads()} torch threads")
    return lines


def context_tokens(tokenizer, text: str, length: int) -> Tensor:
    """`length` token ids of `text`, repeated as needed: a realistic context to attend over."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError("the context text has no tokens")
    ids = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor(ids, dtype=torch.long)
