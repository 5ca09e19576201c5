"""The C++ kernels on every instruction set this machine can run: AVX-512, AVX2, portable.

Each build is loaded side by side in this process (its own cache key) and swapped
in for `kernels._library`, so an AVX-512 machine tests the AVX2 and portable
register blocking too. Products must match a float64 reference for 1 to 16 rows,
with float32 and int8 weights; and a row's result must be bitwise the same
whatever the number of rows in the pass, in a matrix product and through a whole
model, which is what keeps greedy speculative output token-identical to plain
decoding on this backend.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from specsample.models import kernels
from specsample.models.llama import LlamaTarget
from specsample.models.quantize import int8_target


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split()[2:])


FLAGS = cpu_flags()
ISAS = {"native": None, "avx2": "avx2" if "avx2" in FLAGS and "fma" in FLAGS else "portable", "portable": "portable"}


@pytest.fixture(params=list(ISAS))
def isa(request, monkeypatch) -> str:
    """Run a test with the kernels built for one instruction set; returns the one it was built for."""
    lib = kernels._load(request.param)
    if lib is None:
        pytest.skip("the kernels could not be built here")
    monkeypatch.setattr(kernels, "_library", lambda: lib)
    built = kernels.instruction_set()
    expected = ISAS[request.param]
    if expected is not None:
        assert built == expected
    return built


@pytest.fixture
def fresh_library():
    """`kernels._library` read again from the environment, and again after the test."""
    kernels._library.cache_clear()
    yield
    kernels._library.cache_clear()


def test_source_is_package_data():
    assert "specsample_gemm" in resources.files("specsample.models").joinpath("kernels.cpp").read_text()


@pytest.mark.skipif(not kernels.available() or not FLAGS, reason="no kernels, or no /proc/cpuinfo flags")
def test_native_instruction_set_is_the_widest_the_cpu_has(fresh_library, monkeypatch):
    monkeypatch.delenv(kernels.ISA_VARIABLE, raising=False)
    expected = "avx512" if "avx512f" in FLAGS else "avx2" if {"avx2", "fma"} <= FLAGS else "portable"
    assert kernels.instruction_set() == expected


@pytest.mark.skipif(not kernels.available(), reason="the kernels could not be built here")
def test_builds_for_each_instruction_set_have_their_own_library():
    paths = {isa: Path(kernels._load(isa)._name) for isa in ISAS}
    assert len(set(paths.values())) == len(ISAS)
    assert all(path.parent == kernels._cache_dir() for path in paths.values())


def test_isa_variable_selects_the_build(monkeypatch, fresh_library):
    monkeypatch.setenv(kernels.ISA_VARIABLE, "avx2")
    if not kernels.available():
        pytest.skip("the kernels could not be built here")
    assert kernels.instruction_set() == ISAS["avx2"]
    kernels._library.cache_clear()
    monkeypatch.setenv(kernels.ISA_VARIABLE, "avx-9000")
    with pytest.raises(ValueError, match="avx-9000"):
        kernels.available()


def test_unavailable_kernels_have_no_instruction_set(monkeypatch, fresh_library):
    monkeypatch.setenv("SPECSAMPLE_NO_KERNELS", "1")
    assert not kernels.available()
    with pytest.raises(RuntimeError):
        kernels.instruction_set()


def weights(kind: str, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(packed, scales, the float64 weight [out, in] they stand for) of a random weight."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    if kind == "float32":
        return kernels.pack(weight), None, weight.double()
    packed, scales = kernels.pack_int8(weight)
    return packed, scales, kernels.unpack(packed, out_features).double() * scales[:, None].double()


# 100 columns: a partial last panel; 300 inputs: more than one chunk of 128 and a partial one.
@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("in_features", [48, 300])
def test_matmul_matches_float64_reference(isa, kind, in_features):
    packed, scales, weight = weights(kind, 100, in_features, seed=in_features)
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(100, generator=generator)
    atol = 2e-6 * in_features  # float32 rounding of sums of about in_features products of size 1
    for rows in range(1, 17):
        x = torch.randn(rows, in_features, generator=generator)
        reference = x.double() @ weight.T
        y = kernels.matmul(x, packed, 100, scales=scales)
        torch.testing.assert_close(y.double(), reference, rtol=0, atol=atol)
        y = kernels.matmul(x, packed, 100, bias, scales=scales)
        torch.testing.assert_close(y.double(), reference + bias.double(), rtol=0, atol=atol)
        residual = torch.randn(rows, 100, generator=generator)
        expected = residual.double() + reference
        y = kernels.matmul(x, packed, 100, out=residual, scales=scales)
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_matmul_rows_do_not_depend_on_row_count(isa, kind):
    packed, scales, _ = weights(kind, 100, 300, seed=2)
    x = torch.randn(29, 300, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([kernels.matmul(x[i : i + 1], packed, 100, scales=scales) for i in range(29)])
    for rows in range(2, 30):
        assert torch.equal(kernels.matmul(x[:rows], packed, 100, scales=scales), alone[:rows]), rows
        assert torch.equal(kernels.matmul(x[29 - rows :], packed, 100, scales=scales), alone[29 - rows :]), rows


# Query heads per KV head 2, 4 and 7 (attention's groups of heads: 7 is 3 + 4), head sizes 64, 32 and
# 24 (not a whole number of AVX-512 vectors).
ATTENTION_SHAPES = {
    "gqa2-d64": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
    "gqa4-d32": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1),
    "gqa7-d24": dict(hidden_size=168, num_attention_heads=7, num_key_value_heads=1),
}


def tiny_model(shape: str) -> LlamaForCausalLM:
    """A random 2-layer Llama with a tied head and the attention shape `shape`."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, intermediate_size=200, num_hidden_layers=2, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **ATTENTION_SHAPES[shape],
    )
    return LlamaForCausalLM(config).eval()


IDS = torch.randint(0, 96, (86,), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_model_matches_transformers(isa, shape):
    """Logits of 16 positions after 70 cached (past 64: attention's blocks of positions and of
    values) match the transformers model within float32 rounding."""
    model = tiny_model(shape)
    with torch.inference_mode():
        reference = model(IDS[None]).logits[0, 70:].float()
    target = LlamaTarget.from_hf(model, max_length=128)
    assert target.kernels
    target.prefill(IDS[:70])
    torch.testing.assert_close(target.score(IDS[70:]), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("weight_type", ["float32", "int8"])
def test_model_rows_do_not_depend_on_row_count(isa, weight_type, shape):
    """Logits of positions 70..86 scored in passes of n tokens, for several n, equal bitwise those
    of one pass of 16."""
    model = tiny_model(shape)
    target = LlamaTarget.from_hf(model, max_length=128) if weight_type == "float32" else int8_target(model, 128)
    assert target.kernels
    target.prefill(IDS[:70])
    whole = target.score(IDS[70:])
    for n in (1, 3, 5, 7, 12, 13):
        target.rollback(70)
        passes = torch.cat([target.score(chunk) for chunk in IDS[70:].split(n)])
        assert torch.equal(passes, whole), n


@pytest.mark.parametrize("k", [1, 8, 64])
def test_top_k_is_torch_topk_and_keeps_equal_entries_in_index_order(isa, k):
    """`top_k` over rows of every length around the vector width (a tail entry the largest too) and over
    strided rows: torch.topk's indices where the entries differ; the earlier of equal entries first."""
    generator = torch.Generator().manual_seed(k)
    for n in (k, k + 1, 63, 64, 65, 1000, 49152):
        if n < k:
            continue
        x = torch.randn(5, n + 3, generator=generator)[:, :n]  # rows n + 3 apart
        x[1, -1] = 100.0
        assert kernels.top_k(x, k).tolist() == x.topk(k, dim=-1).indices.tolist(), n
    values = [0.0, 2.0, 1.0, 2.0, 1.0, 2.0, -1.0, 1.0] * 10
    in_order = sorted(range(len(values)), key=lambda i: (-values[i], i))  # largest first, then by index
    assert kernels.top_k(torch.tensor([values]), k)[0].tolist() == in_order[:k]


@given(start=st.integers(0, 80), length=st.integers(0, 60))
@settings(max_examples=200, deadline=None)
def test_key_views_cover_exactly_the_positions_asked(start, length):
    """`key_views` of tiled keys [layers, tiles, dim, 16], each key holding its own position, give back
    positions start..start+length-1, each once, in order, and nothing else."""
    capacity, dim = kernels.capacity(160), 3
    positions = torch.arange(capacity).reshape(-1, 1, kernels.KEY_TILE).expand(-1, dim, -1)  # [tiles, dim, 16]
    keys = torch.stack([positions, positions + 1000])  # two layers
    # whole tiles [layers, n, dim, 16], or part of one [layers, dim, count]: as [layers, positions, dim]
    got = [view.transpose(-1, -2).reshape(2, -1, dim) for view in kernels.key_views(keys, start, start + length)]
    got = torch.cat(got, dim=1) if got else torch.empty(2, 0, dim, dtype=keys.dtype)
    want = torch.arange(start, start + length)
    assert torch.equal(got[0], want[:, None].expand(-1, dim)) and torch.equal(got[1], got[0] + 1000)
