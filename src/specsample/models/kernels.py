"""Two CPU kernels for decoding a few tokens: a small-row matrix multiply and attention.

Decoding multiplies 1 to 16 activation rows by weight matrices far larger than
the caches, so its speed is the speed of streaming the weights from memory.
MKL's sgemm is tuned for large matrices: on a small CPU it reads the weights
at about half the memory bandwidth for one row and gets slower with every row
added, so scoring 8 tokens costs 2 to 3 times scoring one. `matmul` reads each
weight once, in the order it lies in memory, and keeps the results of several
rows in vector registers, so 12 rows cost little more than one. Weights are
packed in panels of 32 output columns, [blocks, in, 32]: one panel is a
contiguous stream, which the kernel prefetches ahead of its reads (with the
hardware prefetchers alone, 8 rows took 1.5 to 2.4 times as long).

The register blocking is chosen at compile time for the vector instruction set
(`instruction_set()`): with AVX-512 the 32 columns of a panel are two registers
and 12 rows are 24 of its 32 registers; with AVX2 (16 registers of 8 floats)
one or two rows take the whole panel, and more rows, 6 at a time, read it as
two halves of 16 columns, each half over 128 inputs before the other reads them
from L1; elsewhere ("portable"), 4-float vectors in the same shapes. 512-bit
vectors on AVX2 would be split into halves needing twice the registers it has,
and spill. Each output is one chain of multiply-adds in input order, so a row's
result is bitwise the same whatever the number of rows in the pass.

Weights are float32 (`pack`) or int8 with one float scale per output column
(`pack_int8`): the same code, a template over the weight type, converts int8
weights to float in registers, accumulates in float32 and scales the columns
at the end, so an int8 matrix streams a quarter of the bytes.

`layer` runs a whole decoder layer in one call: the four products, and what
takes about 40 small torch ops (norms, rotary embedding, cache writes,
grouped-query attention, SwiGLU), whose dispatch overhead, not arithmetic, is
what they cost at 1 to 16 tokens.

The C++ source, `kernels.cpp` beside this module, is compiled on first use with
the system compiler (`g++`/`c++`, -O3 -march=native, OpenMP: the libgomp torch
already loaded) into the user's cache, keyed by the source, the flags, the
compiler and its version, and the CPU, and loaded with ctypes. Without a
compiler, or with SPECSAMPLE_NO_KERNELS=1, `available()` is False and callers
use torch ops. SPECSAMPLE_KERNEL_ISA=avx2 builds for AVX2 on an AVX-512 CPU
(-mno-avx512f -mno-avxvnni), SPECSAMPLE_KERNEL_ISA=avxvnni for AVX2 with
AVX-VNNI where the CPU has it (-mno-avx512f), SPECSAMPLE_KERNEL_ISA=portable
without AVX (-mno-avx; all x86 only): how the other paths are tested and
measured on one machine; the default, `native`, is the best the CPU has. Sums
run in another order than MKL's, so results differ by float32 rounding.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from specsample.models import hugepages

BLOCK = 32  # output columns per panel (NB in kernels.cpp)
MAX_HEAD_DIM = 1024  # rotary embedding works on a stack copy of one head

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# Flags added for SPECSAMPLE_KERNEL_ISA: each disables the instruction sets above the one asked for.
# avxvnni: AVX2 with AVX-VNNI where the CPU has it (Intel since Alder Lake), the GGUF kernels' vpdpbusd on
# 256 bits; avx2 without it (AMD Zen 3 and older Intel).
ISA_FLAGS = {"native": [], "avxvnni": ["-mno-avx512f"], "avx2": ["-mno-avx512f", "-mno-avxvnni"], "portable": ["-mno-avx"]}
ISA_VARIABLE = "SPECSAMPLE_KERNEL_ISA"
EXTRA_SOURCES = ("kernels_gguf.cpp",)  # compiled into the same library as kernels.cpp


def _cache_dir() -> Path:
    from specsample.models.loading import cache_root

    return cache_root() / "kernels"


CPU_ID_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its features (x86's model name and flags, arm64's
    implementer, part and Features; the machine's architecture where neither is there), so that no two CPUs
    share a build."""
    fallback = platform.machine() + " " + platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fallback
    lines = [line for line in text.splitlines() if line.startswith(CPU_ID_FIELDS)]
    return "\n".join(sorted(set(lines))) or fallback


def _source(name: str = "kernels.cpp") -> str:
    """A C++ source file, shipped as package data."""
    return resources.files(__package__).joinpath(name).read_text()


def _sources(source: str, others: dict[str, str] | None = None) -> dict[str, str]:
    """The files of one library: `source` as kernels.cpp, and the GGUF block kernels (kernels_gguf.cpp)
    that its decoder layer may call: today's, or the text given in `others` (file name -> text)."""
    return {"kernels.cpp": source, **{name: _source(name) for name in EXTRA_SOURCES}, **(others or {})}


def _compile(compiler: str, flags: list[str], sources: dict[str, str], target: Path) -> None:
    """Build the shared library of `sources` (file name -> text) into `target`, atomically
    (concurrent builds are harmless)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        paths = []
        for name, text in sources.items():
            paths.append(Path(tmp) / name)
            paths[-1].write_text(text)
        library = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, paths), "-o", str(library)], check=True, capture_output=True)
        os.replace(library, target)


def compiled(name: str, sources: dict[str, str], flags: list[str], fallback: str) -> ctypes.CDLL | None:
    """The shared library of `sources` (file name -> text) compiled with `flags`, built into the cache
    on first use and loaded; None off Linux, without a C++ compiler, or where the build fails (with a
    warning naming `fallback`, what runs instead). Libraries of different sources, flags, compilers
    and CPUs have different cache keys, so they live side by side in the cache and in one process."""
    if platform.system() != "Linux":
        return None
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    try:
        version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([*sources.values(), *flags, compiler, version, _cpu_id()]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"{name}-{key}.so"
        if not target.is_file():
            _compile(compiler, flags, sources, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or str(error)
        detail = detail.decode() if isinstance(detail, bytes) else detail
        warnings.warn(f"specsample: C++ {name} unavailable, {fallback}: {detail[-500:]}", stacklevel=4)
        return None


@cache
def _load(isa: str) -> ctypes.CDLL | None:
    """The kernels of `kernels.cpp` compiled with `ISA_FLAGS[isa]`, built on first use."""
    return _build(_source(), isa)


def _build(source: str, isa: str, others: dict[str, str] | None = None) -> ctypes.CDLL | None:
    """`source` (and `others`, as `_sources`) compiled with `ISA_FLAGS[isa]` (`compiled`) and its functions
    declared; None where that is impossible."""
    lib = compiled("kernels", _sources(source, others), FLAGS + ISA_FLAGS[isa], "using torch ops")
    if lib is None:
        return None
    fn = lib.specsample_gemm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    fn = lib.specsample_layers
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn.restype = None
    fn = lib.specsample_layers_slots
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [ctypes.c_void_p] * 5
    fn.restype = None
    lib.specsample_half_caches.argtypes = []
    lib.specsample_half_caches.restype = ctypes.c_int
    lib.specsample_gumbel_noise.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_long, ctypes.c_void_p]
    lib.specsample_gumbel_noise.restype = None
    lib.specsample_top_k.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                     ctypes.c_void_p]
    lib.specsample_top_k.restype = None
    lib.specsample_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                        ctypes.c_void_p]
    lib.specsample_rms_norm.restype = None
    lib.specsample_isa.argtypes = []
    lib.specsample_isa.restype = ctypes.c_char_p
    _declare_gguf(lib)
    return lib


def _declare_gguf(lib: ctypes.CDLL) -> None:
    """Argument types of kernels_gguf.cpp's functions."""
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.specsample_gemm_gguf.argtypes = [ctypes.c_int, p, n, n, n, p, p, n, p, n, p, ctypes.c_int]
    lib.specsample_gemm_gguf.restype = ctypes.c_int
    lib.specsample_gguf_quantize.argtypes = [p, n, n, n, p, p, p]
    lib.specsample_gguf_quantize.restype = None
    lib.specsample_gguf_isa.argtypes = []
    lib.specsample_gguf_isa.restype = ctypes.c_char_p


@cache
def _library() -> ctypes.CDLL | None:
    """The kernels for the instruction set SPECSAMPLE_KERNEL_ISA asks for (default: native);
    None where they cannot be built, or with SPECSAMPLE_NO_KERNELS set."""
    if os.environ.get("SPECSAMPLE_NO_KERNELS"):
        return None
    isa = os.environ.get(ISA_VARIABLE) or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_VARIABLE}={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return _load(isa)


def available() -> bool:
    """True if the kernels are built (or buildable) and loaded."""
    return _library() is not None


def instruction_set() -> str:
    """The vector instruction set the loaded kernels were compiled for: "avx512", "avx2" or
    "portable" (read from the library, so what the compiler targeted, not what was asked for).

    Raises RuntimeError where the kernels are unavailable: check `available()` first.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the C++ kernels are unavailable (see kernels.available())")
    return lib.specsample_isa().decode()


def _panels(weight: Tensor) -> Tensor:
    """A weight [out, in] as panels [ceil(out / 32), in, 32] of its dtype, zero-padded."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    padded = torch.zeros(blocks * BLOCK, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    panels = hugepages.tensor((blocks, in_features, BLOCK), weight.dtype)  # streamed every pass
    return panels.copy_(padded.view(blocks, BLOCK, in_features).transpose(1, 2))  # [blocks, in, 32]


def pack(weight: Tensor) -> Tensor:
    """An nn.Linear weight [out, in] as float32 panels [ceil(out / 32), in, 32], zero-padded."""
    return _panels(weight.detach().float())


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of a weight [out, in]: (int8 [out, in], float32 scales [out]),
    weight ~ int8 * scale with scale = absmax / 127, so each weight is off by at most scale / 2."""
    weight = weight.detach().float()
    scales = weight.abs().amax(1).clamp_min(1e-12) / 127  # [out]
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def pack_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """An nn.Linear weight [out, in] quantized as by `quantize_int8`: int8 panels [ceil(out / 32), in, 32]
    (a quarter of the float32 bytes to stream) and float32 scales [out]."""
    quantized, scales = quantize_int8(weight)
    return _panels(quantized), scales


def unpack(packed: Tensor, out_features: int) -> Tensor:
    """The weight [out, in] that `pack` or `pack_int8` (before scaling) turned into `packed`."""
    blocks, in_features, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, in_features)[:out_features]


def unpack_rows(packed: Tensor, rows: Tensor, scales: Tensor | None = None) -> Tensor:
    """Rows `rows` [n] of the original [out, in] weight, float32 (int8 times its scales):
    [n, in] (an embedding lookup in a tied LM head)."""
    picked = packed[rows // BLOCK, :, rows % BLOCK]  # [n, in]
    return picked if scales is None else picked.float() * scales[rows, None]


def matmul(
    x: Tensor,
    packed: Tensor,
    out_features: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
    scales: Tensor | None = None,
) -> Tensor:
    """x [n, in] @ weight.T (+ bias) -> [n, out]; with `out` given, adds the product into it.

    `packed` is float32 from `pack`, or int8 from `pack_int8` with its `scales` [out]:
    the product is then x @ (int8 * scales).T, the int8 weights converted to float in registers.
    """
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == packed.shape[1]
    assert packed.dtype == (torch.float32 if scales is None else torch.int8)
    assert scales is None or (scales.dtype == torch.float32 and scales.shape == (out_features,))
    n = x.shape[0]
    add = out is not None
    if out is None:
        out = torch.empty(n, out_features, dtype=torch.float32)
    assert out.stride(1) == 1 and out.shape == (n, out_features)
    _library().specsample_gemm(
        x.data_ptr(), n, x.shape[1], x.stride(0), packed.data_ptr(), None if scales is None else scales.data_ptr(),
        out_features, out.data_ptr(), out.stride(0), None if bias is None else bias.data_ptr(), int(add),
    )
    return out


def gguf_instruction_set() -> str:
    """The path of the GGUF block kernels in the loaded library: "avx512vnni", "avxvnni", "avx2" or
    "portable".

    Raises RuntimeError where the kernels are unavailable: check `available()` first.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the C++ kernels are unavailable (see kernels.available())")
    return lib.specsample_gguf_isa().decode()


def build_key() -> str:
    """Which kernels this process runs, for what is remembered per machine (the backend choice, the cost
    curve's prior): "none" without them (torch ops, no GGUF blocks), else the paths the library was
    compiled for. A choice measured on the native build no longer applies under SPECSAMPLE_NO_KERNELS=1 (it
    would pick blocks that cannot be built) or SPECSAMPLE_KERNEL_ISA=avx2 (its passes cost otherwise)."""
    if not available():
        return "none"
    return f"{instruction_set()}/{gguf_instruction_set()}"


def machine_digest(*parts: object) -> str:
    """A short key for what is remembered per machine: `parts`, this CPU (`_cpu_id`), the kernel build
    (`build_key`) and the llama.cpp CPU variant asked for (SPECSAMPLE_LLAMACPP_VARIANT: its passes cost
    otherwise than the best variant's)."""
    from specsample.models.llamacpp import requested_variant

    variant = requested_variant() or "best"
    return hashlib.sha256("|".join(map(str, [*parts, _cpu_id(), build_key(), variant])).encode()).hexdigest()[:16]


GGUF_STACKED = 1000  # kernels_gguf.cpp's STACKED: a matrix of parts of different GGML types


def matmul_gguf(
    x: Tensor,
    qtype: int,
    qs: Tensor,
    scales: Tensor | None,
    out_features: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """x [n, in] @ W.T (+ bias) -> [n, out] for W of GGML type `qtype` (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1,
    8 Q8_0, 12 Q4_K, 14 Q6_K) in the panels of `gguf_blocks.pack_blocks` (qs uint8, scales float16, or the K types'
    uint8 records); with `out`, adds into it. For `qtype` GGUF_STACKED, qs is the int64 table of
    parts of `gguf_blocks.stacked_linear` (scales None).

    The activations are quantized per 32-block to int8 first (`quantize_activations`), so the result
    is that int8 x times the dequantized W, to float32 rounding of the block sums.
    """
    in_features = x.shape[1]
    assert x.dtype == torch.float32 and x.stride(1) == 1 and in_features % 32 == 0 and qs.is_contiguous()
    assert bias is None or bias.dtype == torch.float32
    if qtype != GGUF_STACKED:
        assert qs.dtype == torch.uint8 and scales.dtype in (torch.float16, torch.uint8) and scales.is_contiguous()
        assert qs.shape[:2] == (-(-out_features // 32), in_features // 32)
    n = x.shape[0]
    add = out is not None
    if out is None:
        out = torch.empty(n, out_features, dtype=torch.float32)
    assert out.stride(1) == 1 and out.shape == (n, out_features)
    status = _library().specsample_gemm_gguf(
        qtype, x.data_ptr(), n, in_features, x.stride(0), qs.data_ptr(), None if scales is None else scales.data_ptr(),
        out_features, out.data_ptr(), out.stride(0), None if bias is None else bias.data_ptr(), int(add),
    )
    if status:
        raise ValueError(f"GGML type {qtype} has no block kernel")
    return out


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' own quantization of x [n, in] per 32-block, as `matmul_gguf` does it:
    (int8 [n, in], scales float32 [n, in / 32], sums int32 [n, in / 32])."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] % 32 == 0
    n, in_features = x.shape
    q = torch.empty(n, in_features, dtype=torch.int8)
    d = torch.empty(n, in_features // 32, dtype=torch.float32)
    s = torch.empty(n, in_features // 32, dtype=torch.int32)
    _library().specsample_gguf_quantize(x.data_ptr(), n, in_features, x.stride(0), q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def gumbel_noise(seed: int, position: int, vocab: int) -> Tensor:
    """`sampling.position_noise` on the kernels: standard Gumbel noise [vocab] float32 of (seed, position)."""
    out = torch.empty(vocab, dtype=torch.float32)
    _library().specsample_gumbel_noise(seed % 2**64, position % 2**64, vocab, out.data_ptr())
    return out


def top_k(x: Tensor, k: int) -> Tensor:
    """The indices [rows, k] int64 of the k largest entries of each row of x [rows, n] (float32, rows with
    unit stride, 1 <= k <= min(64, n)), largest first, the earlier of equal entries first."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and 1 <= k <= min(64, x.shape[1])
    out = torch.empty(x.shape[0], k, dtype=torch.int64)
    _library().specsample_top_k(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, out.data_ptr())
    return out


def cache_dtype(requested: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """The element type of a KV cache on the kernels: `requested` (None: `default`), float32 for float16
    where the library was built by a compiler without a float16 type."""
    if requested is None:
        return default
    if requested == torch.float16 and not _library().specsample_half_caches():
        return torch.float32
    return requested


KEY_TILE = 16  # positions per tile of the kernels' keys (TILE in kernels.cpp)


def capacity(length: int) -> int:
    """Cache capacity for `length` positions: whole tiles of keys (`KEY_TILE`) and one more, so that
    the heads' keys and values are never a power of two apart (they would fall into the same cache sets)."""
    return -(-length // KEY_TILE) * KEY_TILE + KEY_TILE


def key_views(keys: Tensor, start: int, end: int) -> list[Tensor]:
    """Views of the kernels' keys, tiled [..., capacity / KEY_TILE, head_dim, KEY_TILE] (key j of position
    p at [..., p // KEY_TILE, j, p % KEY_TILE]: a tile's keys are one run of memory that attention streams),
    covering positions start..end-1: the rest of a first tile, whole tiles, the start of a last one. Two
    caches' views of the same positions pair up, for copying."""
    views = []
    while start < end:
        tile, first = divmod(start, KEY_TILE)
        if first == 0 and end - start >= KEY_TILE:
            tiles = (end - start) // KEY_TILE
            views.append(keys[..., tile : tile + tiles, :, :])
            start += tiles * KEY_TILE
        else:
            last = min(KEY_TILE, first + end - start)
            views.append(keys[..., tile, :, first:last])
            start += last - first
    return views


class LayerArgs(ctypes.Structure):
    """The C `Layer`: pointers into tensors that the caller keeps alive. The scales sqkv, so,
    sgu and sdown belong to int8 matrices (`pack_int8`) and are null for float32 ones (`pack`);
    a matrix whose GGML type fqkv, fo, fgu or fdown is set (not 0) is in GGUF blocks
    (`gguf_blocks.pack_blocks`: weight its qs, scales its fp16 scales). Keys and values are float32, or
    float16 where kv_half is set. q_norm and k_norm (Qwen3's and Gemma 3's norms of each query and key
    head), post_attn_norm and post_mlp_norm (Gemma 3's norms of the attention's and the MLP's outputs) are
    null where the model has none; gelu selects GELU's tanh form for the MLP's gate (else SiLU); window
    is a sliding attention window (0: none) and scale what attention scores are scaled by."""

    _fields_ = [(name, ctypes.c_long) for name in ("hidden", "heads", "kv_heads", "d", "inter", "cap")] + [
        ("eps", ctypes.c_float)
    ] + [(name, ctypes.c_void_p) for name in (
        "attn_norm", "mlp_norm", "wqkv", "bqkv", "wo", "bo", "wgu", "wdown", "sqkv", "so", "sgu", "sdown",
        "cos", "sin", "keys", "values", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm",
    )] + [(name, ctypes.c_int) for name in ("fqkv", "fo", "fgu", "fdown", "kv_half", "gelu")] + [
        ("window", ctypes.c_long), ("scale", ctypes.c_float),
    ]


def scratch_size(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Floats of scratch `layers` needs per token."""
    return 2 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 3 * intermediate


def layer_table(layers: Sequence[LayerArgs]) -> ctypes.Array:
    """The addresses of `layers` as `layers` takes them; the caller keeps the LayerArgs alive."""
    return (ctypes.c_void_p * len(layers))(*[ctypes.addressof(args) for args in layers])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [n, hidden] (float32, contiguous) with `weight` [hidden], as the layers compute theirs:
    the final norm of a pass on the kernels, one call where torch.rms_norm runs several ops (15 to 50 us
    for a few rows, AMD EPYC)."""
    assert x.dtype == weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
    out = torch.empty_like(x)
    _library().specsample_rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
    return out


def layers(table: ctypes.Array, x: Tensor, start: int, scratch: Tensor, parents: Tensor | None = None) -> None:
    """The decoder layers of `table` (`layer_table`) in turn over the residual stream x [n, hidden]
    (updated in place) at positions start.., in one call into the library.

    Each layer: RMSNorm, the fused QKV product (with q_norm and k_norm, each query and key head normed),
    rotary embedding, K/V written into the
    cache, causal grouped-query attention, the output projection added into x, RMSNorm,
    the fused gate/up product, SiLU(gate) * up and the down projection added into x.

    With `parents` [n] int64 (contiguous; a tree: each token's parent among the n, -1 for none, before
    it), token t is written to cache slot start + t, takes the rotary angle of position start + its
    depth and attends to positions 0..start-1 and its ancestors' slots and its own (tree attention):
    its output is bitwise that of its root-to-node path scored as a chain at start.
    """
    tree = None if parents is None else parents.data_ptr()
    _library().specsample_layers(table, len(table), x.data_ptr(), x.shape[0], start, scratch.data_ptr(), tree)


def layers_slots(table: ctypes.Array, x: Tensor, rows: Tensor, starts: Tensor, keys: Tensor, values: Tensor,
                 scratch: Tensor) -> None:
    """`layers` over x [n, hidden] whose rows belong to several caches (slots): segment s is the next
    rows[s] rows, at positions starts[s].. of the cache whose keys and values of layer i are at
    addresses keys[i, s] and values[i, s] (int64 [layers, segments] each, laid out as the layer's own,
    which are not read). The products run once over all
    rows; each segment attends over its own cache only. One call into the library, as `layers`: a call
    per layer cost about 5 us each (5% of a one-row pass of the bundled model)."""
    assert rows.dtype == starts.dtype == keys.dtype == values.dtype == torch.int64 and int(rows.sum()) == x.shape[0]
    assert keys.shape == values.shape == (len(table), rows.shape[0])
    keys, values = keys.contiguous(), values.contiguous()
    _library().specsample_layers_slots(table, len(table), x.data_ptr(), x.shape[0], rows.shape[0], rows.data_ptr(),
                                       starts.data_ptr(), keys.data_ptr(), values.data_ptr(), scratch.data_ptr())
