"""The llamacpp Target backend: any GGUF model at its own quantization, run by llama.cpp.

The other backends dequantize a GGUF file to float32 and run Llama-family models only;
this one hands the file to llama.cpp (through llama-cpp-python's low-level C API, not its
`Llama` class, whose per-call overhead costs more than a small model's forward pass), so
a 4-bit model streams a quarter byte per weight, and any architecture llama.cpp knows runs.

One llama.cpp context, one sequence (id 0, `CachedSequence`): `score` puts n tokens in
`llama_decode` batches of at most N_BATCH with logits requested for each, `rollback` removes
positions [length, inf) from the KV cache (`llama_memory_seq_rm`), `prefill` empties it and
decodes the prompt in blocks without logits.

Batch invariance: llama.cpp computes a token scored alone with other kernels than the
same token inside a batch (llamafile's tinyBLAS from 2 rows on, the repacked Q4_0/Q4_K/...
layouts' gemm instead of gemv, the tiled K-quant products from 8 rows, flash attention's split
of a single token's pass over the cache), so its logits would differ in the last bits and greedy
speculation could leave plain decoding's path at a near-tie. `scripts/install.sh` builds
llama.cpp without llamafile and with `scripts/llama-cpp-batch-invariant.patch`, under which
flash attention splits every small batch's rows over the cache as it splits a single token's,
and the tiled K-quant products start at 64 rows. This backend enables the extra weight buffer
types (repacking) only for files whose repacked layouts are batch invariant, never on an AMX
machine (whose buffer type dies with an illegal instruction in batched passes here:
`repack_is_batch_invariant`), and turns flash attention on only where the build has that patch
(`batch_invariant_build`; another build also gets its tiled products turned off). Then a
position's logits are bitwise the same scored alone or in a batch of any size below 64, and every
`score` runs in passes of at most N_BATCH = 63 rows, so whatever K and however many slots
(tests/test_llamacpp.py checks it; docs/llamacpp-backend.md has the figures and what it costs).

A prompt is filled faster in larger passes, which take the tiled kernels: it is decoded in the
blocks [PREFILL_ROWS i, PREFILL_ROWS (i + 1)) of positions, one pass each, so that its keys and values
are the same whoever fills it and in how many calls: `prefill` and `extend` decode the blocks they
complete and keep the last one's tail pending until the prompt is whole (`CachedSequence`). Plain and
speculative decoding then read the same cache, and a slot's prompt filled chunk by chunk (a batch's
chunked prefill, a server's prefill in parts) is the target's, each chunk costing its own rows.

Slots (`LlamaCppTarget.slots`, for batched decoding) are llama.cpp's sequence ids in a context of
their own whose KV cache keeps a stream per sequence (`kv_unified` off): a row attends over its
own sequence's stream only, laid out as if it were alone, so its logits are bitwise those of the
same tokens scored by the target (tests/test_llamacpp_slots.py). llama.cpp puts a run of
consecutive sequence ids with equal numbers of new tokens in one pass and splits other batches
into several (`split_equal`), so `score` orders segments by slot, and `batch.Batch` fills the
lowest free slot first.

The build dispatches on the CPU at run time: ggml's CPU backend is built once per x86
feature level (GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS) into the package's lib
directory, and `init_backend` loads the best one this CPU runs, or the one named by
SPECSAMPLE_LLAMACPP_VARIANT (`haswell` is the AVX2 one): so an AVX-512 machine can run, test
and measure the code an AVX2-only machine would, as SPECSAMPLE_KERNEL_ISA does for the
project's own kernels.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import struct
import tempfile
from collections import deque
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specsample.openmp import default_threads

DEFAULT_MAX_LENGTH = 8192
CACHE_TYPES = {"f16": 1, "f32": 0}  # KV cache element types: ggml_type ids
# Rows of a `score` pass at most. From 64 rows llama.cpp's flash attention and its K-quant products tile a
# ubatch with other kernels, and a row's logits then depend on the pass (a 64-row pass against its rows one
# at a time: max |difference| 0.96 on the bundled Q4_1 file, 1.2 on its Q4_K_M copy, argmax changed; 63
# rows: 0), so greedy verification with K >= 63, or a batch of slots of 64 rows in all, left plain
# decoding's tokens. Below 64 every pass is batch invariant, whatever K and the batch.
N_BATCH = 63
# Positions of a prompt block, one pass each (`CachedSequence`). Prompts filled in 63-row passes took 1.10x, 1.23x
# and 1.43x as long over 300, 700 and 2,000 positions as in 256-row blocks, and 512-row blocks gained
# 1-3% more (bundled Q4_1, 2 threads, Intel Xeon, 2026-12-07: `benchmarks/llamacpp_prefill_ubatch.py`).
# Without flash attention a block's attention scores are [cached positions, block, heads] float32, twice.
# Peak resident memory: docs/llamacpp-backend.md "Memory"; tests/test_llamacpp_memory.py holds a short
# prompt to issue 22's budget of 1.3 x the file + the KV cache.
PREFILL_ROWS = 256
# Most new tokens a slot scores in one pass (`LlamaCppSlots.score`; a verification pass of K + 1 <= 17); at
# most N_BATCH, as `passes` puts a slot's rows in one `llama_decode`.
SLOT_ROWS = 32

_errors: deque[tuple[int, str]] = deque(maxlen=32)  # llama.cpp's latest (level, message), for one-line errors
LOG_WARN, LOG_ERROR = 3, 4  # ggml_log_level
_log_callback = None  # the ctypes callback must outlive every call into llama.cpp
_ready = False
_patched = False  # whether the CPU backend loaded has the batch-invariance patch (`batch_invariant_build`)
VARIANT_VARIABLE = "SPECSAMPLE_LLAMACPP_VARIANT"  # a ggml CPU variant to load instead of the best (`load_cpu_backend`)
VARIANT_PREFIX = "libggml-cpu-"  # of each CPU variant's library (`variant_library`)


LLAMACPP_MISSING = ("the llamacpp backend needs llama-cpp-python, built with the project's flags: bash scripts/install.sh "
                    "in a source checkout, or the steps under \"Build\" in docs/llamacpp-backend.md")


def _bindings():
    """The llama_cpp module; a one-line error when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError(LLAMACPP_MISSING) from e
    return llama_cpp


def init_backend() -> None:
    """Once per process: route llama.cpp's log into `_errors` (warnings and errors only, never
    printed), load ggml's CPU backend variant best for this CPU from the package's lib
    directory, and initialize llama.cpp.

    llama.cpp would look for the variants next to the Python executable and in the working
    directory only, so they are loaded from where the build installed them.
    """
    global _ready, _log_callback, _patched
    if _ready:
        return
    llama_cpp = _bindings()

    def log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level in (LOG_WARN, LOG_ERROR):
            _errors.append((level, text.decode("utf-8", "replace").strip()))

    _log_callback = llama_cpp.llama_log_callback(log)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    libggml = ggml_library()
    if not reg_names(libggml):
        load_cpu_backend(libggml, Path(llama_cpp.__file__).parent / "lib", requested_variant())
    if "CPU" not in reg_names(libggml):
        raise RuntimeError("llama.cpp found no CPU backend for this CPU in its lib directory (a bad build?)")
    _patched = has_marker(libggml)
    if not _patched:  # another build: its tiled K-quant products (read at first use) are off
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    llama_cpp.llama_backend_init()
    _ready = True


def variant_library(variant: str) -> str:
    """The file name of ggml's CPU variant `variant` (libggml-cpu-haswell.so for haswell)."""
    return f"{VARIANT_PREFIX}{variant}.so"


def requested_variant() -> str | None:
    """The ggml CPU variant SPECSAMPLE_LLAMACPP_VARIANT names, or None: the best this CPU runs."""
    return os.environ.get(VARIANT_VARIABLE) or None


def load_cpu_backend(libggml: ctypes.CDLL, lib: Path, variant: str | None) -> None:
    """Register ggml's CPU backend from `lib`: the variant best for this CPU, or the one named
    `variant` (the X of libggml-cpu-X.so), which must exist and run on this CPU."""
    if not variant:
        libggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        libggml.ggml_backend_load_all_from_path(str(lib).encode())
        return
    path = lib / variant_library(variant)
    if not path.is_file():
        known = sorted(p.name[len(VARIANT_PREFIX) : -len(".so")] for p in lib.glob(variant_library("*")))
        raise ValueError(f"{VARIANT_VARIABLE}={variant!r}: this build has no such CPU variant (it has {', '.join(known)})")
    libggml.ggml_backend_load.restype = ctypes.c_void_p
    libggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    if not libggml.ggml_backend_load(str(path).encode()):  # ggml refuses a variant whose score here is 0
        raise ValueError(f"{VARIANT_VARIABLE}={variant!r}: this CPU lacks instructions that variant needs")


def ggml_library() -> ctypes.CDLL:
    """The ggml library that libllama links (its soname, libggml.so.0, next to it).

    Not llama_cpp._ggml's `libggml.so`: a wheel holds no symlinks, so that is another copy of
    the file, loaded as a second library with a backend registry of its own that llama.cpp
    never reads.
    """
    return ctypes.CDLL(str(Path(_bindings().__file__).parent / "lib" / "libggml.so.0"))


def batch_invariant_build() -> bool:
    """Whether the CPU backend loaded has the project's patch (scripts/llama-cpp-batch-invariant.patch),
    under which flash attention, and a K-quant product from 8 rows, compute a token the same alone and
    inside a batch: the backend registry answers for the patch's marker by name."""
    init_backend()
    return _patched


def has_marker(libggml: ctypes.CDLL) -> bool:
    """Whether the registered CPU backend answers for the patch's marker (`batch_invariant_build`)."""
    reg = cpu_reg(libggml)
    return reg is not None and bool(proc_address(libggml, reg, b"specsample_batch_invariant_v2"))


def cpu_reg(libggml: ctypes.CDLL) -> int | None:
    """The registered CPU backend (an opaque pointer), or None before one is loaded."""
    return next((reg for reg, name in zip(regs(libggml), reg_names(libggml)) if name == "CPU"), None)


def proc_address(libggml: ctypes.CDLL, reg: int, name: bytes) -> int:
    """The address of a backend's function by name (ggml_backend_reg_get_proc_address); 0 if it has none."""
    libggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    libggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return libggml.ggml_backend_reg_get_proc_address(reg, name) or 0


def reg_names(libggml: ctypes.CDLL) -> list[str]:
    """Names of the ggml backends registered in this process ("CPU" once one is loaded)."""
    return [libggml.ggml_backend_reg_name(reg).decode() for reg in regs(libggml)]


def regs(libggml: ctypes.CDLL) -> list[int]:
    """The ggml backend registrations of this process (opaque pointers)."""
    libggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    libggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    libggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    libggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    libggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    return [libggml.ggml_backend_reg_get(i) for i in range(libggml.ggml_backend_reg_count())]


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


def cpu_features() -> dict[str, str]:
    """The features the loaded CPU backend variant was built for ({"AVX2": "1", "AVX512": "1", ...}):
    which of the build's variants ggml picked for this CPU."""
    init_backend()
    libggml = ggml_library()
    reg = cpu_reg(libggml)
    if reg is None:
        return {}
    get_features = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)
    features = get_features(proc_address(libggml, reg, b"ggml_backend_get_features"))(reg)
    out, i = {}, 0
    while features[i].name:
        out[features[i].name.decode()] = features[i].value.decode()
        i += 1
    return out


def system_info() -> str:
    """The loaded CPU backend's features on one line, e.g. "CPU: SSE3 AVX AVX2 FMA AVX512 ... OPENMP"."""
    return "CPU: " + " ".join(name if value == "1" else f"{name}={value}" for name, value in cpu_features().items())


def last_error() -> str:
    """llama.cpp's latest error message (its latest warning if it logged no error), or ""."""
    errors = [text for level, text in _errors if text and level == LOG_ERROR] or [text for _, text in _errors if text]
    return errors[-1] if errors else ""


def cause() -> str:
    """The first error llama.cpp logged since `_errors` was cleared, without the names of the C functions
    it passed through ("invalid magic characters: 'not ', expected 'GGUF'"): a failed load logs its
    cause first, then each caller's "failed to load model"."""
    errors = [text for level, text in _errors if text and level == LOG_ERROR]
    return re.sub(r"^(\w+: )+", "", errors[0]) if errors else last_error() or "unknown error"


# The `quantized` drafter's copy (`LlamaCppTarget.quantized_copy`): the file type llama.cpp's
# quantizer writes it at, by the source's file type (llama_ftype names without "MOSTLY_"), the
# cheapest type measured for each (docs/llamacpp-backend.md, one thread, Intel Xeon AVX-512):
# - float files get Q8_0: a pass of the 1B random model's Q8_0 file cost 0.48 of its F32 file's,
#   Q4_0's 0.46, and Q8_0 is the more faithful (ggml's Q8_0 dot product is as fast as Q4_0's);
# - files of 4 to 8 bits get Q3_K_S: 0.57 of the Q8_0 file's pass, where Q2_K cost 0.63 and
#   Q4_0 0.97. Tensors whose rows are not a multiple of 256 fall back to a wider type (llama.cpp's
#   choice), so a copy of the bundled SmolLM2 (rows of 576) is mostly Q4_0.
# Files below 4 bits have no cheaper copy.
COPY_TYPES = {
    **dict.fromkeys(("ALL_F32", "F16", "BF16"), "Q8_0"),
    **dict.fromkeys(("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
                     "IQ4_NL", "IQ4_XS", "MXFP4_MOE"), "Q3_K_S"),
}

# f(1) of the quantized copy over f(1) of the target (one thread, median CPU time of 50
# single-token passes over a 256-position cache, Intel Xeon AVX-512), as measured for a source of
# this file type (docs/llamacpp-backend.md, "The quantized drafter"): what `copy_cost` declares.
# Q4_1: the bundled SmolLM2-135M; the others: the 1B random model of benchmarks/make_random_llama_gguf.py.
MEASURED_COPY_COST: dict[str, float] = {"Q4_1": 0.90, "Q4_0": 0.55, "Q8_0": 0.57, "ALL_F32": 0.48}


def ftype_id(name: str) -> int:
    """llama.cpp's llama_ftype value of a file type name ("Q4_0", "ALL_F32", ...)."""
    lib = _bindings()
    full = f"LLAMA_FTYPE_{name}" if hasattr(lib, f"LLAMA_FTYPE_{name}") else f"LLAMA_FTYPE_MOSTLY_{name}"
    return getattr(lib, full)


def ftype_name(ftype: int) -> str:
    """The name of a llama_ftype value, as in COPY_TYPES ("Q4_1"), or "type N" if unnamed."""
    lib = _bindings()
    for attr in dir(lib):
        if attr.startswith("LLAMA_FTYPE_") and attr != "LLAMA_FTYPE_GUESSED" and getattr(lib, attr) == ftype:
            return attr.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_")
    return f"type {ftype}"


def copy_type(source: str) -> str:
    """The file type of the quantized copy of a file of type `source` (COPY_TYPES), or a one-line error."""
    if source not in COPY_TYPES:
        raise ValueError(
            f"the quantized drafter needs a cheaper copy of the target, and llama.cpp has no type below {source} "
            "to quantize it to (try another drafter)"
        )
    return COPY_TYPES[source]


def copy_path(source: Path, type_name: str) -> Path:
    """Where the `type_name` copy of the GGUF file `source` is cached: beside its float32
    conversion (models/loading.py), named by the source's content alone (`loading.conversion_dir`)
    and by llama-cpp-python's version, since another quantizer may write another copy."""
    import importlib.metadata

    from specsample.models.loading import conversion_dir

    directory = conversion_dir(source)
    version = importlib.metadata.version("llama_cpp_python")
    return directory.with_name(f"{directory.name}-{type_name}-llamacpp{version}.gguf")


def quantize(source: Path, out: Path, type_name: str, threads: int) -> Path:
    """`source` quantized to `type_name` by llama.cpp's own quantizer into `out`, written to a
    temporary file renamed into place (concurrent processes never see half of it)."""
    lib = _bindings()
    init_backend()
    params = lib.llama_model_quantize_default_params()
    params.ftype = ftype_id(type_name)
    params.allow_requantize = True  # the source may be quantized already
    params.nthread = threads
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    try:
        _errors.clear()
        if lib.llama_model_quantize(str(source).encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise ValueError(f"llama.cpp cannot quantize {source} to {type_name}: {cause()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# GGUF tensor types that ggml's x86 CPU backend either leaves in place or repacks into a layout whose
# product gives a row the same output alone and in a batch: Q4_0's 8x8 gemm and gemv (max |logit
# difference| 0 at batches 2..16 on the bundled model's Q4_0 copy and the 1B Q4_0 file, on the
# AVX-512 and AVX2 variants). Q4_K, Q2_K, IQ4_NL and MXFP4 are repacked into gemms that are not
# (Q4_K_M copy: 0.4 to 0.9 from 4 or 8 rows), so a file holding any of them runs unrepacked.
REPACK_INVARIANT_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q5_K", "Q6_K"})


# The types among them that x86 does repack (Q4_0 into its 8x8 layout; Q8_0 and the others stay as they are).
REPACKED_TYPES = frozenset({"Q4_0"})


def repack_is_batch_invariant(path: Path) -> bool:
    """Whether llama.cpp may repack `path`'s weights (its extra buffer types) and keep a position's
    logits independent of the batch: on x86 without AMX (whose buffer type crashed in batched passes
    on this project's AMX machine), for a file of REPACK_INVARIANT_TYPES only. Repacked Q4_0 decodes
    1.4-1.7x as fast on the 1B Q4_0 file (docs/llamacpp-backend.md)."""
    types = tensor_types(path)
    return repacking_x86() and bool(types) and types <= REPACK_INVARIANT_TYPES


def reads_instead_of_mapping(path: Path) -> bool:
    """Whether llama.cpp should read `path` into memory rather than map it: where it repacks weights,
    which it copies out of the file, a mapped file's pages stayed resident beside the copy (the 1B Q4_0
    file: 1.81x the file's size in all, against 1.06x read; docs/llamacpp-backend.md "Memory"). Files
    it does not repack stay mapped, their pages shared with the page cache and other processes."""
    return repack_is_batch_invariant(path) and bool(tensor_types(path) & REPACKED_TYPES)


@cache
def repacking_x86() -> bool:
    """An x86 CPU whose repacked layouts this backend may use: not one with AMX (see `repack_is_batch_invariant`)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    return platform.machine().lower() in ("x86_64", "amd64") and "amx_tile" not in flags


def tensor_types(path: Path) -> frozenset[str]:
    """The GGML types of `path`'s tensors; none for a file the project cannot read (llama.cpp says why).
    Its header is read once per file version (a load asks for them twice: `reads_instead_of_mapping`)."""
    try:
        stat = Path(path).stat()
    except OSError:
        return frozenset()
    return _tensor_types(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@cache
def _tensor_types(path: str, size: int, mtime_ns: int) -> frozenset[str]:
    from specsample.models.gguf_blocks import TensorIndex

    try:
        return frozenset(kind.name for _dims, kind, _offset in TensorIndex(path).tensors.values())
    except (ValueError, struct.error, OSError):
        return frozenset()


class LlamaCppTarget:
    """A GGUF model in a llama.cpp context: the Target protocol on the low-level C API.

    `n_threads`: threads for every pass (default: all cores). `max_length`: the context
    window (default: the model's, at most 8192). `batch_invariant`: flash attention only
    where this build's is batch invariant, so logits do not depend on how positions are batched
    (see the module docstring); False lets llama.cpp choose. `cache_type`: the KV cache's
    element type, "f16" (llama.cpp's default: half the memory) or "f32" (keys and values as
    computed: an F32 file's logits then match transformers' to float32 rounding).

    Capabilities (models/target.py): `QuantizedCopies`, a lower-bit copy of the same file made
    by llama.cpp's quantizer, with `copy_cost` declaring what its pass costs (specsample.defaults).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        n_threads: int | None = None,
        max_length: int | None = None,
        batch_invariant: bool = True,
        cache_type: str = "f16",
    ) -> None:
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"unknown KV cache type {cache_type!r}: expected one of {', '.join(CACHE_TYPES)}")
        init_backend()
        self.lib = lib = _bindings()
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"the llamacpp backend runs GGUF files, and {path} is a directory")
        if not self.path.is_file():
            raise FileNotFoundError(f"model file does not exist: {path}")
        from specsample.models import check_threads

        check_threads(n_threads, "n_threads")
        self.n_threads = n_threads or default_threads()
        self.batch_invariant = batch_invariant
        self.cache_type = cache_type

        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = repack_is_batch_invariant(self.path)
        if reads_instead_of_mapping(self.path):
            model_params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        _errors.clear()
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {path}: {cause()}")
        self.ctx = None
        self.batch = None
        # a recurrent or hybrid model's memory (Mamba, RWKV, Jamba) keeps a state, not positions: it cannot
        # take back rejected draft tokens (`target.rolls_back`)
        self.rolls_back = not (lib.llama_model_is_recurrent(self.model) or lib.llama_model_is_hybrid(self.model))
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.max_length = int(max_length or min(lib.llama_model_n_ctx_train(self.model) or DEFAULT_MAX_LENGTH, DEFAULT_MAX_LENGTH))

        self.ctx = self.context(self.max_length, sequences=1)
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = DecodeBatch(lib, PREFILL_ROWS)
        self.sequence = CachedSequence(lib, self.ctx, self.memory, self.batch, 0, "this model's cache")

    def context(self, positions: int, sequences: int) -> ctypes.c_void_p:
        """A llama.cpp context over this target's model with its settings (threads, KV cache type,
        batch invariance): `positions` KV cache cells in all, `sequences` sequence ids, each in a
        stream of its own where more than one, a `llama_decode` of at most PREFILL_ROWS tokens run
        as one ubatch (a prompt block; the callers keep every `score` pass below 64 rows)."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = positions
        params.n_batch = params.n_ubatch = PREFILL_ROWS
        params.n_seq_max = sequences
        params.kv_unified = False  # a stream per sequence: a row attends over its own sequence alone
        params.n_threads = params.n_threads_batch = self.n_threads
        params.no_perf = True
        params.type_k = params.type_v = CACHE_TYPES[self.cache_type]
        if self.batch_invariant:
            # flash attention where the build's is batch invariant, over an F16 cache: llama.cpp casts
            # an F32 cache's keys and values to F16 for it, which an F32 cache is chosen to avoid
            flash = self.cache_type == "f16" and batch_invariant_build()
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        _errors.clear()
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise ValueError(f"llama.cpp cannot make a context for {self.path}: {cause()}")
        return ctx

    @property
    def length(self) -> int:
        return self.sequence.length

    def prefill(self, token_ids: Tensor) -> None:
        """Fill the cache with a whole prompt, its last block's tail too (timed as prefill, not as the first step)."""
        self.rollback(0)
        self.extend(token_ids)
        self.sequence.flush()

    def extend(self, token_ids: Tensor) -> None:
        ids = token_array(token_ids)
        self._check_room(ids.shape[0])
        self.sequence.extend(ids)

    def score(self, token_ids: Tensor) -> Tensor:
        """Logits [n, vocab] float32 of `token_ids` [n] appended to the cache, N_BATCH a pass."""
        ids = token_array(token_ids)
        self._check_room(ids.shape[0])
        self.sequence.flush()
        out = self.batch.chunks(self.ctx, self.memory, 0, ids, self.length, self.vocab_size)
        self.sequence.scored(ids.shape[0])
        return out

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")
        self.sequence.rollback(length)

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_length:
            raise ValueError(f"{self.length} + {n} positions exceed the context window of {self.max_length}")

    @property
    def file_type(self) -> str:
        """The model file's type as llama.cpp reads it ("Q4_1", "Q8_0", "ALL_F32", ...)."""
        return ftype_name(self.lib.llama_model_ftype(self.model) & ~self.lib.LLAMA_FTYPE_GUESSED)

    @property
    def instruction_set(self) -> str:
        """The widest vector set of the ggml CPU variant llama.cpp loaded for this CPU, which runs
        this target and its quantized copy ("avx512", "avx2", "portable"; `QuantizedCopies`)."""
        features = cpu_features()
        return "avx512" if features.get("AVX512") == "1" else "avx2" if features.get("AVX2") == "1" else "portable"

    @property
    def copy_cost(self) -> float | None:
        """f(1) of the quantized copy over this target's, as measured for a file of this type
        (MEASURED_COPY_COST), or None where not measured: what specsample.defaults reads to decide
        whether the copy is cheap enough to draft by default."""
        return MEASURED_COPY_COST.get(self.file_type)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache of the context window: keys and values of every layer and position,
        as a model of plain attention keeps them (llama.cpp allocates and clears them at the start)."""
        lib, model = self.lib, self.model
        heads = lib.llama_model_n_head(model)
        key, value = (self._metadata_int(f"attention.{name}_length") or lib.llama_model_n_embd(model) // heads
                      for name in ("key", "value"))
        element = 4 if self.cache_type == "f32" else 2
        return self.max_length * lib.llama_model_n_layer(model) * lib.llama_model_n_head_kv(model) * (key + value) * element

    def _metadata_int(self, key: str) -> int | None:
        """An integer of the file's architecture keys ("attention.key_length" -> llama.attention.key_length), or None."""
        buffer = ctypes.create_string_buffer(256)
        size = self.lib.llama_model_meta_val_str(self.model, b"general.architecture", buffer, len(buffer))
        if size < 0:
            return None
        size = self.lib.llama_model_meta_val_str(self.model, f"{buffer.value.decode()}.{key}".encode(), buffer, len(buffer))
        return int(buffer.value) if size > 0 else None

    def slots(self, count: int) -> LlamaCppSlots:
        """`count` empty slots of this target's context window over its model (`target.SlottedTarget`)."""
        return LlamaCppSlots(self, count)

    def quantized_copy(self) -> LlamaCppTarget:
        """A lower-bit copy of this target's file (type by COPY_TYPES), made once by llama.cpp's
        quantizer and cached (`copy_path`), in a context of its own with this target's settings."""
        type_name = copy_type(self.file_type)
        path = copy_path(self.path, type_name)
        if not path.is_file():
            quantize(self.path, path, type_name, self.n_threads)
        return LlamaCppTarget(
            path, n_threads=self.n_threads, max_length=self.max_length,
            batch_invariant=self.batch_invariant, cache_type=self.cache_type,
        )

    def close(self) -> None:
        """Free the batch, the context and the model (also done when garbage collected)."""
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "batch", None) is not None:
            self.batch.free()
            self.batch = None
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        self.close()


def token_array(token_ids: Tensor | Sequence[int]) -> np.ndarray:
    """Token ids [n] as the int32 array llama.cpp's batch takes."""
    if isinstance(token_ids, Tensor):
        return token_ids.reshape(-1).numpy().astype(np.int32, copy=False)
    return np.asarray(token_ids, np.int32).reshape(-1)


class CachedSequence:
    """One sequence of a llama.cpp context: the positions it holds (`length`), of which llama.cpp's cache
    has the first `decoded`, and its prompt (the tokens of the positions from 0 that `prefill` and
    `extend` filled before the first scored one).

    A prompt is decoded in the blocks [PREFILL_ROWS i, PREFILL_ROWS (i + 1)) of positions, one pass each,
    on llama.cpp's tiled kernels where a block has 64 rows or more, so that its keys and values are the
    same whoever fills it and in how many calls: `extend` decodes the blocks it completes and keeps the
    rest of the last one pending (held, counted in `length`, not yet decoded), and `flush` (the prefill
    of a whole prompt, or the first `score`) decodes that tail as one pass, as one prefill of the whole
    prompt does; a rollback into a prompt block takes the block back to its start, to be decoded again
    with its pending tail. So a chunk of any size costs its own rows, never a block again, and needs no
    rollback (which a recurrent model's cache refuses). After a scored position `extend` decodes at
    once, in the same blocks.
    """

    def __init__(self, lib, ctx, memory, batch: DecodeBatch, seq: int, name: str) -> None:
        self.lib, self.ctx, self.memory, self.batch, self.seq = lib, ctx, memory, batch, seq
        self.name = name  # "this model's cache", "slot 3's cache": for errors
        self.length = 0
        self.decoded = 0  # positions in llama.cpp's cache: `length` but the prompt's pending tail
        self.prompt = np.empty(0, np.int32)  # [prompt length]

    def extend(self, ids: np.ndarray) -> None:
        """Append `ids` [n], no logits: a prompt's complete blocks (its tail pending), or after scored positions all."""
        if self.prompt.shape[0] != self.length:  # positions were scored: nothing pending
            self.batch.blocks(self.ctx, self.memory, self.seq, ids, self.length)  # a failure leaves the cache at `length`
            self.length = self.decoded = self.length + ids.shape[0]
            return
        if self.decoded % PREFILL_ROWS:  # the prompt's tail was decoded alone (a score, then a rollback to it)
            self._remove(self.decoded - self.decoded % PREFILL_ROWS)
        before = self.length
        self.prompt = np.concatenate([self.prompt, ids])
        self.length += ids.shape[0]
        try:
            self._decode_prompt(self.length - self.length % PREFILL_ROWS)
        except RuntimeError:
            self.length, self.prompt = before, self.prompt[:before]
            raise

    def flush(self) -> None:
        """Decode the prompt's pending tail as one pass, before anything reads the cache."""
        self._decode_prompt(self.length)

    def scored(self, n: int) -> None:
        """`n` positions were scored and are in the cache."""
        self.length = self.decoded = self.length + n

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions (at most `self.length`)."""
        if length < self.decoded:
            into_prompt = length < self.prompt.shape[0] and length % PREFILL_ROWS
            self._remove(length - length % PREFILL_ROWS if into_prompt else length)
        self.length = length
        self.prompt = self.prompt[:length]

    def _decode_prompt(self, end: int) -> None:
        """Decode the prompt's positions [decoded, end) in blocks; on a failure they stay pending."""
        if end > self.decoded:
            self.batch.blocks(self.ctx, self.memory, self.seq, self.prompt[self.decoded : end], self.decoded)
            self.decoded = end

    def _remove(self, start: int) -> None:
        """Remove positions [start, decoded) from llama.cpp's cache."""
        if not self.lib.llama_memory_seq_rm(self.memory, self.seq, start, -1):
            raise RuntimeError(f"llama.cpp cannot roll {self.name} back to {start} positions")
        self.decoded = start


class DecodeBatch:
    """A llama_batch of up to `capacity` tokens, one sequence id each, refilled for every `llama_decode`:
    tokens, positions and logit flags written through numpy views of its arrays."""

    def __init__(self, lib, capacity: int) -> None:
        self.lib, self.capacity, self.n = lib, capacity, 0
        self.batch = lib.llama_batch_init(capacity, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(capacity,))  # [capacity] int32
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(capacity,))  # [capacity] int32
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(capacity,))  # [capacity] int8
        self._seqs = [0] * capacity  # each token's sequence id, as written into the batch
        self._view: tuple[tuple, Tensor] | None = None  # ((address, rows, vocab), the logits' view)
        for i in range(capacity):
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0

    def put(self, seq: int, token_ids: np.ndarray, start: int, logits: bool) -> None:
        """Append `token_ids` [m] of sequence `seq` at positions start.. (the first put after a run starts
        the batch afresh)."""
        m, at = token_ids.shape[0], self.n
        if at + m > self.capacity:
            raise ValueError(f"{at + m} tokens exceed a pass of {self.capacity}")
        self.tokens[at : at + m] = token_ids
        self.positions[at : at + m] = np.arange(start, start + m, dtype=np.int32)
        self.wants_logits[at : at + m] = logits
        for i in range(at, at + m):
            if self._seqs[i] != seq:
                self.batch.seq_id[i][0] = self._seqs[i] = seq
        self.n = at + m

    def run(self, ctx, memory, starts: dict[int, int], vocab_size: int | None = None) -> Tensor | None:
        """`llama_decode` of the tokens put since the last run; their logits [n, vocab] float32 when
        `vocab_size` is given: llama.cpp's buffer, which the next decode overwrites (copy what is kept). On failure every sequence in
        `starts` (sequence id: its length before the batch) is rolled back, and a RuntimeError says why."""
        n, self.n = self.n, 0
        self.batch.n_tokens = n
        status = self.lib.llama_decode(ctx, self.batch)
        if status != 0:
            for seq, start in starts.items():  # on a fatal error some ubatches may stay in the cache
                self.lib.llama_memory_seq_rm(memory, seq, start, -1)
            raise RuntimeError(f"llama_decode failed with status {status}: {last_error()}")
        if vocab_size is None:
            return None
        return self._logits(self.lib.llama_get_logits(ctx), n, vocab_size)

    def _logits(self, pointer, n: int, vocab_size: int) -> Tensor:
        """A tensor over llama.cpp's logits buffer [n, vocab], no copy. The view is kept for the next
        pass with the same buffer and rows: making one costs about 40 us, 1% of a small model's step."""
        key = (ctypes.cast(pointer, ctypes.c_void_p).value, n, vocab_size)
        if self._view is None or self._view[0] != key:
            self._view = (key, torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(n, vocab_size))))
        return self._view[1]

    def chunks(self, ctx, memory, seq: int, token_ids: np.ndarray, start: int, vocab_size: int) -> Tensor:
        """Append `token_ids` [n] to sequence `seq` (holding `start` positions), N_BATCH a `llama_decode`;
        their logits [n, vocab] float32 (a copy)."""
        n = token_ids.shape[0]
        out = torch.empty(n, vocab_size, dtype=torch.float32)  # [n, vocab]
        for at in range(0, n, N_BATCH):
            chunk = token_ids[at : at + N_BATCH]  # [m]
            self.put(seq, chunk, start + at, logits=True)
            out[at : at + chunk.shape[0]] = self.run(ctx, memory, {seq: start}, vocab_size)  # a failure drops the earlier chunks too
        return out

    def blocks(self, ctx, memory, seq: int, token_ids: np.ndarray, start: int) -> None:
        """Append `token_ids` [n] to sequence `seq` (holding `start` positions) without logits, one
        `llama_decode` for the part of each prompt block [PREFILL_ROWS i, PREFILL_ROWS (i + 1)) they reach."""
        at, n = 0, token_ids.shape[0]
        while at < n:
            end = min(n, at + PREFILL_ROWS - (start + at) % PREFILL_ROWS)
            self.put(seq, token_ids[at:end], start + at, logits=False)
            self.run(ctx, memory, {seq: start})  # a failure drops the earlier blocks too
            at = end

    def free(self) -> None:
        self.lib.llama_batch_free(self.batch)


def passes(order: list[int], rows: list[int]) -> list[list[int]]:
    """`order` (segment indices) cut into runs of at most N_BATCH rows in all (`rows`: each segment's, at most
    SLOT_ROWS), one `llama_decode` each: every pass stays on the kernels whose rows do not depend on it."""
    groups: list[list[int]] = [[]]
    total = 0
    for j in order:
        if total + rows[j] > N_BATCH:
            groups.append([])
            total = 0
        groups[-1].append(j)
        total += rows[j]
    return groups


class LlamaCppSlots:
    """`count` KV caches over one LlamaCppTarget's model, one per request (`target.Slots`): sequence ids
    0..count-1 of a context of their own, each in a KV cache stream of its own (see the module docstring).

    A pass puts the new tokens of several slots in one `llama_decode`, ordered by slot, at most N_BATCH
    rows each (more go in several): llama.cpp scores a run of consecutive slots with the same number of
    new tokens in one pass over the weights, and splits other batches into several passes (what each
    costs, the batch's K policy measures). Each row is computed as the target computes it alone, so its logits are bitwise the
    target's `score` of the same tokens after the same prefill. The slots hold the target, whose
    model they run: close them before it.
    """

    def __init__(self, target: LlamaCppTarget, count: int) -> None:
        if count < 1:
            raise ValueError(f"need at least one slot, got {count}")
        self.target, self.count, self.lib = target, count, target.lib
        self.vocab_size, self.max_length = target.vocab_size, target.max_length
        self.max_rows = SLOT_ROWS  # rows a slot scores in one pass at most
        self.drafts_pass_alone = True  # llama.cpp's split_equal: a segment's rows past the first pass apart
        self.ctx = target.context(count * self.max_length, sequences=count)
        self.memory = self.lib.llama_get_memory(self.ctx)
        self.batch = DecodeBatch(self.lib, PREFILL_ROWS)
        self._sequences = [CachedSequence(self.lib, self.ctx, self.memory, self.batch, slot, f"slot {slot}'s cache")
                           for slot in range(count)]

    def length(self, slot: int) -> int:
        return self._sequences[slot].length

    def prefill(self, slot: int, token_ids: Tensor, budget: int | None = None) -> int:
        """Reset `slot`'s cache and fill it with `token_ids` [n] (at most `budget` of them), in prompt blocks."""
        self._check([slot])
        self.rollback(slot, 0)
        ids = token_ids.reshape(-1)
        self.extend(slot, ids[:budget])
        if budget is None or budget >= ids.shape[0]:  # the whole prompt: its tail too (chunks: at the first score)
            self._sequences[slot].flush()
        return self.length(slot)

    def extend(self, slot: int, token_ids: Tensor) -> None:
        """Append `token_ids` [n] to `slot`'s cache, in prompt blocks (`CachedSequence`: the target's own keys
        and values, however the prompt was cut into calls, each call decoding the blocks it completes); no logits."""
        self._check([slot])
        ids = token_array(token_ids)
        self._check_room(slot, ids.shape[0])
        self._sequences[slot].extend(ids)

    def score(self, segments: Sequence[tuple[int, Tensor]]) -> list[Tensor]:
        """Append each segment's tokens [n_s] to its slot, in `llama_decode`s of at most N_BATCH rows; logits
        [n_s, vocab] float32 each, in the order of `segments`."""
        slots = [slot for slot, _ in segments]
        self._check(slots)
        ids = [token_array(token_ids) for _, token_ids in segments]
        for slot, segment in zip(slots, ids):
            if segment.shape[0] > SLOT_ROWS:
                raise ValueError(f"slot {slot} scores {segment.shape[0]} tokens in one pass, more than {SLOT_ROWS}")
            self._check_room(slot, segment.shape[0])
        if not any(segment.shape[0] for segment in ids):
            return [torch.empty(0, self.vocab_size) for _ in segments]
        for slot in slots:
            self._sequences[slot].flush()
        order = sorted(range(len(segments)), key=slots.__getitem__)  # consecutive slots share a pass
        starts = {slot: self.length(slot) for slot in slots}  # a failed pass rolls every slot of the call back
        out: list[Tensor] = [torch.empty(0)] * len(segments)
        for group in passes(order, [segment.shape[0] for segment in ids]):
            for j in group:
                self.batch.put(slots[j], ids[j], starts[slots[j]], logits=True)
            logits = self.batch.run(self.ctx, self.memory, starts, self.vocab_size).clone()
            row = 0
            for j in group:
                out[j] = logits[row : row + ids[j].shape[0]]  # [n_j, vocab]
                row += ids[j].shape[0]
        for slot, segment in zip(slots, ids):
            self._sequences[slot].scored(segment.shape[0])
        return out

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.length(slot):
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.length(slot)}")
        self._sequences[slot].rollback(length)

    def _check(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots) or not all(0 <= slot < self.count for slot in slots):
            raise ValueError(f"slots {slots} are not distinct slots of 0..{self.count - 1}")

    def _check_room(self, slot: int, n: int) -> None:
        if self.length(slot) + n > self.max_length:
            raise ValueError(f"{self.length(slot) + n} positions exceed max_length {self.max_length}")

    def close(self) -> None:
        """Free the batch and the context (also done when garbage collected)."""
        if getattr(self, "batch", None) is not None:
            self.batch.free()
            self.batch = None
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        self.close()
