"""GGUF quantized weights kept in their own blocks, for the C++ block kernels (kernels_gguf.cpp).

A GGUF file stores a Q4_0, Q4_1 or Q8_0 matrix [out, in] row by row, in blocks of 32 inputs:
an fp16 scale d (Q4_1: and an fp16 min m) and 32 integers (4-bit nibbles, or int8). The
kernels want the integers of 16 output columns side by side, 4 inputs per 32-bit lane, so one
vector load serves 16 columns and the dot-product instructions (vpdpbusd, vpmaddubsw) need no
horizontal sums. `pack_blocks` rearranges the bytes once at load, without changing a bit of
them: the packed matrix is exactly as large as the file's tensor (plus padding to 32 rows), and
`raw_rows` gives the file's bytes of any rows back (the embedding lookup of a tied LM head, and
the tests, dequantize those with the `gguf` package itself).

Q5_0 and Q5_1 keep a fifth bit per value in a uint32 before the nibbles; packed, those bits
follow the nibbles in one more chunk per block. Q4_K and Q6_K (256-input super-blocks of 32- or
16-input sub-blocks, each with a 6- or 8-bit integer scale) are repacked into the same 32-input
blocks of integers (Q6_K's 2 high bits in two more chunks) and one record of scales per panel and
super-block, with the 6-bit scales unpacked to bytes (Q4_K: 4 more bytes per 256 inputs and
column than the file). `raw_rows` rebuilds the file's bytes exactly.

Layout (kernels_gguf.cpp's header comment has it from the kernel's side): two panels (a pair, 32
output columns) block after block, so that a pass reads one stream and multiplies both at once:
    qs     uint8   [pairs, blocks, 2 * (256 (Q4, Q4_K) | 320 (Q5) | 384 (Q6_K) | 512 (Q8_0))]
    scales float16 [pairs, blocks, 2, 1 (Q4_0, Q5_0, Q8_0) | 2 (Q4_1, Q5_1: d, m), 16]
           uint8   [pairs, blocks / 8, 2, 320 (Q4_K) | 288 (Q6_K)]   the K types' records
"""
from __future__ import annotations

import errno
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import Tensor

from specsample.models import hugepages
from specsample.models.llama import Linear

COLS = 16  # output columns per panel
PAIR = 2  # panels stored block after block together: the kernels multiply both at once
QK = 32  # inputs per block
QK_K = 256  # inputs per super-block of the K types
KV_DTYPE = torch.float16  # keys and values of a target on the blocks, as llama.cpp keeps them: half the bytes of float32
Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K

# Type -> (bytes per block in the file, fp16 values before the integers).
FORMATS = {
    GGMLQuantizationType.Q4_0: (18, 1),
    GGMLQuantizationType.Q4_1: (20, 2),
    GGMLQuantizationType.Q5_0: (22, 1),
    GGMLQuantizationType.Q5_1: (24, 2),
    GGMLQuantizationType.Q8_0: (34, 1),
}
FIVE_BITS = {GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1}  # qh (4 bytes) before the nibbles


# K type -> the fields of its scale record per super-block and column: (name, count, bytes each).
RECORDS = {
    Q4_K: [("d", 1, 2), ("dmin", 1, 2), ("sc", 8, 1), ("m", 8, 1)],
    Q6_K: [("d", 1, 2), ("sc", 16, 1)],
}


def supported(qtype: int) -> bool:
    """True if the block kernels take matrices of this GGML type."""
    return qtype in FORMATS or qtype in RECORDS


@dataclass
class BlockMatrix:
    """A weight [out, in] in GGUF blocks, packed in pairs of panels of 16 output columns for the kernels."""

    qtype: GGMLQuantizationType
    qs: Tensor  # uint8 [pairs, blocks, 2 * (256 | 320 | 384 | 512)]
    scales: Tensor  # float16 [pairs, blocks, 2, 1 | 2, 16]; K types: uint8 [pairs, blocks / 8, 2, record bytes]
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
        """Rows `rows` [n] of W, dequantized by the `gguf` package: float32 [n, in] (n may be 0: an empty
        prefill's embedding)."""
        if rows.numel() == 0:
            return torch.empty(0, self.in_features)
        raw = self.raw_rows(rows.cpu().numpy())
        return torch.from_numpy(np.ascontiguousarray(dequantize(raw, self.qtype)))

    def dequantize(self) -> Tensor:
        """The whole W [out, in] in float32 (for tests and references; the kernels never need it)."""
        return self.rows(torch.arange(self.out_features))


def pack_blocks(raw: np.ndarray, qtype: int) -> BlockMatrix:
    """A GGUF tensor's bytes, uint8 [out, blocks * block bytes] (`ReaderTensor.data`), packed in panels."""
    qtype = GGMLQuantizationType(qtype)
    if qtype in RECORDS:
        return _pack_k(raw, qtype)
    if qtype not in FORMATS:
        raise ValueError(f"no block kernel for GGML type {qtype.name}")
    block_bytes, halves = FORMATS[qtype]
    out_features = raw.shape[0]
    blocks = raw.shape[1] // block_bytes
    by_block = raw.reshape(out_features, blocks, block_bytes)  # a view: the file's bytes are read once, below
    scales = _to_pairs(by_block[..., : 2 * halves], 2).view(np.float16)
    ints = by_block[..., 2 * halves :]  # [out, b, 16 | 32 | Q5: 4 + 16]
    if qtype in FIVE_BITS:  # the nibbles, then their fifth bits
        ints = np.concatenate([ints[..., 4:], _fifth_bytes(ints[..., :4])], axis=-1)
    return BlockMatrix(
        qtype, torch.from_numpy(_to_pairs(ints, 4)), torch.from_numpy(scales.reshape(*scales.shape[:2], PAIR, halves, COLS)),
        out_features, blocks * QK,
    )


def unpack_rows(matrix: BlockMatrix, rows: np.ndarray) -> np.ndarray:
    """The inverse of `pack_blocks` for rows `rows` [n]: the file's bytes, uint8 [n, blocks * block bytes]."""
    if matrix.qtype in RECORDS:
        return _unpack_k(matrix, rows)
    ints = _from_pairs(matrix.qs.numpy(), rows, 4)  # [n, b, bytes]
    if matrix.qtype in FIVE_BITS:
        ints = np.concatenate([_qh_bytes(ints[..., 16:]), ints[..., :16]], axis=-1)
    scales = matrix.scales.numpy()
    scales = _from_pairs(scales.view(np.uint8).reshape(*scales.shape[:2], -1), rows, 2)  # [n, b, 2 * halves]
    return np.concatenate([scales, ints], axis=-1).reshape(len(rows), -1)


def _fifth_bytes(qh: np.ndarray) -> np.ndarray:
    """A Q5 block's fifth bits, qh [..., 4] (a little-endian uint32, bit k for input k), as 4 bytes: byte i
    holds at bit c that of input 4c + i and at bit 4 + c that of input 16 + 4c + i."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little").reshape(*qh.shape[:-1], 2, 4, 4)  # [..., half, c, i]
    weights = (1 << (np.arange(2)[:, None] * 4 + np.arange(4)[None, :])).astype(np.uint8)  # [half, c]
    return (bits * weights[..., None]).sum(axis=(-3, -2), dtype=np.uint8)


def _qh_bytes(fifth: np.ndarray) -> np.ndarray:
    """The inverse of `_fifth_bytes`."""
    bits = np.unpackbits(fifth, axis=-1, bitorder="little").reshape(*fifth.shape[:-1], 4, 2, 4)  # [..., i, half, c]
    by_input = bits.transpose(*range(fifth.ndim - 1), -2, -1, -3)  # [..., half, c, i]: input 16 half + 4c + i
    return np.packbits(by_input.reshape(*fifth.shape[:-1], 32), axis=-1, bitorder="little")


PAIRS_AT_ONCE = 128  # pairs rearranged at a time: bounds the temporaries of packing a large matrix


def _to_pairs(per_row: np.ndarray, inner: int, out: np.ndarray | None = None) -> np.ndarray:
    """Bytes per row [out, X, A * inner] in pairs of panels, [pairs, X, PAIR * A * COLS * inner]: for each X,
    a pair's two panels one after the other, and in a panel its A pieces of `inner` bytes, each piece of
    all 16 columns side by side (zero rows pad the last pair). Written into `out` if given (those bytes in
    any shape that splits the last axis, [pairs, X, PAIR, A * COLS * inner] too), else into a new array."""
    out_features, x, width = per_row.shape
    pairs = -(-out_features // (PAIR * COLS))
    out = hugepages.empty((pairs, x, PAIR * width * COLS), np.uint8) if out is None else out
    for p0 in range(0, pairs, PAIRS_AT_ONCE):
        p1 = min(p0 + PAIRS_AT_ONCE, pairs)
        rows = per_row[p0 * PAIR * COLS : p1 * PAIR * COLS]
        padded = np.zeros(((p1 - p0) * PAIR * COLS, x, width), dtype=np.uint8)
        padded[: len(rows)] = rows
        pieces = padded.reshape(p1 - p0, PAIR, COLS, x, width // inner, inner).transpose(0, 3, 1, 4, 2, 5)
        out[p0:p1] = pieces.reshape(out[p0:p1].shape)  # [pair, X, panel, piece, column, inner]
    return out


def _from_pairs(packed: np.ndarray, rows: np.ndarray, inner: int) -> np.ndarray:
    """The inverse of `_to_pairs` for rows `rows` [n] of `packed` [pairs, X, PAIR * bytes]: [n, X, bytes / 16]."""
    return _columns(_panels(packed, rows), rows, inner)


def _panels(packed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The bytes of the panels holding rows `rows` [n] of `packed` [pairs, X, PAIR * bytes]: [n, X, bytes]."""
    pairs, x = packed.shape[:2]
    return packed.reshape(pairs, x, PAIR, -1)[rows // (PAIR * COLS), :, rows // COLS % PAIR]


def _columns(panels: np.ndarray, rows: np.ndarray, inner: int) -> np.ndarray:
    """Row `rows[i]`'s pieces of `inner` bytes in panel bytes [n, X, A * COLS * inner]: [n, X, A * inner]."""
    n, x = panels.shape[:2]
    return panels.reshape(n, x, -1, COLS, inner)[np.arange(n), :, :, rows % COLS].reshape(n, x, -1)


def _nibble_bytes(u: np.ndarray) -> np.ndarray:
    """4-bit values [..., 32] as 16 bytes in GGUF's Q4_0 order: byte k holds input k low, k + 16 high."""
    return (u[..., :16] & 0x0F) | (u[..., 16:] << 4)


def _high_bytes(u: np.ndarray) -> np.ndarray:
    """Bits 4 and 5 of 6-bit values [..., 32] as 8 bytes: byte 4 half + i holds, at bits 2c, those of
    input 16 half + 4c + i."""
    high = ((u >> 4) & 3).reshape(*u.shape[:-1], 2, 4, 4)  # [..., half, c, i]
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]  # [c, 1]
    return np.bitwise_or.reduce(high << shifts, axis=-2).reshape(*u.shape[:-1], 8)


def _values(ints: np.ndarray, six_bits: bool) -> np.ndarray:
    """The inverse of `_nibble_bytes` (and `_high_bytes`): [..., 16 | 24] bytes -> values [..., 32]."""
    u = np.concatenate([ints[..., :16] & 0x0F, ints[..., :16] >> 4], axis=-1)
    if six_bits:
        high = ints[..., 16:24].reshape(*ints.shape[:-1], 2, 1, 4)  # [..., half, 1, i]
        bits = (high >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [..., half, c, i]
        u |= bits.reshape(*ints.shape[:-1], 32) << 4
    return u


def _k_fields(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A K type's bytes [out, super-blocks * block bytes] as record fields {name: uint8 [out, sb, count, bytes]}
    and unsigned values [out, sb, 256] (Q4_K 0..15, Q6_K 0..63)."""
    from gguf.quants import Q4_K as Q4KQuant

    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, gguf_quant_sizes(qtype)[1])
    sb = blocks.shape[1]
    if qtype == Q4_K:
        sc, m = Q4KQuant.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        qs = blocks[..., 16:].reshape(out_features, sb, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        fields = {"d": blocks[..., 0:2], "dmin": blocks[..., 2:4], "sc": sc, "m": m}
        values = (qs & 0x0F).reshape(out_features, sb, QK_K)
    else:
        ql = blocks[..., :128].reshape(out_features, sb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        qh = blocks[..., 128:192].reshape(out_features, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        fields = {"d": blocks[..., 208:210], "sc": blocks[..., 192:208]}
        values = ((ql & 0x0F).reshape(out_features, sb, 2, 128) | (qh & 3).reshape(out_features, sb, 2, 128) << 4)
    shaped = {name: fields[name].reshape(out_features, sb, count, width) for name, count, width in RECORDS[qtype]}
    return shaped, values.reshape(out_features, sb, QK_K).astype(np.uint8)


def _k_bytes(fields: dict[str, np.ndarray], values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The inverse of `_k_fields`: the file's bytes [n, super-blocks * block bytes]."""
    n, sb, _ = values.shape
    flat = {name: field.reshape(n, sb, -1) for name, field in fields.items()}
    if qtype == Q4_K:
        sc, m = flat["sc"], flat["m"]
        scales = np.concatenate([
            sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6, (sc[..., 4:] & 0x0F) | (m[..., 4:] << 4)
        ], axis=-1)
        pairs = values.reshape(n, sb, 4, 2, 32)
        qs = (pairs[:, :, :, 0] | pairs[:, :, :, 1] << 4).reshape(n, sb, 128)
        parts = [flat["d"], flat["dmin"], scales, qs]
    else:
        halves = values.reshape(n, sb, 2, 2, 64)
        ql = (halves[..., 0, :] & 0x0F) | (halves[..., 1, :] << 4)
        high = (values.reshape(n, sb, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
        qh = np.bitwise_or.reduce(high, axis=-2)
        parts = [ql.reshape(n, sb, 128), qh.reshape(n, sb, 64), flat["sc"], flat["d"]]
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(n, -1)


def _pack_k(raw: np.ndarray, qtype: GGMLQuantizationType) -> BlockMatrix:
    """`pack_blocks` of a Q4_K or Q6_K tensor, PAIRS_AT_ONCE pairs of panels at a time, into the packed arrays
    directly: the temporaries (record fields, values, integers) are several times the matrix, and made whole
    they had raised a 1B model's peak memory by 559 MiB to pack its 78 MiB Q6_K LM head."""
    out_features, sb = raw.shape[0], raw.shape[1] // gguf_quant_sizes(qtype)[1]
    pairs = -(-out_features // (PAIR * COLS))
    int_bytes = 24 if qtype == Q6_K else 16  # of a row's 32-block: the nibbles, and Q6_K's high bits
    qs = hugepages.empty((pairs, sb * QK_K // QK, PAIR * COLS * int_bytes), np.uint8)
    record = np.empty((pairs, sb, PAIR, sum(count * COLS * width for _, count, width in RECORDS[qtype])), np.uint8)
    for p0 in range(0, pairs, PAIRS_AT_ONCE):
        p1 = min(p0 + PAIRS_AT_ONCE, pairs)
        _pack_k_rows(raw[p0 * PAIR * COLS : p1 * PAIR * COLS], qtype, qs[p0:p1], record[p0:p1])
    return BlockMatrix(qtype, torch.from_numpy(qs), torch.from_numpy(record), out_features, sb * QK_K)


def _pack_k_rows(raw: np.ndarray, qtype: GGMLQuantizationType, qs: np.ndarray, record: np.ndarray) -> None:
    """Some rows of a K type's bytes packed into their pairs' integers qs [pairs, blocks, bytes] and scale
    records [pairs, sb, PAIR, bytes], each field's records side by side in a panel's (`_pack_k`)."""
    fields, values = _k_fields(raw, qtype)
    out_features, sb, _ = values.shape
    by_block = values.reshape(out_features, sb * QK_K // QK, QK)  # [out, blocks, 32]
    ints = _nibble_bytes(by_block)
    if qtype == Q6_K:
        ints = np.concatenate([ints, _high_bytes(by_block)], axis=-1)
    _to_pairs(ints, 4, qs)
    start = 0
    for name, count, width in RECORDS[qtype]:
        size = count * COLS * width
        _to_pairs(fields[name].reshape(out_features, sb, count * width), width, record[..., start : start + size])
        start += size


def _unpack_k(matrix: BlockMatrix, rows: np.ndarray) -> np.ndarray:
    """`unpack_rows` of a Q4_K or Q6_K matrix."""
    values = _values(_from_pairs(matrix.qs.numpy(), rows, 4), matrix.qtype == Q6_K)  # [n, blocks, 32]
    n = len(rows)
    values = values.reshape(n, -1, QK_K)
    record = matrix.scales.numpy()  # [pairs, sb, PAIR, bytes]
    record = _panels(record.reshape(*record.shape[:2], -1), rows)  # [n, sb, bytes]
    fields, start = {}, 0
    for name, count, width in RECORDS[matrix.qtype]:
        part = record[..., start : start + count * COLS * width]
        fields[name] = _columns(part, rows, width).reshape(n, -1, count, width)
        start += count * COLS * width
    return _k_bytes(fields, values, matrix.qtype)


def llama_permutation(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's conversion of Q and K weights (its `permute`, which turns
    rotary halves into interleaved pairs): row i of the transformers weight is row perm[i] of the file's."""
    head_dim = rows // heads
    # The converter maps transformers [heads, 2, head_dim / 2] to the file's [heads, head_dim / 2, 2].
    file_index = np.arange(rows).reshape(heads, head_dim // 2, 2)  # [h, d/2, 2] -> file row
    return file_index.transpose(0, 2, 1).reshape(rows)


BLOCK = re.compile(r"blk\.(\d+)\.")  # a decoder block's tensor names
GGML_TYPE_IDS = {int(kind) for kind in GGMLQuantizationType}

# GGUF metadata value types with a fixed size, by type id (8 is a string, 9 an array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class TensorIndex:
    """Where each tensor of a GGUF file lies, read from its header alone.

    `gguf.GGUFReader` turns every metadata value into numpy views first, which takes about 8 s for
    the bundled model's 49152-token vocabulary; this keeps the scalar and string metadata, skips
    the arrays (the vocabulary) and memory-maps the tensors: the file's bytes, never copied until packed.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, int | float | bool | str] = {}  # scalars and strings, by key
        self.tensors: dict[str, tuple[list[int], GGMLQuantizationType, int]] = {}  # name -> (dims, type, offset)
        try:
            with open(self.path, "rb") as f:
                self._read_header(f)
        except struct.error as error:  # a read came back short
            raise ValueError(f"{self.path} ends inside its GGUF header: the file is truncated or corrupt") from error
        except (OverflowError, MemoryError) as error:  # a count or a length read from corrupt bytes
            raise ValueError(f"{self.path}: its GGUF header holds an impossible count or length ({error}): the "
                             f"file is corrupt") from None
        except OSError as error:
            if error.errno != errno.EINVAL:  # not a seek to a length read from corrupt bytes
                raise
            raise ValueError(f"{self.path}: its GGUF header holds an impossible length: the file is corrupt") from None
        self.check_decoder()
        size = self.path.stat().st_size
        for name, (dims, kind, offset) in self.tensors.items():
            block_size, type_bytes = gguf_quant_sizes(kind)
            end = self.data_start + offset + int(np.prod(dims, dtype=np.int64)) // block_size * type_bytes
            if end > size:
                raise ValueError(f"tensor {name} of {self.path} ends at byte {end}, past the end of the file ({size} bytes): the file is truncated or corrupt")

    def _read_header(self, f) -> None:
        """The metadata and the tensors' places, from the header at the file's start."""
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        _version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
        for _ in range(n_kv):
            key = self._string(f)
            kind = self._u32(f)
            if kind in _SCALAR_FORMATS:
                self.metadata[key] = struct.unpack(_SCALAR_FORMATS[kind], f.read(_SCALAR_BYTES[kind]))[0]
            elif kind == 8:
                self.metadata[key] = self._string(f)
            else:
                self._skip(f, kind)
        alignment = int(self.metadata.get("general.alignment", 32))
        for _ in range(n_tensors):
            name = self._string(f)
            dims = [self._u64(f) for _ in range(self._u32(f))]
            kind, offset = self._u32(f), self._u64(f)
            if kind not in GGML_TYPE_IDS:
                raise ValueError(f"tensor {name} of {self.path} has GGML type {kind}, which this gguf package does not "
                                 f"know: the file is corrupt, or newer than the package")
            self.tensors[name] = (dims, GGMLQuantizationType(kind), offset)
        self.data_start = -(-f.tell() // alignment) * alignment

    def check_decoder(self) -> None:
        """The decoder's counts in the metadata are positive, agree with each other and with the tensors: a
        corrupt count is one line here, not a crash in the kernels (0 KV heads divide by zero) or a layer
        the converter makes up (a block count past the file's blocks gets random weights)."""
        arch = self.metadata.get("general.architecture")
        counts = {key: self.metadata.get(f"{arch}.{key}") for key in
                  ("block_count", "attention.head_count", "attention.head_count_kv", "embedding_length")}
        for key, value in counts.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{self.path}: {arch}.{key} is {value!r}, not a positive count: the file is corrupt")
        heads, kv_heads = counts["attention.head_count"], counts["attention.head_count_kv"]
        if heads and kv_heads and heads % kv_heads:
            raise ValueError(f"{self.path}: {heads} attention heads cannot share {kv_heads} KV heads evenly: the file is corrupt")
        hidden = counts["embedding_length"]
        if hidden and heads and f"{arch}.attention.key_length" not in self.metadata and hidden % heads:
            raise ValueError(f"{self.path}: an embedding of {hidden} does not split into {heads} heads: the file is corrupt")
        blocks = counts["block_count"]
        present = {int(match.group(1)) for name in self.tensors if (match := BLOCK.match(name))}
        if blocks and present and (missing := sorted(set(range(blocks)) - present)):
            raise ValueError(f"{self.path}: its header says {blocks} blocks, and the tensors of block {missing[0]} are "
                             f"missing: the file is truncated or corrupt")

    @staticmethod
    def _u32(f) -> int:
        return struct.unpack("<I", f.read(4))[0]

    @staticmethod
    def _u64(f) -> int:
        return struct.unpack("<Q", f.read(8))[0]

    @classmethod
    def _string(cls, f) -> str:
        return f.read(cls._u64(f)).decode("utf-8", "replace")

    def _skip(self, f, kind: int) -> None:
        """Skip one metadata value of type `kind`."""
        if kind in _SCALAR_BYTES:
            f.seek(_SCALAR_BYTES[kind], 1)
        elif kind == 8:
            f.seek(self._u64(f), 1)
        elif kind == 9:
            element, count = self._u32(f), self._u64(f)
            if element in _SCALAR_BYTES:
                f.seek(_SCALAR_BYTES[element] * count, 1)
            else:
                for _ in range(count):
                    self._skip(f, element)
        else:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {kind}")

    def entry(self, name: str) -> tuple:
        """A tensor's (dims, type, offset); ValueError naming it where the file has none."""
        if name not in self.tensors:
            raise ValueError(f"{self.path}: no tensor {name!r} (a truncated file, or a model this backend does not read)")
        return self.tensors[name]

    def raw(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
        """A tensor's bytes, uint8 [rows, bytes per row] (memory-mapped), and its type."""
        dims, kind, offset = self.entry(name)
        block_size, type_bytes = gguf_quant_sizes(kind)
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block_size * type_bytes
        return np.memmap(self.path, np.uint8, "r", self.data_start + offset, (rows, row_bytes)), kind


def gguf_quant_sizes(kind: GGMLQuantizationType) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[kind]


def read_raw(index: TensorIndex, name: str, permute_heads: int | None = None) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A tensor's bytes [out, blocks * block bytes] and type, rows in transformers order (Q and K
    rows un-permuted with `permute_heads` heads)."""
    raw, kind = index.raw(name)
    if permute_heads:
        raw = raw[llama_permutation(raw.shape[0], permute_heads)]
    return raw, kind


def read_matrix(path: str | Path | TensorIndex, names: list[str], permute_heads: list[int | None] | None = None) -> BlockMatrix:
    """Tensors `names` of a GGUF file, stacked along their output rows (a fused QKV or gate/up), packed.

    Raises ValueError where they are of different types or of a type without a block kernel.
    """
    reader = path if isinstance(path, TensorIndex) else TensorIndex(path)
    permute_heads = permute_heads or [None] * len(names)
    parts = [read_raw(reader, name, heads) for name, heads in zip(names, permute_heads)]
    types = {qtype for _, qtype in parts}
    if len(types) != 1:
        raise ValueError(f"tensors {names} mix the types {sorted(t.name for t in types)}")
    raw = parts[0][0] if len(parts) == 1 else np.concatenate([raw for raw, _ in parts])  # one: the mapped file, not a copy
    return pack_blocks(raw, types.pop())


STACKED = 1000  # kernels.GGUF_STACKED: a llama.Linear of parts of different GGML types (`stacked_linear`)


@dataclass
class Stack:
    """A matrix of BlockMatrix parts of different types, stacked along the output rows."""

    parts: list[BlockMatrix]

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    def rows(self, rows: Tensor) -> Tensor:
        """Rows `rows` [n] of the stacked weight, dequantized: float32 [n, in]."""
        ends = np.cumsum([part.out_features for part in self.parts])  # [parts]
        which = np.searchsorted(ends, rows.numpy(), side="right")  # [n] part of each row
        out = torch.empty(len(rows), self.parts[0].in_features)
        for i, part in enumerate(self.parts):
            picked = torch.from_numpy(np.flatnonzero(which == i))
            if len(picked):
                out[picked] = part.rows(rows[picked] - int(ends[i] - part.out_features))
        return out

    def dequantize(self) -> Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


def as_matrix(linear) -> BlockMatrix | Stack:
    """The BlockMatrix of a llama.Linear holding GGUF blocks (weight: qs, scales: fp16 scales), or the
    Stack of a stacked one."""
    if linear.qtype == STACKED:
        return Stack(linear.parts)
    return BlockMatrix(GGMLQuantizationType(linear.qtype), linear.weight, linear.scales, linear.out_features,
                       linear.weight.shape[1] * QK)


def linear_rows(linear, rows: Tensor) -> Tensor:
    """Rows `rows` [n] of a GGUF-block llama.Linear's weight, float32 [n, in]: the embedding of a
    tied LM head, dequantized by the `gguf` package as transformers does it."""
    return as_matrix(linear).rows(rows)


def block_linear(matrix: BlockMatrix, bias: Tensor | None):
    """A llama.Linear that runs `matrix` on the block kernels."""
    return Linear(matrix.qs, bias, matrix.out_features, True, matrix.scales, int(matrix.qtype))


@dataclass
class StackedLinear(Linear):
    """A llama.Linear of GGUF block parts of different types (`stacked_linear`)."""

    parts: list[BlockMatrix] | None = None  # what the table's pointers point into


def stacked_linear(parts: list[BlockMatrix], bias: Tensor | None):
    """A llama.Linear whose output rows are those of `parts` in order, each on its own block kernel: a fused
    QKV of different types (a Q4_K_M file's Q6_K V beside Q4_K Q and K). Its weight is the kernels' table
    [count, then per part: type, rows, qs, scales] (int64 pointers); it keeps `parts` alive."""
    table = [len(parts)] + [v for m in parts for v in (int(m.qtype), m.out_features, m.qs.data_ptr(), m.scales.data_ptr())]
    out_features = sum(m.out_features for m in parts)
    return StackedLinear(torch.tensor(table, dtype=torch.int64), bias, out_features, True, None, STACKED, parts)


def fused_linear(parts: list[BlockMatrix], bias: Tensor | None):
    """`parts` stacked along their output rows as one llama.Linear: one packed matrix if they are of one
    type, else a stacked one."""
    kinds = {m.qtype for m in parts}
    if len(kinds) > 1:
        return stacked_linear(parts, bias)
    if len(parts) == 1:
        return block_linear(parts[0], bias)
    raw = np.concatenate([m.raw_rows(np.arange(m.out_features)) for m in parts])
    return block_linear(pack_blocks(raw, kinds.pop()), bias)


# GGUF architectures `file_target` builds (llama covers Mistral and SmolLM2 too; qwen3 adds a norm of
# each query and key head; gemma3 those and more, `gemma3_layers`), and those whose converter permutes
# the Q and K rows (llama.cpp's LlamaModel: rotary pairs interleaved).
ARCHITECTURES = {"llama", "qwen2", "qwen3", "gemma3"}
PERMUTED_QK = {"llama", "mistral"}
# Gemma 3 as llama.cpp runs it (src/llama-model.cpp): every GEMMA3_PATTERN-th layer attends over the whole
# context with the file's rotary base and scaling, the others over the file's sliding window with base
# GEMMA3_LOCAL_BASE, unscaled; attention scores scaled by 1 / sqrt(head size) (by 1 / sqrt(hidden / heads)
# for the 62-layer 27B), embeddings by sqrt(hidden).
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_BASE = 10000.0
GEMMA3_27B_LAYERS = 62
DEFAULT_MAX_LENGTH = 8192  # as the fast backend's (llama.DEFAULT_MAX_LENGTH)


@dataclass(frozen=True)
class FileShape:
    """What a GGUF file's metadata says of a Llama-family decoder."""

    arch: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    context: int


def file_shape(index: TensorIndex) -> FileShape:
    """The decoder's shape from the file's metadata; UnsupportedModel for what `file_target` cannot build."""
    from specsample.models import kernels
    from specsample.models.llama import UnsupportedModel

    meta = index.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not one of {sorted(ARCHITECTURES)}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "linear")  # llama.cpp's default: a factor alone is linear
    if scaling not in ("none", "linear"):
        raise UnsupportedModel(f"rope scaling {scaling!r} is not built from the file")
    hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    if head_dim > kernels.MAX_HEAD_DIM:
        raise UnsupportedModel(f"a head of {head_dim} dimensions is more than the kernels' {kernels.MAX_HEAD_DIM}")
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel("value heads of another size than key heads are not supported")
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModel("a partial rotary embedding is not supported")
    if any(name.endswith(("ffn_up.bias", "ffn_down.bias")) for name in index.tensors):
        raise UnsupportedModel("MLP biases are not supported")
    if arch in PERMUTED_QK and any(name.endswith("attn_q_norm.weight") for name in index.tensors):
        raise UnsupportedModel("norms of query and key heads are not supported on permuted Q and K rows")
    return FileShape(
        arch, meta[f"{arch}.block_count"], heads, meta.get(f"{arch}.attention.head_count_kv", heads), head_dim,
        meta[f"{arch}.attention.layer_norm_rms_epsilon"], meta.get(f"{arch}.context_length", DEFAULT_MAX_LENGTH),
    )


def expected_tensors(index: TensorIndex, shape: FileShape) -> dict[str, tuple[int, int]]:
    """The matrices `file_target` reads and the dims [in, out] (GGUF's order) the metadata implies; the
    feed-forward width is the first layer's, the vocabulary the embedding's."""
    hidden = int(index.metadata[f"{shape.arch}.embedding_length"])
    vocab, ffn = (index.entry(name)[0][1] for name in ("token_embd.weight", "blk.0.ffn_gate.weight"))
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = {"attn_q": (hidden, q), "attn_k": (hidden, kv), "attn_v": (hidden, kv), "attn_output": (q, hidden),
                 "ffn_gate": (hidden, ffn), "ffn_up": (hidden, ffn), "ffn_down": (ffn, hidden)}
    out = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden, 1)}
    if "output.weight" in index.tensors:
        out["output.weight"] = (hidden, vocab)
    for i in range(shape.layers):
        out |= {f"blk.{i}.{name}.weight": dims for name, dims in per_layer.items()}
        out |= {f"blk.{i}.{name}.weight": (hidden, 1) for name in ("attn_norm", "ffn_norm")}
    return out


def check_tensors(index: TensorIndex, shape: FileShape) -> None:
    """ValueError naming the first tensor that is missing, of other dims than the metadata implies, or of a
    type neither the block kernels nor the `gguf` package read: so a file whose metadata and tensors
    disagree is refused in one line, where the kernels would read past a matrix."""
    from specsample.models.llama import UnsupportedModel

    for name, want in expected_tensors(index, shape).items():
        dims = (*map(int, index.entry(name)[0]), 1)[:2]  # a vector's [n] read as [n, 1]
        if dims != want:
            raise ValueError(f"{index.path}: tensor {name!r} is {list(dims)}, the metadata says {list(want)}")
        raw, kind = index.raw(name)
        if not supported(kind):
            try:
                dequantize(raw[:1], kind)
            except NotImplementedError:
                raise UnsupportedModel(f"tensor {name!r} is of GGML type {kind.name}, which this backend cannot read") from None


def base_frequencies(base: float, head_dim: int) -> Tensor:
    """Unscaled rotary inverse frequencies [head_dim / 2], computed as transformers does: base^(-2i/d)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def linear_factor(meta: dict, arch: str) -> float:
    """What a linear rotary scaling divides the frequencies by, read as llama.cpp reads it: the factor, else
    the older key `rope.scale_linear` (old conversions wrote it with no scaling type), 0 or neither 1. A file
    with a factor and no type is linear scaled in llama.cpp; read as unscaled, its logits moved by 8."""
    factor = float(meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 0.0)))
    return factor if factor != 0.0 else 1.0


def inverse_frequencies(index: TensorIndex, shape: FileShape) -> Tensor:
    """The rotary embedding's inverse frequencies [head_dim / 2] (`base_frequencies` of the file's base),
    divided by a linear scaling factor or by the file's per-frequency factors (llama3's rope_freqs)."""
    meta = index.metadata
    base = float(meta.get(f"{shape.arch}.rope.freq_base", 10000.0))
    inv_freq = base_frequencies(base, shape.head_dim)
    if meta.get(f"{shape.arch}.rope.scaling.type", "linear") == "linear":
        inv_freq = inv_freq / linear_factor(meta, shape.arch)
    if "rope_freqs.weight" in index.tensors:
        inv_freq = inv_freq / vector(index, "rope_freqs.weight")
    return inv_freq


def vector(index: TensorIndex, name: str) -> Tensor:
    """A one-dimensional tensor of the file (a norm's weight, a bias) in float32, copied out of the file."""
    raw, kind = index.raw(name)
    return torch.from_numpy(np.array(dequantize(raw, kind), dtype=np.float32).reshape(-1))


def optional_vector(index: TensorIndex, name: str) -> Tensor | None:
    return vector(index, name) if name in index.tensors else None


class FileRows:
    """Rows of a GGUF matrix dequantized on lookup (`rows[token_ids]`): an untied embedding table that
    stays in the file (memory-mapped) instead of a float32 copy."""

    def __init__(self, index: TensorIndex, name: str) -> None:
        self.raw, self.kind = index.raw(name)

    def __getitem__(self, ids: Tensor) -> Tensor:
        picked = self.raw[ids.reshape(-1).cpu().numpy()]  # [n, row bytes]
        return torch.from_numpy(np.ascontiguousarray(dequantize(picked, self.kind), dtype=np.float32))


def file_linear(index: TensorIndex, names: list[str], heads: list[int | None] | None, bias: Tensor | None):
    """The tensors `names` stacked (a fused QKV or gate/up) as a llama.Linear: on their GGUF blocks where
    block kernels take them all (one packed matrix, or parts of different types stacked), else
    dequantized by the `gguf` package into float32 panels."""
    heads = heads or [None] * len(names)
    kinds = {index.tensors[name][1] for name in names}
    if all(supported(kind) for kind in kinds):
        if len(kinds) == 1:
            return block_linear(read_matrix(index, names, heads), bias)
        return stacked_linear([read_matrix(index, [name], [h]) for name, h in zip(names, heads)], bias)
    parts = [read_raw(index, name, h) for name, h in zip(names, heads)]
    weight = np.concatenate([dequantize(raw, kind) for raw, kind in parts])  # [out, in] float32
    return Linear.from_weight(torch.from_numpy(weight), bias, torch.float32, True)


def file_target(path: str | Path, max_length: int | None = None):
    """A LlamaTarget built from the GGUF file `path` alone: linear maps on the file's own blocks (Q4_0,
    Q4_1, Q8_0, Q4_K, Q6_K; other types dequantized into float32 panels), norms and biases from the
    file, a tied embedding read from the LM head's blocks and an untied one from the file on lookup.
    No transformers model is made, so memory is about the file's size plus the cache.

    Raises UnsupportedModel where the kernels are unavailable or the file is outside `file_shape`.
    """
    from specsample.models import kernels
    from specsample.models.llama import LlamaTarget, UnsupportedModel
    from specsample.models.ops import rope_tables

    if not kernels.available():
        raise UnsupportedModel("GGUF blocks need the C++ kernels")
    index = TensorIndex(path)
    shape = file_shape(index)
    check_tensors(index, shape)
    max_length = max_length or min(shape.context, DEFAULT_MAX_LENGTH)
    heads = [shape.heads, shape.kv_heads, None] if shape.arch in PERMUTED_QK else None
    layers = [file_layer(index, f"blk.{i}.", heads) for i in range(shape.layers)]
    tied = "output.weight" not in index.tensors
    lm_head = file_linear(index, ["token_embd.weight" if tied else "output.weight"], None, None)
    cos, sin = rope_tables(inverse_frequencies(index, shape), 1.0, max_length, torch.float32)
    scales = {}
    if shape.arch == "gemma3":
        layers, scales = gemma3_layers(index, shape, layers, max_length)
    return LlamaTarget(
        layers, None if tied else FileRows(index, "token_embd.weight"), vector(index, "output_norm.weight"), lm_head,
        cos, sin, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, eps=shape.eps,
        kv_dtype=KV_DTYPE, **scales,
    )


def gemma3_layers(index: TensorIndex, shape: FileShape, layers: list, max_length: int) -> tuple[list, dict]:
    """A Gemma 3 file's layers with their GELU gates, and the local ones (all but every GEMMA3_PATTERN-th)
    with the file's sliding window and their own rotary tables; and `LlamaTarget`'s attn_scale and
    embed_scale for it. Its norms, post-norms included, are read as the file stores them: its converter
    has already added Gemma's 1 to every norm weight."""
    from specsample.models.llama import inverse_sqrt
    from specsample.models.ops import rope_tables

    meta = index.metadata
    window = int(meta[f"{shape.arch}.attention.sliding_window"])
    local = rope_tables(base_frequencies(GEMMA3_LOCAL_BASE, shape.head_dim), 1.0, max_length, torch.float32)
    made = [
        replace(layer, gelu=True, window=window, rotary=local) if i % GEMMA3_PATTERN < GEMMA3_PATTERN - 1
        else replace(layer, gelu=True)
        for i, layer in enumerate(layers)
    ]
    hidden = int(meta[f"{shape.arch}.embedding_length"])
    per_head = hidden // shape.heads if shape.layers == GEMMA3_27B_LAYERS else shape.head_dim
    return made, {"attn_scale": inverse_sqrt(per_head), "embed_scale": float(torch.tensor(float(hidden)).sqrt())}


def file_layer(index: TensorIndex, p: str, heads: list[int | None] | None):
    """Decoder layer `p` ("blk.N.") of a GGUF file as a llama.Layer."""
    from specsample.models.llama import Layer

    qkv_bias = [optional_vector(index, p + f"attn_{x}.bias") for x in "qkv"]
    if qkv_bias[0] is not None and heads:
        qkv_bias = [b if h is None else b[torch.from_numpy(llama_permutation(len(b), h))] for b, h in zip(qkv_bias, heads)]
    o_bias = optional_vector(index, p + "attn_output.bias")
    return Layer(
        attn_norm=vector(index, p + "attn_norm.weight"),
        qkv=file_linear(index, [p + f"attn_{x}.weight" for x in "qkv"], heads, None if qkv_bias[0] is None else torch.cat(qkv_bias)),
        o=file_linear(index, [p + "attn_output.weight"], None, o_bias),
        mlp_norm=vector(index, p + "ffn_norm.weight"),
        gate_up=file_linear(index, [p + "ffn_gate.weight", p + "ffn_up.weight"], None, None),
        down=file_linear(index, [p + "ffn_down.weight"], None, None),
        q_norm=optional_vector(index, p + "attn_q_norm.weight"),
        k_norm=optional_vector(index, p + "attn_k_norm.weight"),
        post_attn_norm=optional_vector(index, p + "post_attention_norm.weight"),
        post_mlp_norm=optional_vector(index, p + "post_ffw_norm.weight"),
    )


def _check_rows(linear, reference: Tensor, rows: list[int], what: str) -> None:
    """Raise UnsupportedModel unless rows `rows` of a block Linear equal the transformers weight's."""
    from specsample.models.llama import UnsupportedModel

    if not linear.qtype:
        return
    ours = linear_rows(linear, torch.tensor(rows))
    if not torch.allclose(ours, reference[rows].float(), rtol=1e-6, atol=1e-7):
        raise UnsupportedModel(f"the GGUF file's {what} rows do not match the model's weights")


def gguf_target(model, path: str | Path, max_length: int | None = None):
    """`file_target` of the GGUF file `path` that the transformers `model` was converted from, checked
    against it: raises UnsupportedModel where the file's Q, K or LM head rows differ from the model's
    (a converter permutation this does not know). The target keeps `model` as its source (its int8 copy)."""
    from specsample.models.llama import UnsupportedModel, unsupported_reason

    reason = unsupported_reason(model.config)
    if reason is not None:
        raise UnsupportedModel(reason)
    target = file_target(path, max_length)
    attention = model.model.layers[0].self_attn
    q_rows, k_rows = attention.q_proj.weight.shape[0], attention.k_proj.weight.shape[0]
    reference = torch.cat([attention.q_proj.weight, attention.k_proj.weight]).detach()
    rows = [0, 1, target.head_dim // 2, q_rows - 1, q_rows + 1, q_rows + k_rows - 1]
    _check_rows(target.layers[0].qkv, reference, rows, "Q and K")
    _check_rows(target.lm_head, model.lm_head.weight.detach(), [0, 1, target.vocab_size - 1], "LM head")
    target.source = model
    return target


# The `quantized` drafter on blocks (`lower_bit_copy`): every layer matrix of more than COPY_ABOVE
# bits per weight (Q8_0, Q6_K, float) is requantized to COPY_TYPE, Q4_0, the fewest bits the block
# kernels run; matrices of 4 or 5 bits are shared with the target, since requantizing them saves
# at most a tenth of their bytes and costs much agreement (a Q4_1 layer made Q4_0 is quantized
# twice). The LM head (the tied embedding) keeps its type, as llama.cpp keeps its output tensor
# at more bits in its own low-bit files: in Q4_0 it cost the copy 5 to 10 points of greedy
# agreement with the target on SmolLM2-135M (docs/kernels-gguf.md). So a Q8_0 target drafts with
# Q4_0 layers, and a Q4_0 or Q4_1 target has no lower-bit copy (`lower_bit_copy` raises).
COPY_TYPE = GGMLQuantizationType.Q4_0
COPY_ABOVE = 6.0


def bits_per_weight(qtype: int) -> float:
    """Bits per weight of a GGML type."""
    values, block_bytes = gguf_quant_sizes(GGMLQuantizationType(qtype))
    return 8 * block_bytes / values


def lower_bits(matrix: BlockMatrix) -> BlockMatrix:
    """`matrix` requantized to COPY_TYPE if it has more than COPY_ABOVE bits per weight, else itself."""
    if bits_per_weight(matrix.qtype) <= COPY_ABOVE:
        return matrix
    return pack_blocks(quantize(matrix.dequantize().numpy(), COPY_TYPE), COPY_TYPE)


def requantized(linear):
    """`linear` with its blocks of more than COPY_ABOVE bits per weight requantized to COPY_TYPE (float32
    panels: all of it), or `linear` itself (shared) where none has."""
    from specsample.models import kernels

    if not linear.qtype:
        weight = kernels.unpack_rows(linear.weight, torch.arange(linear.out_features), linear.scales)  # [out, in]
        return block_linear(pack_blocks(quantize(weight.numpy(), COPY_TYPE), COPY_TYPE), linear.bias)
    parts = linear.parts if linear.qtype == STACKED else [as_matrix(linear)]
    lowered = [lower_bits(part) for part in parts]
    if all(a is b for a, b in zip(lowered, parts)):
        return linear
    return fused_linear(lowered, linear.bias)


# f(1) of the lower-bit copy over its target's, by the GGML type of the target's layer matrices
# (benchmarks/block_copy_cost.py: one thread's CPU time, context 200, median of 30, Intel Xeon
# AVX-512 VNNI, a nice'd run on a shared machine): a Q8_0 copy of the bundled SmolLM2-135M, whose
# Q4_0 copy streams its layers in about half the bytes but keeps the Q8_0 LM head. Targets of 4 or 5
# bits have no copy; mixed files (Q4_K_M) are not measured.
MEASURED_COPY_COST = {"Q8_0": 0.71}


# f(1) of a GGUF file's own blocks over the float32 fast target made from the same file, its `quantized`
# copy there (`drafts_on_blocks`): the bundled SmolLM2-135M Q4_1, 2.6 against 18.1 ms, context 200, Intel
# Xeon AVX-512 VNNI (family 6 model 207), 2 threads (BENCHMARKS.md); the int8 copy took 5.3 to 5.7 ms.
FILE_COPY_COST = 0.14


def drafts_on_blocks(path: str | Path) -> bool:
    """True if the GGUF file `path` can be the `quantized` copy of the float32 target made from it: a
    Llama-family file (`file_shape`) whose every layer matrix the block kernels take at no more bits
    than Q8_0, so that its own blocks stream fewer bytes than an int8 copy and compute the file's own
    weights, where an int8 copy rounds them again."""
    from specsample.models.llama import UnsupportedModel

    index = TensorIndex(path)
    try:
        file_shape(index)
    except UnsupportedModel:
        return False
    kinds = {kind for name, (dims, kind, _) in index.tensors.items() if name.startswith("blk.") and len(dims) == 2}
    most = bits_per_weight(GGMLQuantizationType.Q8_0)
    return bool(kinds) and all(supported(kind) and bits_per_weight(kind) <= most for kind in kinds)


def block_copy_cost(target) -> float | None:
    """What `lower_bit_copy` of `target` costs per target pass, as measured (MEASURED_COPY_COST), or None."""
    types = {linear.qtype for layer in target.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    if len(types) != 1 or not supported(next(iter(types))):
        return None
    return MEASURED_COPY_COST.get(GGMLQuantizationType(types.pop()).name)


def on_blocks(target) -> bool:
    """True if a LlamaTarget runs some of its linear maps on GGUF blocks."""
    return bool(target.lm_head.qtype) or any(layer.qkv.qtype for layer in target.layers)


def lower_bit_copy(target):
    """A lower-bit copy of a LlamaTarget on GGUF blocks, with its own cache: its layer matrices of more
    than COPY_ABOVE bits requantized to Q4_0 (`requantized`); the rest, the LM head, the embedding, norms
    and rotary tables shared. Raises NotOnThisBackend where no layer matrix has more bits (no cheaper copy)."""
    from specsample.models.target import NotOnThisBackend

    names = ("qkv", "o", "gate_up", "down")
    layers = [replace(layer, **{name: requantized(getattr(layer, name)) for name in names}) for layer in target.layers]
    if all(getattr(a, name) is getattr(b, name) for a, b in zip(layers, target.layers) for name in names):
        raise NotOnThisBackend(f"the target's layers have at most {COPY_ABOVE:g} bits per weight: "
                               "the GGUF block kernels have no cheaper copy of it to draft with")
    return target.with_weights(layers, target.lm_head, target.embed, kv_dtype=target.k_cache.dtype)
