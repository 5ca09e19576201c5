"""GGUF quantized weights kept in their own blocks, for the C++ block kernels (kernels_gguf.cpp).

A GGUF file stores a Q4_0, Q4_1 or Q8_0 matrix [out, in] row by row, in blocks of 32 inputs:
an fp16 scale d (Q4_1: and an fp16 min m) and 32 integers (4-bit nibbles, or int8). The
kernels want the integers of 16 output columns side by side, 4 inputs per 32-bit lane, so one
vector load serves 16 columns and the dot-product instructions (vpdpbusd, vpmaddubsw) need no
horizontal sums. `pack_blocks` rearranges the bytes once at load, without changing a bit of
them: the packed matrix is exactly as large as the file's tensor (plus padding to 16 rows), and
`raw_rows` gives the file's bytes of any rows back (the embedding lookup of a tied LM head, and
the tests, dequantize those with the `gguf` package itself).

Layout (kernels_gguf.cpp's header comment has it from the kernel's side):
    qs     uint8   [panels, blocks, 256 (Q4) | 512 (Q8_0)]
    scales float16 [panels, blocks, 1 (Q4_0, Q8_0) | 2 (Q4_1: d, m), 16]
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from torch import Tensor

COLS = 16  # output columns per panel
QK = 32  # inputs per block

# Type -> (bytes per block in the file, fp16 values before the integers).
FORMATS = {
    GGMLQuantizationType.Q4_0: (18, 1),
    GGMLQuantizationType.Q4_1: (20, 2),
    GGMLQuantizationType.Q8_0: (34, 1),
}


def supported(qtype: int) -> bool:
    """True if the block kernels take matrices of this GGML type."""
    return qtype in FORMATS


@dataclass
class BlockMatrix:
    """A weight [out, in] in GGUF blocks, packed in panels of 16 output columns for the kernels."""

    qtype: GGMLQuantizationType
    qs: Tensor  # uint8 [panels, blocks, 256 | 512]
    scales: Tensor  # float16 [panels, blocks, 1 | 2, 16]
    out_features: int
    in_features: int

    def __call__(self, x: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """x [n, in] @ W.T (+ bias) -> [n, out], x quantized per block to int8; with `out`, adds into it."""
        from specsample.models import kernels

        return kernels.matmul_gguf(x, int(self.qtype), self.qs, self.scales, self.out_features, bias, out)

    def raw_rows(self, rows: np.ndarray) -> np.ndarray:
        """The file's bytes of rows `rows` [n]: uint8 [n, blocks * block bytes]."""
        return unpack_rows(self, np.asarray(rows))

    def rows(self, rows: Tensor) -> Tensor:
        """Rows `rows` [n] of W, dequantized by the `gguf` package: float32 [n, in]."""
        raw = self.raw_rows(rows.cpu().numpy())
        return torch.from_numpy(np.ascontiguousarray(dequantize(raw, self.qtype)))

    def dequantize(self) -> Tensor:
        """The whole W [out, in] in float32 (for tests and references; the kernels never need it)."""
        return self.rows(torch.arange(self.out_features))


def pack_blocks(raw: np.ndarray, qtype: int) -> BlockMatrix:
    """A GGUF tensor's bytes, uint8 [out, blocks * block bytes] (`ReaderTensor.data`), packed in panels."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in FORMATS:
        raise ValueError(f"no block kernel for GGML type {qtype.name}")
    block_bytes, halves = FORMATS[qtype]
    out_features = raw.shape[0]
    blocks = raw.shape[1] // block_bytes
    panels = -(-out_features // COLS)
    padded = np.zeros((panels * COLS, blocks, block_bytes), dtype=np.uint8)
    padded[:out_features] = raw.reshape(out_features, blocks, block_bytes)
    by_panel = padded.reshape(panels, COLS, blocks, block_bytes)  # [p, col, b, bytes]
    scales = by_panel[..., : 2 * halves].copy().view(np.float16)  # [p, col, b, halves]
    scales = scales.transpose(0, 2, 3, 1)  # [p, b, halves, col]
    ints = by_panel[..., 2 * halves :]  # [p, col, b, 16 | 32]
    chunks = ints.shape[-1] // 4  # Q4: 4 chunks (low and high nibbles), Q8_0: 8 groups
    ints = ints.reshape(panels, COLS, blocks, chunks, 4).transpose(0, 2, 3, 1, 4)  # [p, b, chunk, col, 4]
    return BlockMatrix(
        qtype,
        torch.from_numpy(np.ascontiguousarray(ints).reshape(panels, blocks, -1)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        out_features,
        blocks * QK,
    )


def unpack_rows(matrix: BlockMatrix, rows: np.ndarray) -> np.ndarray:
    """The inverse of `pack_blocks` for rows `rows` [n]: the file's bytes, uint8 [n, blocks * block bytes]."""
    panels, blocks, _ = matrix.qs.shape
    panel, col = rows // COLS, rows % COLS
    ints = matrix.qs.numpy().reshape(panels, blocks, -1, COLS, 4)[panel, :, :, col]  # [n, b, chunk, 4]
    scales = matrix.scales.numpy()[panel, :, :, col]  # [n, b, halves]
    n = len(rows)
    raw = np.concatenate([scales.view(np.uint8).reshape(n, blocks, -1), ints.reshape(n, blocks, -1)], axis=-1)
    return raw.reshape(n, -1)


def llama_permutation(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's conversion of Q and K weights (its `permute`, which turns
    rotary halves into interleaved pairs): row i of the transformers weight is row perm[i] of the file's."""
    head_dim = rows // heads
    # The converter maps transformers [heads, 2, head_dim / 2] to the file's [heads, head_dim / 2, 2].
    file_index = np.arange(rows).reshape(heads, head_dim // 2, 2)  # [h, d/2, 2] -> file row
    return file_index.transpose(0, 2, 1).reshape(rows)


def read_raw(reader: GGUFReader, name: str, permute_heads: int | None = None) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A tensor's bytes [out, blocks * block bytes] and type, rows in transformers order (Q and K
    rows un-permuted with `permute_heads` heads)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise KeyError(f"no tensor {name!r} in the GGUF file")
    raw = np.asarray(tensor.data)
    if permute_heads:
        raw = raw[llama_permutation(raw.shape[0], permute_heads)]
    return raw, GGMLQuantizationType(tensor.tensor_type)


def read_matrix(path: str | Path | GGUFReader, names: list[str], permute_heads: list[int | None] | None = None) -> BlockMatrix:
    """Tensors `names` of a GGUF file, stacked along their output rows (a fused QKV or gate/up), packed.

    Raises ValueError where they are of different types or of a type without a block kernel.
    """
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path)
    permute_heads = permute_heads or [None] * len(names)
    parts = [read_raw(reader, name, heads) for name, heads in zip(names, permute_heads)]
    types = {qtype for _, qtype in parts}
    if len(types) != 1:
        raise ValueError(f"tensors {names} mix the types {sorted(t.name for t in types)}")
    return pack_blocks(np.concatenate([raw for raw, _ in parts]), types.pop())
