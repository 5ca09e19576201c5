"""Model loading and Target backends."""

from __future__ import annotations

from pathlib import Path

from specsample.models.hf import TransformersTarget
from specsample.models.loading import LoadedModel, bundled_gguf, load_model
from specsample.models.target import Target
from specsample.openmp import MAX_THREADS, check_threads  # noqa: F401  (where the models' callers find them)

BACKENDS = ("auto", "fast", "gguf", "transformers", "llamacpp")


def check_backend(backend: str) -> None:
    """Refuse, before anything is loaded, a backend of no such name, or `llamacpp` where llama-cpp-python
    is not installed (the optional extra: it failed only once the model had loaded)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    from specsample.models.choice import llamacpp_installed

    if backend == "llamacpp" and not llamacpp_installed():
        from specsample.models.llamacpp import LLAMACPP_MISSING

        raise ValueError(LLAMACPP_MISSING)


def check_backend_runs(backend: str, loaded: LoadedModel) -> None:
    """Refuse, before anything is built, a backend that cannot run the loaded model (a GGUF backend for a
    model directory)."""
    check_backend(backend)
    if backend in ("gguf", "llamacpp") and loaded.gguf is None:
        raise ValueError(f"the {backend} backend runs GGUF files, and {loaded.name} is not one")


def make_target(loaded: LoadedModel, backend: str = "auto", *, threads: int | None = None) -> Target:
    """A loaded model's target on `backend_of(loaded, backend)`: `fast`, the fast Llama-family backend (a
    model already in memory stays in float32); `transformers`; `gguf`: the fast backend with its linear maps
    on the file's own GGUF blocks (Q4_0 to Q8_0, Q4_K, Q6_K; `gguf_blocks`), built from the file alone when
    `loaded` holds no weights; `llamacpp` runs the GGUF file `loaded` came from on llama.cpp (`threads`:
    default all cores)."""
    check_backend_runs(backend, loaded)
    backend = backend_of(loaded, backend)
    if backend == "llamacpp":
        from specsample.models.llamacpp import LlamaCppTarget

        return LlamaCppTarget(loaded.gguf, n_threads=threads)
    if backend == "gguf":
        from specsample.models.gguf_blocks import file_target, gguf_target

        return file_target(loaded.gguf) if loaded.model is None else gguf_target(loaded.model, loaded.gguf)
    if loaded.model is None:
        raise ValueError(f"the {backend} backend needs the model's weights, loaded without them")
    if backend == "fast":
        from specsample.models import llama

        if not llama.supports(loaded.model.config):
            raise ValueError(f"the fast backend does not support model type {loaded.model.config.model_type!r}")
        return llama.LlamaTarget.from_hf(loaded.model, gguf=loaded.gguf)
    return TransformersTarget(loaded.model)


def backend_of(loaded: LoadedModel, backend: str) -> str:
    """The backend `make_target` runs `loaded` on for `backend`: `auto` with the weights in memory is `fast`
    where the fast backend supports the architecture, else `transformers` (`load_target` resolves `auto`
    for a GGUF file by measuring, `models.choice`); any other is itself."""
    if backend != "auto" or loaded.model is None:
        return backend
    from specsample.models import llama

    return "fast" if llama.supports(loaded.model.config) else "transformers"


def load_target(
    path: str | None = None,
    backend: str = "auto",
    *,
    trust_remote_code: bool = False,
    threads: int | None = None,
) -> tuple[LoadedModel, Target]:
    """A model (None: the bundled one) and its target on `backend`: for `llamacpp` and `gguf` the GGUF
    file's tokenizer only (the weights stay in the file, run by llama.cpp or read into the block
    kernels' layout; `loading.with_weights` loads them for a drafter that needs them), else the whole model.
    `auto` on a GGUF file runs it where it measures faster on this machine (`models.choice`)."""
    from specsample.models.choice import resolve

    backend, _ = resolve(path, backend, threads=threads, trust_remote_code=trust_remote_code)
    if backend == "llamacpp":
        from specsample.models.llamacpp import LlamaCppTarget

        # llama.cpp reads the file first: a file it cannot load gets its one-line error, not the tokenizer's
        target = LlamaCppTarget(bundled_gguf() if path is None else Path(path).expanduser(), n_threads=threads)
        return load_model(path, tokenizer_only=True), target
    if backend == "gguf":
        if path is not None and Path(path).expanduser().is_dir():
            raise ValueError(f"the gguf backend runs GGUF files, and {path} is not one")
        loaded = load_model(path, tokenizer_only=True)
        return loaded, make_target(loaded, backend, threads=threads)
    loaded = load_model(path, trust_remote_code=trust_remote_code)
    return loaded, make_target(loaded, backend, threads=threads)


__all__ = ["BACKENDS", "LoadedModel", "Target", "TransformersTarget", "load_model", "load_target", "make_target"]
