"""A GGUF file's linear rotary scaling read as llama.cpp reads it, on the blocks (`--backend gguf`): a
`rope.scaling.factor` with no `rope.scaling.type` is linear scaling (llama.cpp's default type), the older
key `rope.scale_linear` is the factor where the newer is absent, and a type of "none" never scales. Such a
file had run unscaled on the blocks and scaled on llama.cpp (logits 8 apart on the bundled model's copy).
transformers' GGUF converter reads no rotary scaling at all for these architectures, so the float32 path
refuses a scaled file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from specsample.models import choice, gguf_blocks, kernels, load_model
from specsample.models.llamacpp import LlamaCppTarget
from specsample.models.target import UnsupportedModel

from conftest import tiny_llama
from test_cli import cli
from test_llamacpp import LOGIT_TOLERANCE, VOCAB, logits_after, random_ids, write_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the GGUF blocks need the C++ kernels")


def written(directory: Path, monkeypatch, keys: dict, rope_freqs: bool = False) -> tuple[LlamaForCausalLM, Path]:
    """The tiny Llama and its F32 GGUF file with the metadata `keys` (under `llama.`) added, and llama3's
    per-frequency factors (`rope_freqs.weight`, all 2) if `rope_freqs`."""
    model = tiny_llama(VOCAB, seed=0)
    add_base = gguf.GGUFWriter.add_rope_freq_base

    def with_keys(self, base):
        add_base(self, base)
        for key, value in keys.items():
            (self.add_string if isinstance(value, str) else self.add_float32)(f"llama.{key}", value)
        if rope_freqs:
            self.add_tensor("rope_freqs.weight", np.full(model.config.head_dim // 2, 2.0, np.float32))

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_rope_freq_base", with_keys)
        return model, write_gguf(model, directory / "scaled.gguf")


def scaled(model: LlamaForCausalLM, factor: float) -> LlamaForCausalLM:
    """`model` with linear rotary scaling by `factor` (1: as it is), as transformers runs it."""
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": factor} if factor != 1.0 else {
        "rope_type": "default", "rope_theta": 10000.0}
    out = LlamaForCausalLM(type(model.config)(**(model.config.to_dict() | {"rope_parameters": rope}))).eval()
    out.load_state_dict(model.state_dict())
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("keys, factor", [
    ({"rope.scaling.factor": 4.0}, 4.0),
    ({"rope.scale_linear": 4.0}, 4.0),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, 4.0),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 0.0, "rope.scale_linear": 4.0}, 1.0),
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, 1.0),
])
def test_a_linear_rope_factor_is_read_as_llama_cpp_reads_it(tmp_path, monkeypatch, keys, factor):
    model, path = written(tmp_path, monkeypatch, keys)
    monkeypatch.setattr(gguf_blocks, "KV_DTYPE", torch.float32)  # float32 keys and values: rounding only
    ids = random_ids(40, seed=1)
    with torch.inference_mode():
        expected = scaled(model, factor)(ids[None]).logits[0, 25:]  # [15, vocab]
        other = scaled(model, 1.0 if factor != 1.0 else 4.0)(ids[None]).logits[0, 25:]  # the other reading
    assert (expected - other).abs().max() > 100 * LOGIT_TOLERANCE
    llama_cpp = logits_after(LlamaCppTarget(path, n_threads=1, cache_type="f32"), ids, 25)
    torch.testing.assert_close(llama_cpp, expected, atol=LOGIT_TOLERANCE, rtol=0)
    blocks = logits_after(gguf_blocks.file_target(path), ids, 25)
    torch.testing.assert_close(blocks, expected, atol=LOGIT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("keys, rope_freqs", [({"rope.scaling.factor": 4.0}, False), ({}, True)])
def test_the_float32_path_refuses_a_file_whose_rope_scaling_its_converter_drops(tmp_path, monkeypatch, capsys, keys,
                                                                               rope_freqs):
    """A scaled file (a linear factor; a Llama 3.x file's per-frequency factors) would run unscaled on the
    float32 path: refused there in one line, and `--backend auto` chooses among the backends that read it.
    An unscaled file (type "none") converts as before."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    _, path = written(tmp_path, monkeypatch, keys, rope_freqs)
    with pytest.raises(UnsupportedModel, match="scales its rotary embedding"):
        load_model(path)
    code, _, err = cli(capsys, "generate", "ab", "--model", str(path), "--backend", "fast", "--no-chat", "--max-new-tokens", "2")
    err = err.strip()
    assert code == 2 and "\n" not in err and "scales its rotary embedding" in err, err
    backend, _ = choice.resolve(path, "auto", threads=1)
    assert backend in ("gguf", "llamacpp")
    # layer skipping on the blocks calibrates on the converted weights; the target runs the file's scaling
    code, out, err = cli(capsys, "generate", "ab", "--model", str(path), "--backend", "gguf", "--drafter", "layerskip",
                         "--no-chat", "--max-new-tokens", "2", "--threads", "1")
    assert code == 0 and out, err
    (tmp_path / "none").mkdir()
    _, unscaled = written(tmp_path / "none", monkeypatch, {"rope.scaling.type": "none", "rope.scaling.factor": 4.0})
    assert load_model(unscaled).model is not None
