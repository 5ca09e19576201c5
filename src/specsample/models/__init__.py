"""Model loading and Target backends."""

from __future__ import annotations

from specsample.models.hf import TransformersTarget
from specsample.models.loading import LoadedModel, load_model
from specsample.models.target import Target

BACKENDS = ("auto", "fast", "transformers")


def make_target(loaded: LoadedModel, backend: str = "auto") -> Target:
    """The fast Llama-family backend when it supports the architecture, else transformers."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend != "transformers":
        from specsample.models import llama

        if llama.supports(loaded.model.config):
            return llama.LlamaTarget.from_hf(loaded.model)
        if backend == "fast":
            raise ValueError(f"the fast backend does not support model type {loaded.model.config.model_type!r}")
    return TransformersTarget(loaded.model)


__all__ = ["LoadedModel", "Target", "TransformersTarget", "load_model", "make_target"]
