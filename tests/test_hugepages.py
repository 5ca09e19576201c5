"""Arrays the kernels stream live in memory advised for transparent huge pages (models/hugepages.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from specsample.models import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def eligible(address: int) -> bool:
    """Whether the kernel would back the mapping holding `address` with huge pages (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arrays_are_aligned_writable_and_do_not_overlap():
    small = [hugepages.empty((1000 + i, 3), np.float32) for i in range(50)]
    for i, array in enumerate(small):
        assert array.ctypes.data % hugepages.ALIGN == 0 and array.flags.writeable
        array[...] = i
    assert all((array == i).all() for i, array in enumerate(small))  # no array wrote into another
    large = hugepages.empty((hugepages.CHUNK // 4 + 5,), np.float32)
    assert large.ctypes.data % hugepages.HUGE == 0


def test_an_array_outlives_the_others_of_its_region():
    kept = hugepages.empty((256, 256), np.uint8)
    kept[...] = 7
    others = [hugepages.empty((256, 256), np.uint8) for _ in range(20)]
    del others
    gc.collect()
    assert (kept == 7).all()


def test_tensors_share_the_memory_and_take_any_dtype():
    t = hugepages.tensor((3, 5, 7), torch.float16)
    t.fill_(1.5)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float16 and t.is_contiguous() and float(t.sum()) == 1.5 * 105
    assert hugepages.tensor((2, 4), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off")
def test_the_memory_is_advised_for_huge_pages():
    for shape in [(1000,), (hugepages.CHUNK + 1,)]:
        array = hugepages.empty(shape, np.uint8)
        assert eligible(array.ctypes.data)
    assert not eligible(np.empty(1000, np.uint8).ctypes.data) or "[always]" in THP.read_text()
