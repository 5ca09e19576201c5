"""Drafters: one Protocol, many implementations, chosen by name on the command line.

`make_drafter` turns the user's `--drafter` value into a Drafter: a registered
name, `NAME:PATH`, `A+B` (A's draft when it finds one, else B's), or the path of
a draft model. The engine itself never asks which drafter
it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specsample.drafters.base import Draft, Drafter
from specsample.drafters.draft_model import DraftModelDrafter
from specsample.drafters.fallback import FallbackDrafter, check_lookup
from specsample.drafters.head import HeadDrafter, shipped_head_dir
from specsample.drafters.layerskip import LayerSkipDrafter
from specsample.drafters.ngram import NgramDrafter, NgramTreeDrafter
from specsample.drafters.none import NoDrafter
from specsample.drafters.quantized import quantized_drafter
from specsample.drafters.recycle import RecycleChainDrafter, RecycleDrafter
from specsample.drafters.suffix import SuffixDrafter, SuffixTreeDrafter
from specsample.models import LoadedModel, Target, load_target
from specsample.models.loading import with_weights
from specsample.models.target import RecordsFeatures, RunsLayerSubsets, ScoresTrees, require

# A factory builds a drafter for a loaded target model and its Target backend.
DrafterFactory = Callable[[LoadedModel, Target], Drafter]

def head_drafter(model: LoadedModel, target: Target, path: str | None = None) -> Drafter:
    """The draft head in `path` (None: the one shipped for this target), once the target is known to keep
    the features a head reads (before the model's weights are read, or loaded where the target runs a
    GGUF file without them)."""
    target = require_features(target)
    model = with_weights(model)
    return HeadDrafter.load(model, target, shipped_head_dir(model) if path is None else path)


def layerskip_drafter(model: LoadedModel, target: Target) -> Drafter:
    """The layer-skipping drafter, its calibration on the model's weights (loaded if need be)."""
    return LayerSkipDrafter.load(with_weights(model), require(target, RunsLayerSubsets, "layerskip"))


REGISTRY: dict[str, DrafterFactory] = {
    "none": lambda model, target: NoDrafter(),
    "head": head_drafter,
    "ngram": lambda model, target: NgramDrafter(),
    "suffix": lambda model, target: SuffixDrafter(),
    "layerskip": layerskip_drafter,
    "quantized": quantized_drafter,
    # tree drafters (verify/tree.py), for targets that score a tree in one pass
    "recycle": lambda model, target: trees(target, "recycle", RecycleDrafter),
    "recycle-chain": lambda model, target: trees(target, "recycle-chain", RecycleChainDrafter),
    "ngram-tree": lambda model, target: trees(target, "ngram-tree", NgramTreeDrafter),
    "suffix-tree": lambda model, target: trees(target, "suffix-tree", SuffixTreeDrafter),
}

# Drafters that load their weights from a directory: `--drafter NAME:PATH`.
PATH_REGISTRY: dict[str, Callable[[LoadedModel, Target, str], Drafter]] = {
    "head": head_drafter,
}


def trees(target: Target, name: str, make: Callable[[], Drafter]) -> Drafter:
    """A tree drafter, if the target scores trees (`ScoresTrees`); else a one-line error."""
    require(target, ScoresTrees, f"the {name} drafter (it drafts trees)")
    return make()


def require_features(target: Target) -> Target:
    """The target, if it keeps the features a head reads; asked before the head reads the target's weights."""
    return require(target, RecordsFeatures, "the head drafter")


def make_drafter(
    spec: str, model: LoadedModel, target: Target, *, backend: str = "auto", trust_remote_code: bool = False
) -> Drafter:
    """A drafter from a registered name, `NAME:PATH`, `A+B`, or the path of a draft model directory or GGUF
    file, which runs on llama.cpp too when `backend` (the target's) is `llamacpp`."""
    if spec in REGISTRY:
        return REGISTRY[spec](model, target)
    first, plus, second = spec.partition("+")
    if plus and not Path(spec).expanduser().exists():
        lookup = make_drafter(first, model, target, backend=backend, trust_remote_code=trust_remote_code)
        check_lookup(lookup, first)
        return FallbackDrafter(
            lookup, make_drafter(second, model, target, backend=backend, trust_remote_code=trust_remote_code)
        )
    name, sep, path = spec.partition(":")
    if sep and name in PATH_REGISTRY:
        return PATH_REGISTRY[name](model, target, path)
    if not Path(spec).expanduser().exists():
        names = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown drafter {spec!r}: expected one of {names}, or the path of a draft model")
    draft, draft_target = load_target(
        spec, "llamacpp" if backend == "llamacpp" else "auto", trust_remote_code=trust_remote_code
    )
    check_same_vocabulary(model, target, draft, draft_target)
    return DraftModelDrafter(draft_target)


def check_same_vocabulary(target: LoadedModel, target_backend: Target, draft: LoadedModel, draft_backend: Target) -> None:
    """A draft model must share the target's tokenizer vocabulary and logits width."""
    target_width, draft_width = target_backend.vocab_size, draft_backend.vocab_size
    if target_width != draft_width or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError(
            f"the draft model's vocabulary ({len(draft.tokenizer)} tokens, {draft_width} logits) "
            f"differs from the target's ({len(target.tokenizer)} tokens, {target_width} logits)"
        )


__all__ = [
    "Draft", "Drafter", "DraftModelDrafter", "FallbackDrafter", "NgramDrafter", "NgramTreeDrafter", "NoDrafter",
    "REGISTRY", "RecycleDrafter", "SuffixDrafter", "SuffixTreeDrafter", "make_drafter",
]
