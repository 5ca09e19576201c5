"""Drafters: one Protocol, many implementations, chosen by name on the command line.

`make_drafter` turns the user's `--drafter` value into a Drafter: a registered
name, `NAME:PATH`, `A+B` (A's draft when it finds one, else B's), or the path of
a draft model. A draft model whose tokenizer is not the target's (found by comparing
the two) drafts through `cross_vocab` (`text:PATH` or `intersection:PATH` pick its
method; the path alone, `auto`). The engine itself never asks which drafter
it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from specsample.drafters.base import Draft, Drafter
from specsample.drafters.cost import relative_pass_cost
from specsample.drafters.cross_vocab import METHODS, cross_vocab_drafter
from specsample.drafters.draft_model import DraftModelDrafter
from specsample.drafters.fallback import FallbackDrafter, check_lookup
from specsample.drafters.head import HeadDrafter, shipped_head_dir
from specsample.drafters.head_tree import HeadTreeDrafter
from specsample.drafters.layerskip import LayerSkipDrafter
from specsample.drafters.ngram import NgramDrafter, NgramTreeDrafter
from specsample.drafters.ngram_cache import NgramCacheDrafter
from specsample.drafters.none import NoDrafter
from specsample.drafters.quantized import quantized_drafter
from specsample.drafters.recycle import RecycleChainDrafter, RecycleDrafter
from specsample.drafters.suffix import SuffixDrafter, SuffixTreeDrafter
from specsample.models import LoadedModel, Target, load_target
from specsample.models.loading import with_weights
from specsample.models.target import NotOnThisBackend, RecordsFeatures, RunsLayerSubsets, ScoresTrees, require, rolls_back
from specsample.vocabulary import same_vocabulary

TREE_WIDTH = 3  # quantized-tree, draft-tree: the chain's token and up to 2 alternatives at a low-confidence position

# A factory builds a drafter for a loaded target model and its Target backend.
DrafterFactory = Callable[[LoadedModel, Target], Drafter]

def head_drafter(
    model: LoadedModel, target: Target, path: str | None = None, kind: type[HeadDrafter] = HeadDrafter
) -> Drafter:
    """The draft head in `path` (None: the one shipped for this target), once the target is known to keep
    the features a head reads (before the model's weights are read, or loaded where the target runs a
    GGUF file without them); `kind` drafts with it (HeadTreeDrafter: EAGLE-2's dynamic tree)."""
    target = require_features(target)
    model = with_weights(model)
    return kind.load(model, target, shipped_head_dir(model) if path is None else path)


def head_tree_drafter(model: LoadedModel, target: Target, path: str | None = None) -> Drafter:
    """The head drafting EAGLE-2's dynamic tree (drafters/head_tree.py), for a target that scores trees."""
    require(target, ScoresTrees, "the head-tree drafter (it drafts trees)")
    return head_drafter(model, target, path, HeadTreeDrafter)


def draft_tree_drafter(model: LoadedModel, target: Target, path: str) -> Drafter:
    """The draft model at `path` (the target's vocabulary) drafting trees: its chain with alternative leaves
    at its low-confidence positions (drafters/draft_model.py)."""
    require(target, ScoresTrees, "the draft-tree drafter (it drafts trees)")
    draft, draft_target = load_draft(path, "auto", trust_remote_code=False, threads=None)
    if not same_vocabulary(model.tokenizer, draft.tokenizer):
        raise ValueError(f"draft-tree needs a draft model with the target's vocabulary; {path} has another")
    check_same_width(target, draft_target)
    return DraftModelDrafter(draft_target, relative_pass_cost(draft_target, target), width=TREE_WIDTH)


def layerskip_drafter(model: LoadedModel, target: Target) -> Drafter:
    """The layer-skipping drafter, its calibration on the model's weights (loaded if need be)."""
    return LayerSkipDrafter.load(with_weights(model), require(target, RunsLayerSubsets, "layerskip"))


REGISTRY: dict[str, DrafterFactory] = {
    "none": lambda model, target: NoDrafter(),
    "head": head_drafter,
    "ngram": lambda model, target: NgramDrafter(),
    "ngram-cache": lambda model, target: NgramCacheDrafter(),  # llama.cpp's n-gram cache rule, stricter
    "suffix": lambda model, target: SuffixDrafter(),
    "layerskip": layerskip_drafter,
    "quantized": quantized_drafter,
    "recycle-chain": lambda model, target: RecycleChainDrafter(),  # one path: a chain on any target
    # tree drafters (verify/tree.py), for targets that score a tree in one pass
    "recycle": lambda model, target: trees(target, "recycle", RecycleDrafter),
    "ngram-tree": lambda model, target: trees(target, "ngram-tree", NgramTreeDrafter),
    "suffix-tree": lambda model, target: trees(target, "suffix-tree", SuffixTreeDrafter),
    "quantized-tree": lambda model, target: trees(target, "quantized-tree", lambda: quantized_drafter(model, target, TREE_WIDTH)),
    "head-tree": head_tree_drafter,
}

# Drafters that load their weights from a directory: `--drafter NAME:PATH`.
PATH_REGISTRY: dict[str, Callable[[LoadedModel, Target, str], Drafter]] = {
    "head": head_drafter,
    "head-tree": head_tree_drafter,
    "draft-tree": draft_tree_drafter,
}


def trees(target: Target, name: str, make: Callable[[], Drafter]) -> Drafter:
    """A tree drafter, if the target scores trees (`ScoresTrees`); else a one-line error."""
    require(target, ScoresTrees, f"the {name} drafter (it drafts trees)")
    return make()


def require_features(target: Target) -> Target:
    """The target, if it keeps the features a head reads; asked before the head reads the target's weights."""
    return require(target, RecordsFeatures, "the head drafter")


@dataclass(frozen=True)
class MakeOptions:
    """How a drafter is made beside its target: the target's `backend` (a draft model runs on llama.cpp
    too when it is `llamacpp`), whether a model's own code may run, the target's `threads`."""

    backend: str = "auto"
    trust_remote_code: bool = False
    threads: int | None = None


# A parsed spec (`parse_spec`): makes its drafter for a loaded target model and its Target backend.
Recipe = Callable[[LoadedModel, Target, MakeOptions], Drafter]


def make_drafter(
    spec: str,
    model: LoadedModel,
    target: Target,
    *,
    backend: str = "auto",
    trust_remote_code: bool = False,
    threads: int | None = None,
) -> Drafter:
    """A drafter from a registered name, `NAME:PATH`, `A+B`, or the path of a draft model directory or GGUF
    file, which runs on llama.cpp too when `backend` (the target's) is `llamacpp`, with the target's
    `threads` (None: the backend's default). A draft model's cost per token, relative to a target pass,
    is measured once here (`drafters.cost`), so that the K policy knows it before any draft. Any drafter
    but none needs a target whose cache rolls back (`target.rolls_back`)."""
    recipe = parse_spec(spec)
    if spec != "none" and not rolls_back(target):
        raise NotOnThisBackend(f"the {spec} drafter needs a target whose cache rolls back past rejected draft "
                               f"tokens; llama.cpp keeps only a state for this recurrent model: use --drafter none")
    return recipe(model, target, MakeOptions(backend, trust_remote_code, threads))


def check_spec(spec: str) -> None:
    """Refuse, before any model loads, a drafter spec that `make_drafter` would refuse by its text alone
    (`parse_spec`). Whether a known drafter runs on the target is decided when it is made."""
    parse_spec(spec)


def parse_spec(spec: str) -> Recipe:
    """The recipe of a drafter spec: a registered name, NAME:PATH, A+B of two such (A a lookup drafter,
    neither none), or the path of a draft model (a path that exists is taken whole, `+` or `:` in it);
    a spec naming none of these is a ValueError."""
    if not isinstance(spec, str):
        raise ValueError(f"a drafter is named by a string (none, ngram, suffix, a path, ...), got {spec!r}")
    if spec in REGISTRY:
        return lambda model, target, options: REGISTRY[spec](model, target)
    first, plus, second = spec.partition("+")
    if plus and not Path(spec).expanduser().exists():
        three = "+" in second and not Path(second).expanduser().exists()
        if not first or not second or "none" in (first, second) or three:
            raise ValueError(f"an A+B drafter names two drafters, a lookup drafter and a second one, neither "
                             f"of them none (for example suffix+quantized); got {spec!r}")
        return partial(fallback_drafter, first, parse_spec(first), parse_spec(second))
    name, sep, path = spec.partition(":")
    if not spec.strip() or (sep and (name in PATH_REGISTRY or name in METHODS) and not path.strip()):
        raise ValueError(f"the drafter {spec!r} names no draft model: give a drafter name, NAME:PATH or a path "
                         f"(an empty path is not taken as the current directory)")
    if sep and name in PATH_REGISTRY:
        return lambda model, target, options: PATH_REGISTRY[name](model, target, path)
    method, path = (name, path) if sep and name in METHODS else ("auto", spec)
    if not Path(path).expanduser().exists():
        if (not sep or name in METHODS) and ("/" in path or path.endswith(".gguf")):  # meant as a path
            raise FileNotFoundError(f"draft model path does not exist: {path}")
        raise unknown_drafter(spec)
    return partial(draft_model_drafter, method, path)


def fallback_drafter(name: str, lookup: Recipe, second: Recipe, model: LoadedModel, target: Target,
                     options: MakeOptions) -> Drafter:
    """A+B: the lookup drafter `name`'s draft when it finds one, else the second drafter's."""
    made = lookup(model, target, options)
    check_lookup(made, name)
    return FallbackDrafter(made, second(model, target, options))


def draft_model_drafter(method: str, path: str, model: LoadedModel, target: Target, options: MakeOptions) -> Drafter:
    """The draft model at `path`: drafting its own tokens where its vocabulary is the target's (`auto`),
    else through `cross_vocab` by `method`."""
    draft, draft_target = load_draft(path, options.backend, options.trust_remote_code, options.threads)
    if method == "auto" and same_vocabulary(model.tokenizer, draft.tokenizer):
        check_same_width(target, draft_target)
        return DraftModelDrafter(draft_target, relative_pass_cost(draft_target, target))
    return cross_vocab_drafter(method, model, target, draft, draft_target)


def unknown_drafter(spec: str) -> ValueError:
    names = ", ".join(sorted(REGISTRY))
    return ValueError(f"unknown drafter {spec!r}: expected one of {names}, or the path of a draft model")


def load_draft(path: str, backend: str, trust_remote_code: bool, threads: int | None) -> tuple[LoadedModel, Target]:
    """A draft model and its backend (llama.cpp where the target's is, with the target's threads), or one
    line saying why not."""
    try:
        draft_backend = "llamacpp" if backend == "llamacpp" else "auto"
        return load_target(path, draft_backend, trust_remote_code=trust_remote_code, threads=threads)
    except (OSError, ValueError, KeyError) as error:  # transformers' loaders raise these for files they cannot read
        raise ValueError(f"cannot load the draft model or its tokenizer from {path}: {error}") from error


def check_same_width(target: Target, draft: Target) -> None:
    """A draft model with the target's vocabulary must have its logits width too."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"the draft model has the target's vocabulary but {draft.vocab_size} logits against the target's {target.vocab_size}"
        )


__all__ = [
    "Draft", "Drafter", "DraftModelDrafter", "FallbackDrafter", "NgramCacheDrafter", "NgramDrafter", "NgramTreeDrafter",
    "NoDrafter", "REGISTRY", "RecycleDrafter", "SuffixDrafter", "SuffixTreeDrafter", "make_drafter",
]
