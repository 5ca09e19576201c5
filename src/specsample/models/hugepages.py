"""Arrays in transparent huge pages, for the weights the kernels stream on every pass.

A pass reads every weight once. In 4 KiB pages that is a TLB miss every 4 KiB (a two-level page
walk on a virtual machine), and the hardware prefetchers stop at each page's end. Linux backs
anonymous memory with 2 MiB pages only where the program asks (`madvise`, the usual setting of
/sys/kernel/mm/transparent_hugepage/enabled), so the large arrays are made here: 2 MiB-aligned
anonymous memory advised MADV_HUGEPAGE before it is first written. Where the kernel gives no huge
pages (setting `never`, memory too fragmented) the same memory is ordinary pages. Arrays share
regions of CHUNK bytes, each region freed when its last array goes: a layer's matrices are each
smaller than one huge page.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

import numpy as np
import torch

HUGE = 2 << 20  # bytes of a huge page on x86-64
CHUNK = 32 << 20  # bytes of a shared region; larger arrays get their own
ALIGN = 64  # bytes: a cache line, the alignment of every array


class _Chunk:
    """One region of memory advised for huge pages, handed out front to back; freed by the kernel when
    its last array goes."""

    def __init__(self, nbytes: int) -> None:
        region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory is shmem: no THP
        region.madvise(mmap.MADV_HUGEPAGE)
        whole = np.frombuffer(region, np.uint8)  # keeps `region` alive as long as any view of it
        start = -whole.ctypes.data % HUGE
        self.memory, self.used = whole[start : start + nbytes], 0

    def take(self, nbytes: int) -> np.ndarray | None:
        """The next `nbytes` bytes, or None if they do not fit."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > len(self.memory):
            return None
        self.used = start + nbytes
        return self.memory[start : start + nbytes]


_current: _Chunk | None = None
_lock = threading.Lock()  # models load in threads too (the server's)


def empty(shape: Sequence[int], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised array in memory advised for huge pages: its own 2 MiB-aligned region from
    CHUNK up, else a slice of the current shared region."""
    global _current
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    if nbytes >= CHUNK:
        return _Chunk(nbytes).memory.view(dtype).reshape(shape)
    with _lock:
        memory = _current.take(nbytes) if _current is not None else None
        if memory is None:
            _current = _Chunk(CHUNK)
            memory = _current.take(nbytes)
    return memory.view(dtype).reshape(shape)


def tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised torch tensor in memory as `empty` gives it."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(empty([nbytes], np.uint8)).view(dtype).reshape(*shape)
