"""`bench cost-curve`'s targets and context: f(n)/f(1) for n = 1..16 over a realistic cache (real text,
200 tokens by default), measured by `specsample.cost_curve.measure`. The llamacpp backend times the GGUF
file at its own quantization on llama.cpp (its own threads, `threads`), the others its float32 weights
on torch's threads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from specsample.models import LoadedModel, make_target
from specsample.models.target import Target


def resolved(model: str | None, names: Sequence[str], threads: int | None = None) -> dict[str, str]:
    """Column label -> backend for the backend names given: "auto" resolved as `generate` resolves it
    (`models.choice.resolve`: for a GGUF file, the backend measured fastest here), labelled "B (auto)"; a
    ValueError where it resolves to a backend the list names too."""
    from specsample.models.choice import resolve

    out: dict[str, str] = {}
    for name in names:
        backend = resolve(model, name, threads=threads)[0] if name == "auto" else name
        if backend != name and backend in names:
            raise ValueError(f"--backends names {backend} twice: auto resolves to it here")
        out[f"{backend} (auto)" if backend != name else name] = backend
    return out


def targets(loaded: LoadedModel, backends: Mapping[str, str], threads: int | None = None) -> dict[str, Target]:
    """A target per column label (label -> backend name), of the one model; `threads` for llama.cpp's
    passes (None: all cores)."""
    return {label: make_target(loaded, backend, threads=threads) for label, backend in backends.items()}


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
