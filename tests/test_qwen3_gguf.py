"""Qwen3 GGUF files on the GGUF blocks (`--backend gguf`, where speculation pays on a CPU) and on llama.cpp.

A tiny random Qwen3 (a norm of each query and key head before the rotation, a head size other than
hidden / heads, a tied head) is written as llama.cpp's converter writes it (`test_llamacpp.write_gguf`).
llama.cpp scores the F32 file as transformers scores the model, so the file is the Qwen3 llama.cpp
reads; the blocks score it so too. Its Q8_0 copy, made by llama.cpp's quantizer, scores on the blocks
no further from the model than llama.cpp's own logits for it, and greedy speculation on it gives plain
decoding's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from specsample.defaults import default_configuration
from specsample.drafters import DraftModelDrafter, NoDrafter
from specsample.drafters.quantized import QuantizedDrafter
from specsample.models import gguf_blocks, kernels
from specsample.models.llamacpp import LlamaCppTarget
from conftest import needs_kernels
from test_llamacpp import LOGIT_TOLERANCE, VOCAB, f32_and_q8_0, logits_after, random_ids, run

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="the GGUF blocks need the C++ kernels"),
              pytest.mark.llamacpp]  # its files are made by llama.cpp's quantizer

@pytest.fixture(scope="module")
def qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.3,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts the per-head norms at one: make them matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    return model


@pytest.fixture(scope="module")
def files(qwen3, tmp_path_factory) -> tuple[Path, Path]:
    """The F32 file and its Q8_0 copy."""
    return f32_and_q8_0(qwen3, tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_llama_cpp_reads_the_qwen3_file_as_transformers_runs_the_model(qwen3, files):
    ids = random_ids(40, seed=1)
    with torch.inference_mode():
        expected = qwen3(ids[None]).logits[0]  # [40, vocab]
    got = logits_after(LlamaCppTarget(files[0], n_threads=1, cache_type="f32"), ids, 25)
    torch.testing.assert_close(got, expected[25:], atol=LOGIT_TOLERANCE, rtol=0)


def test_the_blocks_read_the_qwen3_file_as_transformers_runs_the_model(qwen3, files, monkeypatch):
    monkeypatch.setattr(gguf_blocks, "KV_DTYPE", torch.float32)  # float32 keys and values: rounding only
    target = gguf_blocks.file_target(files[0])
    assert target.head_dim == 32 and all(layer.q_norm is not None for layer in target.layers)
    ids = random_ids(40, seed=1)
    with torch.inference_mode():
        expected = qwen3(ids[None]).logits[0]
    torch.testing.assert_close(logits_after(target, ids, 25), expected[25:], atol=LOGIT_TOLERANCE, rtol=0)
    torch.testing.assert_close(logits_after(target, ids, 0)[:3], expected[:3], atol=LOGIT_TOLERANCE, rtol=0)


def test_the_q8_0_qwen3_on_the_blocks_is_as_close_to_the_model_as_llama_cpp_is(qwen3, files):
    """The Q8_0 copy's weights are rounded (random weights of scale 0.3: logits move by about 0.5), and
    llama.cpp rounds its activations and attention otherwise than the blocks do, so the two sides
    differ from each other about as much as from the model; what is checked is that the blocks are no
    further from the model's own logits than llama.cpp is."""
    target = gguf_blocks.file_target(files[1])
    assert {layer.qkv.qtype for layer in target.layers} == {8}  # Q8_0 blocks, not a float copy
    ids = random_ids(60, seed=2)
    with torch.inference_mode():
        expected = qwen3(ids[None]).logits[0, 30:]  # [30, vocab]
    ours = (logits_after(target, ids, 30) - expected).abs().max()
    theirs = (logits_after(LlamaCppTarget(files[1], n_threads=1), ids, 30) - expected).abs().max()
    assert ours <= 1.25 * theirs, (float(ours), float(theirs))


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter", ["the F32 file", "quantized"])
def test_greedy_speculation_on_the_q8_0_qwen3_is_token_identical_to_plain_decoding(files, k, drafter):
    """Drafted by the F32 file on its blocks, or by `quantized`: the target's Q4_0 copy (`lower_bit_copy`),
    which shares the per-head norms."""
    target = gguf_blocks.file_target(files[1])
    prompt = random_ids(8, seed=7)
    plain = run(target, NoDrafter(), 0, prompt, 80)
    if drafter == "quantized":
        copy = target.quantized_copy()
        assert {layer.qkv.qtype for layer in copy.layers} == {2} and copy.layers[0].q_norm is target.layers[0].q_norm
        made = QuantizedDrafter(copy, target)
    else:
        made = DraftModelDrafter(gguf_blocks.file_target(files[0]))
    assert run(target, made, k, prompt, 80) == plain


@needs_kernels  # the default configuration drafts with a quantized copy where the kernels run
def test_the_f32_file_drafts_with_an_int8_copy_of_its_own_weights(files):
    """A float GGUF file on the blocks has no lower-bit blocks and no transformers model behind it: its
    quantized copy is an int8 copy of its own weights, so the default configuration (`suffix+quantized`)
    can be made, and its greedy output is plain decoding's."""
    target = gguf_blocks.file_target(files[0])
    assert default_configuration(target).drafter == "suffix+quantized"
    prompt = random_ids(8, seed=7)
    plain = run(target, NoDrafter(), 0, prompt, 40)
    assert run(target, QuantizedDrafter(target.quantized_copy(), target), 4, prompt, 40) == plain
