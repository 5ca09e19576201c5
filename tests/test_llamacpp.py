"""The llamacpp backend: tiny random Llama GGUF files written here, run by llama.cpp.

`write_gguf` writes a transformers Llama's float32 weights as an F32 GGUF file the way
llama.cpp's converter does (Q and K rows permuted for its rotary layout), with a
byte-level BPE vocabulary, so the same weights run in both and their logits can be
compared. The bundled model checks a batched pass of 16 tokens (a bad build dies
there) and batch invariance on a real quantized file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

import test_lossless
from conftest import tiny_llama
from specsample.drafters import DraftModelDrafter, NoDrafter
from specsample.drafters.quantized import QuantizedDrafter
from specsample.engine import decode
from specsample.models import load_target, make_target
from specsample.models.llamacpp import (N_BATCH, PREFILL_ROWS, DecodeBatch, LlamaCppTarget, batch_invariant_build,
                                        quantize, reads_instead_of_mapping, repack_is_batch_invariant, repacking_x86,
                                        requested_variant, system_info)
from specsample.models.loading import bundled_gguf, load_model
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats

pytestmark = pytest.mark.llamacpp  # skipped without llama-cpp-python (conftest.py)

VOCAB = 320  # 256 byte tokens, 63 merges, one end-of-text token
GREEDY = SamplingParams(temperature=0)
LOGIT_TOLERANCE = 1e-4  # F32 file, F32 KV cache: llama.cpp and transformers differ by float32 rounding only
F16_CACHE_TOLERANCE = 0.1  # the default F16 KV cache rounds keys and values (logits here reach about 12)


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """Tokens and merges of a byte-level BPE vocabulary of `vocab_size` tokens, the last one
    <|endoftext|>: the 256 byte symbols, then merges of letter pairs ("a b" -> "ab")."""
    symbols = list(bytes_to_unicode().values())  # the 256 byte symbols, in byte order
    n_merges = max(vocab_size - 1 - len(symbols), 0)
    pairs = [(a, b) for a in "abcdefgh" for b in "abcdefgh"][:n_merges]
    tokens = (symbols + [a + b for a, b in pairs])[: vocab_size - 1] + ["<|endoftext|>"]
    return tokens, [f"{a} {b}" for a, b in pairs] or ["a b"]


def permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Q or K projection rows [n_head * head_dim, in] from transformers' rotary layout (halves)
    to llama.cpp's (adjacent pairs), as llama.cpp's convert_hf_to_gguf.py does."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# Gemma 3's tensors where they are named otherwise than a Llama's (its pre-MLP norm is transformers'
# pre_feedforward_layernorm, and post_attention_layernorm is a norm of the attention's output).
GEMMA3_NAMES = {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def add_f32_vocabulary(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """An F32 file's type and a byte-level vocabulary of `vocab_size` tokens (`byte_level_vocab`), its last
    token both the beginning and the end of a text."""
    tokens, merges = byte_level_vocab(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)


def write_gguf(model, path: Path) -> Path:
    """`model`'s float32 weights and a byte-level vocabulary as an F32 GGUF file of its architecture,
    llama, qwen3 or gemma3, as llama.cpp's converter writes it: a Llama's Q and K rows permuted, the
    others' not, with per-head query and key norms and a head size that need not be hidden / heads;
    Gemma 3's norm weights plus 1 (Gemma scales by 1 + weight) and its sliding window."""
    config = model.config
    arch = {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_f32_vocabulary(writer, config.vocab_size)
    names = {
        "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output", "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", **(GEMMA3_NAMES if arch == "gemma3" else {}),
    }
    permuted = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        parts = name.removeprefix("model.").removesuffix(".weight")
        data = tensor.detach().float().numpy()
        if arch == "gemma3" and parts.endswith("norm"):
            data = data + 1
        if parts == "lm_head" and config.tie_word_embeddings:
            continue
        if parts.startswith("layers."):
            _, layer, rest = parts.split(".", 2)
            if arch == "llama" and rest in permuted:
                data = permute_rotary(data, permuted[rest])
            writer.add_tensor(f"blk.{layer}.{names[rest]}.weight", np.ascontiguousarray(data))
        else:
            writer.add_tensor(f"{names[parts]}.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def f32_and_q8_0(model, directory: Path, name: str) -> tuple[Path, Path]:
    """`model` as an F32 GGUF file (`write_gguf`) and its Q8_0 copy made by llama.cpp's quantizer."""
    f32 = write_gguf(model, directory / f"{name}-f32.gguf")
    return f32, quantize(f32, directory / f"{name}-q8_0.gguf", "Q8_0", threads=1)


def logits_after(target, ids: torch.Tensor, cached: int) -> torch.Tensor:
    """Logits [len(ids) - cached, vocab] of ids[cached:] scored in one pass after a prefill of ids[:cached]."""
    target.prefill(ids[:cached])
    return target.score(ids[cached:])


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, seed=0)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> Path:
    return write_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_target(tiny_gguf) -> LlamaCppTarget:
    return LlamaCppTarget(tiny_gguf, n_threads=1)


def random_ids(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cache_type, tolerance", [("f32", LOGIT_TOLERANCE), ("f16", F16_CACHE_TOLERANCE)])
def test_logits_match_transformers_on_the_same_weights(tiny_model, tiny_gguf, cache_type, tolerance):
    target = LlamaCppTarget(tiny_gguf, n_threads=1, cache_type=cache_type)
    ids = random_ids(40, seed=1)
    with torch.inference_mode():
        expected = tiny_model(ids[None]).logits[0]  # [40, vocab]
    target.prefill(ids[:25])
    got = target.score(ids[25:])  # [15, vocab]
    assert got.shape == (15, VOCAB) and got.dtype == torch.float32
    assert target.length == 40
    torch.testing.assert_close(got, expected[25:], atol=tolerance, rtol=0)
    target.prefill(ids[:0])
    torch.testing.assert_close(target.score(ids[:3]), expected[:3], atol=tolerance, rtol=0)


def test_rollback_then_scoring_again_gives_the_same_logits(tiny_target):
    ids = random_ids(30, seed=2)
    tiny_target.prefill(ids[:20])
    first = tiny_target.score(ids[20:])  # [10, vocab]
    tiny_target.rollback(23)
    assert tiny_target.length == 23
    other = tiny_target.score(random_ids(5, seed=3))  # rejected positions overwrite the rolled-back ones
    tiny_target.rollback(23)
    again = tiny_target.score(ids[23:])  # [7, vocab]
    assert not torch.equal(other[0], again[0])
    assert torch.equal(again, first[3:])
    for wrong in (-1, 31):  # as every backend: a length the cache does not hold is refused, and nothing moves
        with pytest.raises(ValueError, match=f"cannot roll back to {wrong}: the cache holds 30"):
            tiny_target.rollback(wrong)
    assert tiny_target.length == 30


def scored_one_by_one_and_batched(target: LlamaCppTarget, prefix: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of `ids` after `prefix`, scored one position per pass [n, vocab], and scored in
    one pass of n tokens for every n in 2..len(ids) (each [n, vocab])."""
    target.prefill(prefix)
    alone = torch.cat([target.score(ids[i : i + 1]) for i in range(len(ids))])
    batched = []
    for n in range(2, len(ids) + 1):
        target.rollback(len(prefix))
        batched.append(target.score(ids[:n]))
    return alone, batched


def assert_batch_invariant(alone: torch.Tensor, batched: list[torch.Tensor]) -> None:
    """Each batch's logits bitwise equal to its positions' logits scored alone."""
    for logits in batched:
        assert torch.equal(logits, alone[: len(logits)])


def test_a_position_has_the_same_logits_alone_and_in_a_batch(tiny_target):
    alone, batched = scored_one_by_one_and_batched(tiny_target, random_ids(9, seed=4), random_ids(16, seed=5))
    assert_batch_invariant(alone, batched)


@pytest.fixture(scope="module")
def bundled_target() -> LlamaCppTarget:
    # One thread: pytest runs two workers on two cores, and llama.cpp's OpenMP threads spin
    # badly when they outnumber the free cores. Invariance with 2 threads: docs/llamacpp-backend.md.
    return LlamaCppTarget(bundled_gguf(), n_threads=1)


# What a variant named in SPECSAMPLE_LLAMACPP_VARIANT must show: (a feature it has, a feature it has not).
VARIANT_FEATURES = {"haswell": ("AVX2", "AVX512"), "sse42": ("SSSE3", "AVX"), "skylakex": ("AVX512", "AVX512_VNNI")}


def test_the_cpu_backend_matches_this_cpu():
    """The build dispatches at run time: the CPU backend loaded uses this CPU's widest vectors, or is
    the variant SPECSAMPLE_LLAMACPP_VARIANT names (tests/test_llamacpp_variants.py runs this file so)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    info = system_info()
    variant = requested_variant()
    if variant:
        has, lacks = VARIANT_FEATURES[variant]
        assert has in info.split() and lacks not in info.split(), info
    elif "avx512f" in flags:
        assert "AVX512" in info.split(), info
    elif "avx2" in flags:
        assert "AVX2" in info.split() and "AVX512" not in info.split(), info


@pytest.mark.parametrize("context", [12, 600])  # from 512 cached positions upstream flash attention splits one token's pass
def test_bundled_model_batched_pass_of_16_tokens_is_batch_invariant(bundled_target, context):
    """A batched pass of 16 tokens on the bundled Q4_1 file (the pass a bad build crashed in),
    and each position's logits bitwise equal to scoring it alone, for batches of 2..16."""
    assert bundled_target.vocab_size == 49152
    prefix = random_ids(context, seed=8, vocab=49152)
    alone, batched = scored_one_by_one_and_batched(bundled_target, prefix, random_ids(16, seed=6, vocab=49152))
    assert torch.isfinite(batched[-1]).all() and batched[-1].shape == (16, 49152)
    assert_batch_invariant(alone, batched)


def fill_engine_parts(target, ids):
    from specsample import engine

    assert engine.prefill(target, ids, lambda: False)


def fill_uneven_parts(target, ids):
    target.prefill(ids[:100])
    target.extend(ids[100:300])
    target.extend(ids[300:301])
    target.extend(ids[301:])


def fill_after_rolling_back_into_the_prompt(target, ids):
    target.prefill(ids)
    target.score(ids[:5])  # scored positions after the prompt, then dropped with part of the prompt
    target.rollback(470)
    target.extend(ids[470:])


def fill_by_rolling_a_longer_prompt_back(target, ids):
    target.prefill(torch.cat([ids, random_ids(100, seed=10, vocab=49152)]))  # its block [512, 768) decoded whole
    target.rollback(len(ids))


@pytest.mark.parametrize("fill", [fill_engine_parts, fill_uneven_parts, fill_after_rolling_back_into_the_prompt,
                                  fill_by_rolling_a_longer_prompt_back])
def test_a_prompt_filled_in_parts_gives_the_logits_of_one_prefill(bundled_target, fill):
    """A prompt is decoded in blocks of PREFILL_ROWS positions, one pass each, which take the tiled kernels;
    whoever fills it (a server's request in parts of engine.PREFILL_PART, asking between parts whether its
    client has gone; parts cut anywhere; an extend after a rollback into the prompt; a longer prompt rolled
    back into a block) the next token's logits are bitwise those after one prefill."""
    ids = random_ids(2 * PREFILL_ROWS + 45, seed=9, vocab=49152)
    expected = logits_after(bundled_target, ids, len(ids) - 1).clone()
    fill(bundled_target, ids[:-1])
    assert torch.equal(bundled_target.score(ids[-1:]), expected)


def test_a_prompt_runs_in_blocks_and_scores_below_64_rows(bundled_target, monkeypatch):
    """What each `llama_decode` holds: a 700-token prompt two blocks of 256 and its tail [512, 700); an extend
    of 30 nothing (the block is not complete, and its first positions are pending again); a score of 70 first
    the block's tail [512, 730) as one pass, then two passes below 64. A prompt filled 32 positions a call
    after a first block decodes each position once."""
    rows = []
    run = DecodeBatch.run

    def recorded(self, *args, **kwargs):
        rows.append(self.n)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DecodeBatch, "run", recorded)
    ids = random_ids(800, seed=3, vocab=49152)
    bundled_target.prefill(ids[:700])
    bundled_target.extend(ids[700:730])
    assert rows == [PREFILL_ROWS, PREFILL_ROWS, 188] and bundled_target.length == 730
    bundled_target.score(ids[730:800])
    assert rows == [PREFILL_ROWS, PREFILL_ROWS, 188, 218, N_BATCH, 7] and bundled_target.length == 800
    rows.clear()
    bundled_target.prefill(ids[:PREFILL_ROWS])
    for at in range(PREFILL_ROWS, 608, 32):
        bundled_target.extend(ids[at : at + 32])
    bundled_target.score(ids[608:609])
    assert rows == [PREFILL_ROWS, PREFILL_ROWS, 608 - 2 * PREFILL_ROWS, 1]


def test_a_pass_of_64_rows_or_more_is_batch_invariant(bundled_target):
    """From 64 rows llama.cpp's flash attention and K-quant products tile the pass with other kernels (max
    |logit difference| 0.96 here): `score` runs passes of at most N_BATCH = 63 rows, so a
    verification pass of K + 1 = 70 still gives each position's logits alone (greedy output at any K)."""
    prefix, ids = random_ids(20, seed=8, vocab=49152), random_ids(70, seed=6, vocab=49152)
    bundled_target.prefill(prefix)
    batched = bundled_target.score(ids).clone()  # [70, vocab]
    bundled_target.rollback(20)
    alone = torch.cat([bundled_target.score(ids[i : i + 1]).clone() for i in range(len(ids))])
    assert torch.equal(batched, alone)


@pytest.mark.parametrize("context", [509, 600])  # 509: the passes' cache views are padded to 512 or 768 cells
def test_two_threads_over_a_long_cache_are_batch_invariant(context):
    """The promise where upstream's flash attention breaks it: two threads, over 512 cached
    positions, where it splits a single token's pass over the cache and not a batch's."""
    target = LlamaCppTarget(bundled_gguf(), n_threads=2)
    alone, batched = scored_one_by_one_and_batched(target, random_ids(context, seed=8, vocab=49152), random_ids(6, seed=6, vocab=49152))
    assert_batch_invariant(alone, batched)


def test_the_build_is_patched_for_batch_invariance():
    """scripts/install.sh patches llama.cpp (flash attention, the tiled K-quant products), and the
    backend finds the patch's marker, so it turns flash attention on."""
    assert batch_invariant_build()


@pytest.mark.parametrize("file_type, repacked", [("Q4_K_M", False), ("Q4_0", True)])
def test_quantized_copies_are_batch_invariant(tmp_path, file_type, repacked):
    """Copies of the bundled model. Q4_K_M: upstream's tiled K-quant products take batches from 8 rows
    (max |logit difference| 0.7 to 0.9 against the same positions alone; the patch starts them at 64),
    and its repacked Q4_K layout is batch-dependent too, so it runs unrepacked. Q4_0: its repacked
    layout (gemm for 4 rows at a time, gemv for the rest) is batch invariant, and the backend uses it
    on an x86 CPU without AMX (on one with AMX it runs unrepacked: `repacking_x86`)."""
    repacked = repacked and repacking_x86()
    path = quantize(bundled_gguf(), tmp_path / f"{file_type}.gguf", file_type, threads=2)
    assert repack_is_batch_invariant(path) == repacked
    assert reads_instead_of_mapping(path) == repacked  # its pages would stay resident beside the repacked copy
    target = LlamaCppTarget(path, n_threads=2)
    alone, batched = scored_one_by_one_and_batched(target, random_ids(30, seed=8, vocab=49152), random_ids(16, seed=6, vocab=49152))
    assert_batch_invariant(alone, batched)


def test_flash_attention_splits_the_cache_over_the_threads():
    """Why the two-thread test over a long cache is not vacuous: two threads split each row's pass
    over the cache, so their logits differ from one thread's in rounding."""
    prefix, ids = random_ids(600, seed=8, vocab=49152), random_ids(4, seed=6, vocab=49152)
    logits = []
    for threads in (1, 2):
        target = LlamaCppTarget(bundled_gguf(), n_threads=threads)
        target.prefill(prefix)
        logits.append(target.score(ids))
    assert not torch.equal(logits[0], logits[1])
    assert (logits[0] - logits[1]).abs().max() < 2.0  # rounding, not a bug; enough to flip a near-tie


def test_tokenizer_only_loading_gives_the_tokenizer_and_a_llamacpp_target(tiny_gguf):
    loaded, target = load_target(str(tiny_gguf), "llamacpp", threads=1)
    assert loaded.model is None and loaded.gguf == tiny_gguf
    assert len(loaded.tokenizer) == VOCAB and loaded.eos_token_ids == frozenset({VOCAB - 1})
    ids = loaded.tokenizer("abba cafe")["input_ids"]
    assert loaded.tokenizer.decode(ids) == "abba cafe"
    assert isinstance(target, LlamaCppTarget) and target.vocab_size == VOCAB and target.n_threads == 1
    with pytest.raises(ValueError, match="needs the model's weights"):
        make_target(loaded, "fast")


def test_bundled_tokenizer_only_matches_the_full_load():
    assert load_model(tokenizer_only=True).eos_token_ids == load_model().eos_token_ids


@pytest.mark.parametrize("content", [b"not a gguf file at all", b"GGUF\x03\x00\x00\x00truncated"])
def test_a_file_llama_cpp_cannot_load_is_a_one_line_value_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="llama.cpp cannot load") as raised:
        load_target(str(path), "llamacpp")
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="is a directory"):
        load_target(str(tmp_path), "llamacpp")


def run(target, drafter, k: int, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    steps = decode(
        target, drafter, FixedK(k), prompt, GREEDY, max_new_tokens=max_new_tokens,
        eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=Stats(),
    )
    return [t for step in steps for t in step]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_is_token_identical_to_plain_decoding(tiny_target, tmp_path, k):
    prompt = random_ids(8, seed=7)
    plain = run(tiny_target, NoDrafter(), 0, prompt, 100)
    draft = LlamaCppTarget(write_gguf(tiny_llama(VOCAB, seed=1), tmp_path / "draft.gguf"), n_threads=1)
    assert run(tiny_target, DraftModelDrafter(draft), k, prompt, 100) == plain


@pytest.fixture(scope="module")
def lossless_gguf(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    """test_lossless's target model (vocabulary 16) as a GGUF file, and the model."""
    model = tiny_llama(test_lossless.VOCAB, seed=0, init_scale=test_lossless.INIT_SCALE)
    return write_gguf(model, tmp_path_factory.mktemp("lossless") / "target.gguf"), model


@pytest.mark.parametrize("name", ["t1"])  # the other transforms are covered by test_lossless; ~2 min each here
def test_speculative_sampling_on_llamacpp_matches_the_target_distribution(lossless_gguf, monkeypatch, name):
    """test_lossless's chi-square test with the target run by llama.cpp and a point-mass drafter
    (the draft model's argmax), against the exact distribution of the same weights."""
    path, model = lossless_gguf
    target = LlamaCppTarget(path, n_threads=1)
    as_target = test_lossless.as_target
    monkeypatch.setattr(test_lossless, "as_target", lambda m: target if m is model else as_target(m))
    draft_model = test_lossless.noisy_copy(model, scale=0.1, seed=1)
    params = test_lossless.PARAMS[name]
    drafter = test_lossless.make_drafter("point-mass", draft_model)
    observed = test_lossless.sampled_counts(model, drafter, params, seed=1234)
    p = test_lossless.chi_square_p(observed, test_lossless.exact_distribution(model, params))
    assert p > test_lossless.ALPHA, f"{name}: p = {p:.2e}"


@pytest.mark.parametrize("kind", ["draft-model", "quantized"])
def test_drafts_with_probabilities_on_llamacpp_keep_the_target_distribution(lossless_gguf, tmp_path, monkeypatch, kind):
    """test_lossless's chi-square test (t = 1) with target and drafter both run by llama.cpp, the drafter
    drawing its tokens from its own distribution: a noisy copy of the weights written as another GGUF
    file (about 0.6 of its tokens accepted, so recovered tokens are drawn from the residual often), or
    `quantized`, the target's Q8_0 copy made by llama.cpp's quantizer."""
    path, model = lossless_gguf
    target = LlamaCppTarget(path, n_threads=1)
    as_target = test_lossless.as_target
    monkeypatch.setattr(test_lossless, "as_target", lambda m: target if m is model else as_target(m))
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    if kind == "draft-model":
        noisy = write_gguf(test_lossless.noisy_copy(model, scale=0.1, seed=1), tmp_path / "draft.gguf")
        drafter = DraftModelDrafter(LlamaCppTarget(noisy, n_threads=1))
    else:
        drafter = QuantizedDrafter(target.quantized_copy(), target)
    params = test_lossless.PARAMS["t1"]
    observed = test_lossless.sampled_counts(model, drafter, params, seed=1234)
    p = test_lossless.chi_square_p(observed, test_lossless.exact_distribution(model, params))
    assert p > test_lossless.ALPHA, f"{kind}: p = {p:.2e}"


def write_mamba(path: Path, embd: int = 32, layers: int = 2, inner: int = 64, state: int = 8, conv: int = 4,
                rank: int = 4, seed: int = 0) -> Path:
    """A random Mamba (a recurrent state-space model, no attention) as an F32 GGUF file with the byte-level
    vocabulary of `write_gguf`, in the tensor shapes llama.cpp's loader asks for (src/models/mamba.cpp)."""
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_context_length(256)
    writer.add_embedding_length(embd)
    writer.add_block_count(layers)
    writer.add_ssm_conv_kernel(conv)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(state)
    writer.add_ssm_time_step_rank(rank)
    writer.add_layer_norm_rms_eps(1e-5)
    add_f32_vocabulary(writer, VOCAB)
    writer.add_tensor("token_embd.weight", weights(VOCAB, embd))
    writer.add_tensor("output_norm.weight", np.ones(embd, np.float32))
    for i in range(layers):  # numpy shapes: llama.cpp's, reversed
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, np.float32))
        writer.add_tensor(f"blk.{i}.ssm_in.weight", weights(2 * inner, embd))
        writer.add_tensor(f"blk.{i}.ssm_conv1d.weight", weights(inner, conv))
        writer.add_tensor(f"blk.{i}.ssm_conv1d.bias", weights(inner))
        writer.add_tensor(f"blk.{i}.ssm_x.weight", weights(rank + 2 * state, inner))
        writer.add_tensor(f"blk.{i}.ssm_dt.weight", weights(inner, rank))
        writer.add_tensor(f"blk.{i}.ssm_dt.bias", weights(inner))
        writer.add_tensor(f"blk.{i}.ssm_a", -np.exp(weights(inner, state)))
        writer.add_tensor(f"blk.{i}.ssm_d", np.ones(inner, np.float32))
        writer.add_tensor(f"blk.{i}.ssm_out.weight", weights(embd, inner))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_recurrent_model_decodes_plainly_and_refuses_drafters(tmp_path, monkeypatch):
    """A Mamba file: llama.cpp keeps its state, not positions, so a rejected draft token could not be taken
    back. Its default is plain decoding (each token llama.cpp's argmax after the text so far, with the
    backend chosen for it: the transformers backend refuses a recurrent state), a drafter is refused in
    one line, and its cost can still be measured (the cache filled again where it cannot roll back)."""
    from specsample.api import SpecSampler
    from specsample.cost_curve import measure_synthetic
    from specsample.models.target import NotOnThisBackend

    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    path = write_mamba(tmp_path / "mamba.gguf")
    sampler = SpecSampler.load(str(path))
    assert sampler.backend == "llamacpp" and sampler.configuration.drafter == "none"
    assert "cannot be rolled back" in sampler.configuration.reason
    out = sampler.generate("abc", chat=False, temperature=0, max_new_tokens=8)
    target, ids = sampler.target, sampler.encode("abc", chat=False)
    expected: list[int] = []
    for _ in range(8):  # each token from a cache filled anew with the text before it
        context = torch.tensor(ids + expected)
        expected.append(int(logits_after(target, context, len(context) - 1)[-1].argmax()))
    assert out.token_ids == expected
    with pytest.raises(NotOnThisBackend, match="llama.cpp keeps only a state for this recurrent model: use --drafter none"):
        SpecSampler.load(str(path), "suffix", backend="llamacpp")
    (curve,) = measure_synthetic({"mamba": target}, 16, ns=(1, 4), repeats=2)
    assert all(ms > 0 for ms in curve.ms)
    long = LlamaCppTarget(path, n_threads=1, max_length=700)  # a prompt filled in parts cut inside its blocks
    ids = random_ids(600, seed=2)
    expected = logits_after(long, ids, 599).clone()
    long.prefill(ids[:100])
    long.extend(ids[100:300])
    long.extend(ids[300:599])
    assert torch.equal(long.score(ids[599:]), expected)
