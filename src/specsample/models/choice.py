"""`--backend auto` for a GGUF file: the backend that decodes this model faster on this machine.

A GGUF file can run three ways: dequantized to float32 on the fast backend (or transformers,
for an architecture the fast backend does not cover: "auto"), on the fast backend's kernels
over the file's own GGUF blocks ("gguf"), or on llama.cpp ("llamacpp", when
llama-cpp-python is installed). Which is faster depends on the
model, its quantization and the CPU (llama.cpp's kernels against the project's, AVX-512
against AVX2), so it is measured rather than assumed: the median time of one single-token
pass over a 64-token cache, plain decoding's cost per token, on each backend with the same
threads (`--threads`, all cores by default: `openmp.use_threads`), one backend after another
(`cost_curve.measure`). The faster one is remembered in the
cache directory per file, CPU, thread count and whether llama-cpp-python is installed, so only
the first run on a machine pays for the measurement (a few seconds, plus the float32 conversion
if it is not cached yet); a remembered choice that cannot be read is measured again. Speculation
on top is then chosen for the backend picked (`specsample.defaults`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specsample.cost_curve import measure_synthetic
from specsample.openmp import default_threads
from specsample.models.target import Target

CONTEXT = 64  # cached tokens under each timed pass
PASSES = 12  # timed single-token passes per backend (after 2 untimed)
CANDIDATES = "llamacpp,gguf,auto"  # part of the remembered choice's key: a new candidate measures anew
# Part of the keys of what is remembered per machine (this choice, the cost model's prior f(n)/f(1)): a
# change to the kernels' speed makes it stale. 2: block kernels for Q4_K, Q6_K, Q5_0, Q5_1; 3: float16
# caches, one call a pass; 4: prefetch distance; 5: pairs of panels; 6: attention of several tokens a job,
# keys prefetched; 7: keys in tiles of positions, values prefetched further; 8: the llamacpp backend's
# batch-invariant flash attention.
KERNELS_VERSION = 8


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "llamacpp", "gguf", or "auto": the fast backend where it supports the model, else transformers
    seconds_per_token: dict[str, float]  # the measured single-token pass of each candidate
    reason: str


def llamacpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_build() -> str:
    """Which llama.cpp is installed, without loading it: llama-cpp-python's version and the name, size and
    time of each of its libraries (a rebuild with other flags or the batch-invariance patch changes them,
    and with them llama.cpp's speed); empty where it is not installed."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return ""
    libraries = [(p.name, p.stat()) for p in sorted((Path(spec.origin).parent / "lib").glob("*.so*")) if p.is_file()]
    stats = [(name, stat.st_size, stat.st_mtime_ns) for name, stat in libraries]
    return f"{importlib.metadata.version('llama_cpp_python')} {stats}"


PREFERENCE = ("gguf", "auto", "llamacpp")  # ties go to the project's kernels, whose batched passes cost least
LABELS = {"gguf": "fast backend on the GGUF blocks", "auto": "float32 fast backend", "llamacpp": "llamacpp"}


def choose(seconds: dict[str, float]) -> BackendChoice:
    """The candidate with the cheapest single-token pass (ties in PREFERENCE order)."""
    best = min(seconds, key=lambda name: (seconds[name], PREFERENCE.index(name)))
    times = ", ".join(f"{LABELS[name]} {1000 * t:.1f} ms" for name, t in sorted(seconds.items(), key=lambda x: x[1]))
    return BackendChoice(best, seconds, f"auto: the cheapest single-token pass on this machine: {times}")


def choice_path(gguf: Path, threads: int | None) -> Path:
    """Where the choice for this file (its name and content, `file_fingerprint`), CPU, thread count (the cores
    this process may use where none is given), kernel build (`kernels.build_key`) and candidates (which
    llama.cpp build, if any) is kept."""
    from specsample.models.kernels import machine_digest
    from specsample.models.loading import conversion_dir

    directory = conversion_dir(gguf)  # reads the file's sampled bytes: once
    key = machine_digest(directory.name, threads or default_threads(), CANDIDATES, KERNELS_VERSION, llamacpp_build())
    return directory.parent / "backend-choice" / f"{key}.json"


def backend_for(gguf: Path, threads: int | None, measure) -> BackendChoice:
    """The remembered choice for `gguf`, else (none, or one that cannot be read) `measure()`'s (seconds per
    token by candidate), remembered."""
    from specsample.models.loading import remember

    return remember(choice_path(gguf, threads), lambda text: BackendChoice(**json.loads(text)),
                    lambda: choose(measure()), lambda made: json.dumps(asdict(made)))


def gguf_file(path: str | Path | None) -> Path | None:
    """The GGUF file `path` names (None: the bundled one), or None for a model directory."""
    from specsample.models.loading import bundled_gguf

    file = bundled_gguf() if path is None else Path(path).expanduser()
    return file if file.is_file() and file.suffix == ".gguf" else None


def resolve(path: str | Path | None, backend: str, *, threads: int | None = None,
            trust_remote_code: bool = False) -> tuple[str, str]:
    """The backend to load `path` on, and why: `backend` itself unless it is "auto"; for a GGUF file, the
    measured fastest of llamacpp (if installed), the file's blocks ("gguf") and the float32 path ("auto").
    A backend of no such name is a ValueError, before anything slow."""
    from specsample.models import check_backend, check_threads
    from specsample.models.loading import check_model_path

    check_model_path(path)
    check_backend(backend)
    check_threads(threads)
    if backend != "auto":
        return backend, "given"
    gguf = gguf_file(path)
    if gguf is None:
        return directory_backend(Path(path).expanduser(), trust_remote_code)
    made = backend_for(gguf, threads, lambda: measure(path, gguf, threads, trust_remote_code))
    return made.backend, made.reason


def directory_backend(directory: Path, trust_remote_code: bool) -> tuple[str, str]:
    """For a model directory (not measured: its weights load in float32 either way), the fast backend
    where it reproduces the architecture exactly (`llama.supports`), else transformers, and why. A
    path that does not exist stays "auto": loading it says so."""
    from transformers import AutoConfig

    from specsample.models import llama
    from specsample.models.loading import checked_hf_dir

    if not directory.exists():
        return "auto", "auto: no such path"
    config = AutoConfig.from_pretrained(checked_hf_dir(directory), trust_remote_code=trust_remote_code)
    reason = llama.unsupported_reason(config)
    if reason is None:
        return "fast", f"auto: the fast backend runs model type {config.model_type!r} (a model directory, float32)"
    return "transformers", f"auto: the fast backend does not ({reason}; a model directory, float32)"


def measure(path: str | Path | None, gguf: Path, threads: int | None, trust_remote_code: bool) -> dict[str, float]:
    """Seconds per single-token pass of `gguf` on llama.cpp (where installed), on its blocks and on the
    float32 path (where each runs the model: `project_targets`)."""
    targets: dict[str, Target] = {}
    if llamacpp_installed():
        from specsample.models.llamacpp import LlamaCppTarget

        targets["llamacpp"] = LlamaCppTarget(gguf, n_threads=threads)
    try:
        targets.update(project_targets(path, gguf, trust_remote_code))
        if not targets:
            raise ValueError(f"no backend here runs {gguf.name}: llama-cpp-python is not installed, and neither "
                             "transformers' converter nor the GGUF blocks take the file")
        return seconds_per_token(targets)
    finally:
        if "llamacpp" in targets:
            targets["llamacpp"].close()


def project_targets(path: str | Path | None, gguf: Path, trust_remote_code: bool) -> dict[str, Target]:
    """The file on the float32 path ("auto") and on its blocks ("gguf"), each where it runs the model
    (`UnsupportedModel` otherwise). transformers' GGUF converter does not take every file llama.cpp
    does (an architecture it lacks; a Qwen3 whose head size is not its default): then the file's
    tokenizer alone is loaded, so `make_target` builds the blocks from the file as `--backend gguf`
    does, and the float32 path is no candidate."""
    from specsample.models import load_model, make_target
    from specsample.models.llama import UnsupportedModel

    targets: dict[str, Target] = {}
    try:
        loaded = load_model(path, trust_remote_code=trust_remote_code)
    except (ValueError, RuntimeError):  # the converter's refusal, or its weights not fitting its config
        loaded = load_model(path, tokenizer_only=True)
    for name in ("auto", "gguf") if loaded.model is not None else ("gguf",):
        try:
            targets[name] = make_target(loaded, name)
        except UnsupportedModel:
            pass
    return targets


def seconds_per_token(targets: dict[str, Target], context: int = CONTEXT, passes: int = PASSES) -> dict[str, float]:
    """The median time of scoring one token after `context` cached ones, by target, one target after
    another; the targets' caches are empty afterwards."""
    curves = measure_synthetic(targets, context, ns=(1,), repeats=passes, warmup=2)
    return {curve.backend: curve.ms[0] / 1000 for curve in curves}
