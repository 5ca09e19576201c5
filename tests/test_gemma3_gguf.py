"""Gemma 3 GGUF files on the GGUF blocks (`--backend gguf`) and on llama.cpp.

A tiny random Gemma 3 (five local layers of a sliding window of 8 with rotary base 10,000 and a
global one, GELU gates, norms of each attention and MLP output, per-head query and key norms, scaled
embeddings, a tied head) is written as llama.cpp's converter writes it (`test_llamacpp.write_gguf`:
norm weights plus 1). llama.cpp scores the F32 file as transformers runs the model, 40 positions
against a window of 8, so the file is the Gemma 3 llama.cpp reads; the blocks score it so too. Its
Q8_0 copy (llama.cpp's quantizer) on the blocks is no further from the model than llama.cpp's own
logits for it; a row's logits do not depend on the other rows of its pass, trees included; and
greedy speculation on it gives plain decoding's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from specsample.drafters import DraftModelDrafter, NoDrafter
from specsample.drafters.quantized import QuantizedDrafter
from specsample.models import gguf_blocks, kernels
from specsample.models.llamacpp import LlamaCppTarget
from test_llamacpp import LOGIT_TOLERANCE, VOCAB, f32_and_q8_0, logits_after, random_ids, run

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="the GGUF blocks need the C++ kernels"),
              pytest.mark.llamacpp]  # its files are made by llama.cpp's quantizer

WINDOW = 8
GELU_TABLE_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def gemma3() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
        max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms scale by 1 + weight, the weights starting at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 1.0)
    return model


@pytest.fixture(scope="module")
def files(gemma3, tmp_path_factory) -> tuple[Path, Path]:
    """The F32 file and its Q8_0 copy."""
    return f32_and_q8_0(gemma3, tmp_path_factory.mktemp("gemma3"), "gemma3")


def reference(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids[None]).logits[0]  # [n, vocab]


def test_llama_cpp_reads_the_gemma3_file_as_transformers_runs_the_model(gemma3, files):
    """To GELU_TABLE_TOLERANCE: ggml's float32 GELU rounds its input to float16 and reads a table
    (GGML_GELU_FP16 in ggml-cpu's vec.h), so llama.cpp's logits move by up to about 4e-3 here; on the
    blocks, a model read wrong (its windows ignored, SiLU for GELU, a post-norm left out, the local
    rotary base for the global one, 1 / sqrt(head size) for its scale) moved them by 0.9 to 9."""
    ids = random_ids(40, seed=1)
    got = logits_after(LlamaCppTarget(files[0], n_threads=1, cache_type="f32"), ids, 25)
    torch.testing.assert_close(got, reference(gemma3, ids)[25:], atol=GELU_TABLE_TOLERANCE, rtol=0)


def test_the_blocks_read_the_gemma3_file_as_transformers_runs_the_model(gemma3, files, monkeypatch):
    monkeypatch.setattr(gguf_blocks, "KV_DTYPE", torch.float32)  # float32 keys and values: rounding only
    target = gguf_blocks.file_target(files[0])
    assert [layer.window for layer in target.layers] == [WINDOW] * 5 + [0]
    assert all(layer.gelu and layer.post_mlp_norm is not None for layer in target.layers)
    ids = random_ids(40, seed=1)
    expected = reference(gemma3, ids)
    torch.testing.assert_close(logits_after(target, ids, 25), expected[25:], atol=LOGIT_TOLERANCE, rtol=0)
    torch.testing.assert_close(logits_after(target, ids, 0), expected, atol=LOGIT_TOLERANCE, rtol=0)


def test_the_q8_0_gemma3_on_the_blocks_is_as_close_to_the_model_as_llama_cpp_is(gemma3, files):
    target = gguf_blocks.file_target(files[1])
    assert {layer.qkv.qtype for layer in target.layers} == {8}  # Q8_0 blocks, not a float copy
    ids = random_ids(60, seed=2)
    expected = reference(gemma3, ids)[30:]
    ours = (logits_after(target, ids, 30) - expected).abs().max()
    theirs = (logits_after(LlamaCppTarget(files[1], n_threads=1), ids, 30) - expected).abs().max()
    assert ours <= 1.25 * theirs, (float(ours), float(theirs))


def test_a_rows_logits_do_not_depend_on_the_other_rows_of_its_pass(files):
    """Bitwise, on the Q8_0 blocks past the window: each of 6 tokens scored alone equals its row of one
    pass over all 6, and a tree's node equals its path scored as a chain."""
    target = gguf_blocks.file_target(files[1])
    ids = random_ids(30, seed=3)
    together = logits_after(target, ids, 24)
    for i in range(6):
        target.rollback(24 + i)
        assert torch.equal(target.score(ids[24 + i : 25 + i])[0], together[i])
    tree, parents = torch.tensor([5, 9, 11, 13]), torch.tensor([-1, 0, 0, 2])  # root, two children, a grandchild
    target.rollback(24)
    nodes = target.score_tree(tree, parents)
    for node, path in ((1, [5, 9]), (3, [5, 11, 13])):
        target.rollback(24)
        assert torch.equal(target.score(torch.tensor(path))[-1], nodes[node])


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter", ["the F32 file", "quantized"])
def test_greedy_speculation_on_the_q8_0_gemma3_is_token_identical_to_plain_decoding(files, k, drafter):
    """Drafted by the F32 file on its blocks, or by `quantized`: the target's Q4_0 copy (`lower_bit_copy`),
    which shares the norms, windows and rotary tables."""
    target = gguf_blocks.file_target(files[1])
    prompt = random_ids(8, seed=7)
    plain = run(target, NoDrafter(), 0, prompt, 80)
    if drafter == "quantized":
        copy = target.quantized_copy()
        assert {layer.qkv.qtype for layer in copy.layers} == {2} and copy.embed_scale == target.embed_scale
        made = QuantizedDrafter(copy, target)
    else:
        made = DraftModelDrafter(gguf_blocks.file_target(files[0]))
    assert run(target, made, k, prompt, 80) == plain
