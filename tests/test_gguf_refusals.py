"""A GGUF file the gguf backend cannot run as its metadata says is refused in one line (`file_target`),
never run: metadata that disagrees with the tensors' shapes (the kernels would read past a matrix and
return meaningless logits), a head larger than the kernels' stack copy (a segfault), a missing tensor,
a tensor type that neither the block kernels nor the `gguf` package read. And the kernels' build key
tells arm64 CPUs apart."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specsample.models import gguf_blocks, kernels
from specsample.models.target import UnsupportedModel

from conftest import needs_kernels, tiny_llama
from test_cli import cli
from test_llamacpp import write_gguf

VOCAB = 320  # a byte-level vocabulary holds every byte


def written(path: Path, monkeypatch, *, kv_heads: int | None = None, key_length: int | None = None,
            omit: str = "", q8_1: str = "") -> Path:
    """The tiny Llama (4 heads, 2 KV heads of 8) as an F32 GGUF file with one thing wrong: the KV head count
    or key length in the metadata, a tensor left out, or a tensor written as Q8_1 (random bytes)."""
    add_tensor, add_kv, add_key = gguf.GGUFWriter.add_tensor, gguf.GGUFWriter.add_head_count_kv, gguf.GGUFWriter.add_key_length

    def tensor(self, name, data, *args, **kwargs):
        if name == q8_1:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            data = np.random.default_rng(0).integers(0, 256, (data.shape[0], data.shape[1] // block * size), np.uint8)
            return add_tensor(self, name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        if name != omit:
            add_tensor(self, name, data, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", tensor)
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv", lambda self, n: add_kv(self, kv_heads or n))
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_length", lambda self, n: add_key(self, key_length or n))
    try:
        return write_gguf(tiny_llama(VOCAB, seed=0), path)
    finally:
        monkeypatch.undo()


@needs_kernels
@pytest.mark.parametrize("wrong, error, message", [
    ({}, None, ""),
    ({"kv_heads": 4}, ValueError, "tensor 'blk.0.attn_k.weight' is [32, 16], the metadata says [32, 32]"),
    ({"key_length": 1040}, UnsupportedModel, "a head of 1040 dimensions is more than the kernels' 1024"),
    ({"omit": "blk.1.ffn_norm.weight"}, ValueError, "no tensor 'blk.1.ffn_norm.weight'"),
    ({"q8_1": "blk.0.attn_v.weight"}, UnsupportedModel, "tensor 'blk.0.attn_v.weight' is of GGML type Q8_1"),
])
def test_a_file_its_metadata_does_not_describe_is_refused_in_one_line(tmp_path, monkeypatch, wrong, error, message):
    path = written(tmp_path / "model.gguf", monkeypatch, **wrong)
    if error is None:
        assert gguf_blocks.file_target(path).vocab_size == VOCAB  # the writer's file itself is fine
        return
    with pytest.raises(error) as refused:
        gguf_blocks.file_target(path)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@needs_kernels
def test_the_cli_refuses_a_truncated_file_with_exit_code_2(capsys, tmp_path, monkeypatch):
    path = written(tmp_path / "model.gguf", monkeypatch, omit="blk.0.ffn_down.weight")
    code, _, err = cli(capsys, "generate", "--model", str(path), "--backend", "gguf", "--no-chat", "--k", "0", "ab")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no tensor 'blk.0.ffn_down.weight'" in err


ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd {extra}\nCPU implementer\t: 0x41\nCPU part\t: {part}\n"


def test_the_build_key_tells_arm64_cpus_apart(monkeypatch):
    """arm64's /proc/cpuinfo has no model name or flags: its implementer, part and features are the key."""
    ids = []
    for extra, part in [("asimddp", "0xd0c"), ("asimddp sve i8mm", "0xd40")]:
        monkeypatch.setattr(Path, "read_text", lambda self, *args, **kwargs: ARM.format(extra=extra, part=part))
        ids.append(kernels._cpu_id())
    monkeypatch.undo()
    assert ids[0] != ids[1] and "0xd40" in ids[1] and "sve" in ids[1]
