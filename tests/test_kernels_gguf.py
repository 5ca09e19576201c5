"""The GGUF block kernels (kernels_gguf.cpp) on every instruction set this machine can run.

Each build (native, AVX2, portable) is loaded side by side and swapped in for
`kernels._library`, as in test_kernels.py. For Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K and
every row count 1 to 16, a product must match float64 references within stated bounds:

- exact activations: the `gguf` package's dequantization of W times the float64 of
  the kernel's own int8 activations (its quantization is checked bitwise against a
  torch mirror). The block sums are exact integers, so only the float32 chain over
  the blocks rounds: at most (chain * blocks + 2) roundings of 2^-24 relative to the
  sum of the products' magnitudes, |xq| @ |W|^T, where chain is the multiply-adds per
  block (1 for Q4_0, Q5_0 and Q8_0; 2 for Q4_1, Q5_1 and Q4_K, the min, and Q6_K, two sub-blocks);
- the float activations x: that bound plus the activation rounding, at most half a
  quantization step per input, sum over blocks of d_x / 2 * sum |w|.

A row's result must be bitwise the same whatever the rows beside it, and (since the
integers are exact and the float operations the same on every path) whatever the
build. A deliberately wrong scale must fail the same bounds.
"""

from __future__ import annotations

import tracemalloc
from importlib import resources

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from specsample.models import gguf_blocks, kernels

from test_kernels import FLAGS

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = (
    GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")
)
FORMATS = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K]
K_TYPES = {Q4_K, Q6_K}
OUT = 100  # a partial last pair of panels (32 columns), its second panel empty
UNIT = 2.0**-24  # float32 rounding, relative
CHAIN = {Q4_0: 1, Q5_0: 1, Q8_0: 1, Q4_1: 2, Q5_1: 2, Q4_K: 2, Q6_K: 2}  # multiply-adds per block and output


def inputs(qtype: GGMLQuantizationType) -> int:
    """Inputs of the test matrices: 10 blocks, or 2 super-blocks (16 blocks) of a K type."""
    return 512 if qtype in K_TYPES else 320


AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
AVX_VNNI = AVX2 and "avx_vnni" in FLAGS  # AVX2's 256-bit vpdpbusd (Intel since Alder Lake)
NATIVE = (
    "avx512vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= FLAGS
    else "avxvnni" if AVX_VNNI else "avx2" if AVX2 else "portable"
)
# Each build the CPU runs a path of its own in: avxvnni only where the CPU has AVX-VNNI (elsewhere it is avx2's).
ISAS = {
    "native": NATIVE if FLAGS else None,
    **({"avxvnni": "avxvnni"} if AVX_VNNI else {}),
    "avx2": "avx2" if AVX2 else "portable",
    "portable": "portable",
}


def library(isa: str):
    """The kernels library built for `isa`, or skip."""
    lib = kernels._load(isa)
    if lib is None:
        pytest.skip("the kernels could not be built here")
    return lib


@pytest.fixture(params=list(ISAS))
def isa(request, monkeypatch) -> str:
    """Run a test with the kernels built for one instruction set; returns the block kernels' path."""
    lib = library(request.param)
    monkeypatch.setattr(kernels, "_library", lambda: lib)
    built = kernels.gguf_instruction_set()
    if ISAS[request.param] is not None:
        assert built == ISAS[request.param]
    return built


def random_k_raw(qtype: GGMLQuantizationType, out_features: int, in_features: int, rng) -> np.ndarray:
    """Bytes of a random Q4_K or Q6_K weight (the `gguf` package cannot quantize to them): random
    integers and sub-scales (every byte is legal; Q6_K's int8 scales reach -128), super-block
    scales d (and Q4_K's dmin) of 1e-3 to 1e-2, some rows 50 times larger or 1000 times smaller."""
    block_bytes = 144 if qtype == Q4_K else 210
    raw = rng.integers(0, 256, (out_features, in_features // 256, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (out_features, in_features // 256, 2 if qtype == Q4_K else 1))
    scales[::7] *= 50
    scales[3::11] *= 1e-3
    start = 0 if qtype == Q4_K else 208
    raw[..., start : start + scales.shape[-1] * 2] = scales.astype(np.float16).view(np.uint8)
    return raw.reshape(out_features, -1)


def random_raw(qtype: GGMLQuantizationType, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """A GGUF tensor's bytes [out, blocks * block bytes] of a random weight, with some rows scaled
    far up or down and, for Q8_0, some weights at -128 (never produced by quantize, legal in a file)."""
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:
        return random_k_raw(qtype, out_features, in_features, rng)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    weight[::7] *= 50
    weight[3::11] *= 1e-3
    raw = quantize(weight, qtype)
    if qtype == GGMLQuantizationType.Q8_0:
        raw[::5, 2 + 34 * np.arange(in_features // 32)] = 0x80  # first int8 of each block
    return raw


def activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    """x [rows, in]: normal, with an all-zero block, an outlier and a row of tiny values."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, 32:64] = 0
    x[-1, 5] = 40
    if rows > 2:
        x[1] *= 1e-4
    return x


def python_quantization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's q8_0 of x [n, in] per 32-block in torch float32: d = amax / 127, q = round(x * (1 / d))."""
    blocks = x.view(x.shape[0], -1, 32)  # [n, blocks, 32]
    d = blocks.abs().amax(-1) / 127  # [n, blocks]
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8)  # half to even, as nearbyintf
    return q.view_as(x), d, q.int().sum(-1, dtype=torch.int32)


def references(x: torch.Tensor, weight: torch.Tensor, chain: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(float64 reference [n, out], its stated tolerance [n, out]) against the kernel's int8
    activations ("int8") and against x itself ("float"), for `chain` multiply-adds per block."""
    q, d, _ = kernels.quantize_activations(x)
    blocks = x.shape[1] // 32
    xq = (q.double().view(len(x), blocks, 32) * d.double()[..., None]).view_as(x)  # [n, in]
    rounding = (chain * blocks + 2) * UNIT * (xq.abs() @ weight.abs().T)  # float32 chain over the blocks
    w_block = weight.abs().view(len(weight), blocks, 32).sum(-1)  # [out, blocks]
    activation = (d.double() / 2) @ w_block.T  # half a step per input
    return {"int8": (xq @ weight.T, rounding + 1e-30), "float": (x.double() @ weight.T, rounding + activation + 1e-30)}


def within(y: torch.Tensor, reference: torch.Tensor, tolerance: torch.Tensor) -> bool:
    """True if every output is within its tolerance of the reference."""
    return bool(((y.double() - reference).abs() <= tolerance).all())


def test_source_is_package_data():
    assert "specsample_gemm_gguf" in resources.files("specsample.models").joinpath("kernels_gguf.cpp").read_text()


@pytest.mark.parametrize("qtype", FORMATS)
def test_packing_keeps_every_byte(qtype):
    in_features = inputs(qtype)
    raw = random_raw(qtype, OUT, in_features, seed=1)
    matrix = gguf_blocks.pack_blocks(raw, qtype)
    assert matrix.qs.shape[:2] == (-(-OUT // 32), in_features // 32) and matrix.in_features == in_features
    assert np.array_equal(matrix.raw_rows(np.arange(OUT)), raw)
    rows = torch.tensor([99, 0, 17, 17])
    assert torch.equal(matrix.rows(rows), torch.from_numpy(dequantize(raw, qtype))[rows])


@pytest.mark.parametrize("qtype", sorted(K_TYPES))
def test_k_types_pack_a_few_pairs_at_a_time_into_the_same_bytes(qtype, monkeypatch):
    """Packed PAIRS_AT_ONCE pairs of panels at a time (here 1: four slices of 100 rows, the last partial),
    a K type's matrix holds the bytes it holds packed at once, and its packing's temporaries stay a slice's:
    packing the whole of a matrix at once had taken about 7 times its size (a 1B model's Q6_K LM head)."""
    raw = random_raw(qtype, OUT, inputs(qtype), seed=11)
    whole = gguf_blocks.pack_blocks(raw, qtype)
    monkeypatch.setattr(gguf_blocks, "PAIRS_AT_ONCE", 1)
    sliced = gguf_blocks.pack_blocks(raw, qtype)
    assert torch.equal(sliced.qs, whole.qs) and torch.equal(sliced.scales, whole.scales)
    assert np.array_equal(sliced.raw_rows(np.arange(OUT)), raw)
    monkeypatch.setattr(gguf_blocks, "PAIRS_AT_ONCE", 8)
    large = random_raw(qtype, 64 * 32, 4 * 256, seed=12)  # 64 pairs of panels, 8 slices
    tracemalloc.start()
    try:
        gguf_blocks.pack_blocks(large, qtype)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * large.nbytes, peak / large.nbytes


def test_unknown_type_is_refused():
    with pytest.raises(ValueError, match="Q5_K"):
        gguf_blocks.pack_blocks(np.zeros((16, 176), np.uint8), GGMLQuantizationType.Q5_K)


def test_activation_quantization_is_llamacpp_q8_0(isa):
    x = activations(16, 320, seed=2)
    q, d, s = kernels.quantize_activations(x)
    expected = python_quantization(x)
    for mine, theirs in zip((q, d, s), expected):
        assert torch.equal(mine, theirs)
    error = (x.view(16, -1, 32) - q.view(16, -1, 32).float() * d[..., None]).abs()
    assert (error <= d[..., None] / 2 * (1 + 1e-6)).all()


def test_activation_quantization_rounds_ties_to_even_and_reads_strided_rows(isa):
    """Blocks whose scale is 1 (amax 127) put inputs exactly on halves: each rounds to the even
    integer, as nearbyintf does, and the rows may be a strided view (a pass's x inside its scratch)."""
    wide = activations(3, 640, seed=4)
    halves = torch.arange(-15.5, 16.5, 1.0)  # [32]: -15.5 .. 15.5
    wide[:, :32] = halves
    wide[:, 31] = 127.0  # amax 127: d = 1, the halves stay halves
    wide[1, 64:96] = -halves.flip(0)
    wide[1, 64] = -127.0
    x = wide[:, :320]  # row stride 640
    q, d, s = kernels.quantize_activations(x)
    for mine, theirs in zip((q, d, s), python_quantization(x.contiguous())):
        assert torch.equal(mine, theirs)
    assert q[0, :4].tolist() == [-16, -14, -14, -12] and d[0, 0] == 1


@pytest.mark.parametrize("qtype", FORMATS)
def test_matmul_matches_float64_references(isa, qtype):
    raw = random_raw(qtype, OUT, inputs(qtype), seed=int(qtype))
    matrix = gguf_blocks.pack_blocks(raw, qtype)
    weight = torch.from_numpy(dequantize(raw, qtype)).double()  # [out, in]
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(3))
    for rows in range(1, 17):
        x = activations(rows, inputs(qtype), seed=rows)
        y = matrix(x)
        for name, (reference, tolerance) in references(x, weight, CHAIN[qtype]).items():
            assert within(y, reference, tolerance), (name, rows)
        # The bias and the output added into round once each, relative to what they are added to.
        reference, tolerance = references(x, weight, CHAIN[qtype])["int8"]
        reference = reference + bias.double()
        tolerance = tolerance + UNIT * reference.abs()
        assert within(matrix(x, bias), reference, tolerance)
        base = torch.randn(rows, OUT, generator=torch.Generator().manual_seed(4)).double()
        y = matrix(x, bias, out=base.float())
        assert within(y, reference + base, tolerance + UNIT * (reference + base).abs())


@pytest.mark.parametrize("qtype", FORMATS)
def test_a_wrong_scale_fails_the_tolerance(isa, qtype):
    raw = random_raw(qtype, OUT, inputs(qtype), seed=5)
    weight = torch.from_numpy(dequantize(raw, qtype)).double()
    x = activations(4, inputs(qtype), seed=6)
    reference, tolerance = references(x, weight, CHAIN[qtype])["int8"]
    matrix = gguf_blocks.pack_blocks(raw, qtype)
    assert within(matrix(x), reference, tolerance)
    if qtype in K_TYPES:  # column 5's integer scale of sub-block 3 in super-block 1, one step off
        offset = (64 if qtype == Q4_K else 32) + 3 * 16 + 5
        matrix.scales[0, 1, 1, offset] ^= 1  # of the pair's second panel: column 21
    else:
        matrix.scales[0, 3, 1, 0, 5] *= 1.01  # column 21's d in block 3, one percent off
    assert not within(matrix(x), reference, tolerance)


@pytest.mark.parametrize("qtype", FORMATS)
def test_rows_do_not_depend_on_the_rest_of_the_pass(isa, qtype):
    matrix = gguf_blocks.pack_blocks(random_raw(qtype, OUT, inputs(qtype), seed=7), qtype)
    x = activations(40, inputs(qtype), seed=8)  # more than one chunk of 16 rows
    full = matrix(x)
    for rows in range(1, 17):
        assert torch.equal(matrix(x[:rows]), full[:rows]), rows
    for start in (3, 15, 16, 33):
        assert torch.equal(matrix(x[start : start + 5]), full[start : start + 5]), start


@pytest.mark.skipif(len({ISAS["native"], ISAS["avx2"], "portable"}) < 2, reason="one instruction set here")
@pytest.mark.parametrize("qtype", FORMATS)
def test_every_build_gives_the_same_bits(monkeypatch, qtype):
    matrix = gguf_blocks.pack_blocks(random_raw(qtype, OUT, inputs(qtype), seed=9), qtype)
    x = activations(16, inputs(qtype), seed=10)
    results = []
    for isa in ISAS:
        lib = library(isa)
        monkeypatch.setattr(kernels, "_library", lambda lib=lib: lib)
        results.append(matrix(x))
    assert all(torch.equal(result, results[0]) for result in results[1:])


@pytest.fixture(scope="module")
def bundled() -> gguf_blocks.TensorIndex:
    """The bundled model's GGUF file (Q4_1 layers, a Q8_0 embedding), memory-mapped."""
    from specsample.models.loading import bundled_gguf

    try:
        return gguf_blocks.TensorIndex(bundled_gguf())
    except FileNotFoundError as error:
        pytest.skip(str(error))


def test_tensor_index_reads_what_gguf_reader_reads(tmp_path):
    path = tmp_path / "small.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_array("some.floats", [1.5, 2.5])
    tensors = {
        "q4_0": (random_raw(GGMLQuantizationType.Q4_0, 48, 64, seed=1), GGMLQuantizationType.Q4_0),
        "f32": (np.arange(12, dtype=np.float32).reshape(3, 4), None),
        "q8_0": (random_raw(GGMLQuantizationType.Q8_0, 5, 96, seed=2), GGMLQuantizationType.Q8_0),
    }
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = gguf_blocks.TensorIndex(path)
    for tensor in GGUFReader(path).tensors:
        raw, qtype = index.raw(tensor.name)
        assert qtype == tensor.tensor_type
        assert np.array_equal(raw, np.asarray(tensor.data).view(np.uint8).reshape(raw.shape))


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.5.attn_q.weight", "token_embd.weight"])
def test_bundled_tensors(isa, bundled, name):
    raw, qtype = gguf_blocks.read_raw(bundled, name)
    raw = raw[:2000]  # the embedding's first 2000 rows are enough
    matrix = gguf_blocks.pack_blocks(raw, qtype)
    weight = torch.from_numpy(dequantize(raw, qtype)).double()
    for rows in (1, 7, 16):
        x = activations(rows, matrix.in_features, seed=rows)
        y = matrix(x)
        for label, (reference, tolerance) in references(x, weight, CHAIN[qtype]).items():
            assert within(y, reference, tolerance), (label, rows)


def test_llama_permutation_inverts_the_converter():
    heads, head_dim = 3, 8
    hf = np.arange(heads * head_dim)
    # llama.cpp's convert_hf_to_gguf permute: reshape(heads, 2, d / 2).swapaxes(1, 2)
    file = hf.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert np.array_equal(file[gguf_blocks.llama_permutation(len(file), heads)], hf)


@pytest.fixture(scope="module")
def bundled_targets():
    """The bundled model as a fast-backend target on its own GGUF blocks, and in float32."""
    from specsample.models.llama import LlamaTarget
    from specsample.models.loading import load_model

    if not kernels.available():
        pytest.skip("the kernels could not be built here")
    loaded = load_model()
    return loaded, gguf_blocks.gguf_target(loaded.model, loaded.gguf), LlamaTarget.from_hf(loaded.model)


def greedy(target, drafter, k: int, prompt: torch.Tensor, stats) -> list[int]:
    """60 greedy tokens of `target` with `drafter` proposing k at a time (0: plain decoding)."""
    from specsample.engine import decode
    from specsample.policy import FixedK
    from specsample.sampling import GeneratorSource, SamplingParams

    steps = decode(
        target, drafter, FixedK(k), prompt, SamplingParams(temperature=0), max_new_tokens=60,
        eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats,
    )
    return [t for step in steps for t in step]


@pytest.mark.slow
def test_bundled_target_runs_on_its_blocks(bundled_targets):
    loaded, target, float_target = bundled_targets
    layer = target.layers[0]
    assert {layer.qkv.qtype, layer.o.qtype, layer.gate_up.qtype, layer.down.qtype} == {GGMLQuantizationType.Q4_1}
    assert target.lm_head.qtype == GGMLQuantizationType.Q8_0 and target.embed is None  # tied, read from the blocks
    ids = torch.tensor(loaded.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids)
    target.prefill(ids[:4])
    float_target.prefill(ids[:4])
    ours, theirs = target.score(ids[4:]), float_target.score(ids[4:])
    # int8 activations (as llama.cpp's) move the logits, which reach about 27, by about 1 at most
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
def test_bundled_target_on_blocks_speculates_token_identically(bundled_targets, drafter):
    from specsample.drafters import NgramDrafter, NoDrafter, SuffixDrafter
    from specsample.stats import Stats

    loaded, target, _ = bundled_targets
    text = "Count: one, two, three, four, five, six. Again: one, two, three, four, five, six. Again:"
    prompt = torch.tensor(loaded.tokenizer(text).input_ids)
    plain = greedy(target, NoDrafter(), 0, prompt, Stats())
    stats = Stats()
    speculative = greedy(target, {"suffix": SuffixDrafter, "ngram": NgramDrafter}[drafter](), 4, prompt, stats)
    assert stats.accepted_tokens > 0
    assert speculative == plain


@pytest.mark.slow
def test_float_weights_from_a_gguf_file_draft_on_its_own_blocks(bundled_targets):
    """The float32 target made from the bundled Q4_1 file: its `quantized` copy is the file's own blocks
    (not an int8 copy), declared at FILE_COPY_COST, and greedy speculation with it is token-identical to
    plain decoding. Made without the file, the target keeps its int8 copy."""
    from specsample.drafters import NoDrafter
    from specsample.drafters.quantized import quantized_drafter
    from specsample.models.llama import INT8_COPY_COST, LlamaTarget
    from specsample.stats import Stats

    loaded, _, without_file = bundled_targets
    target = LlamaTarget.from_hf(loaded.model, gguf=loaded.gguf)
    assert target.copy_file == loaded.gguf and target.copy_cost == gguf_blocks.FILE_COPY_COST
    assert without_file.copy_file is None and without_file.copy_cost == INT8_COPY_COST
    drafter = quantized_drafter(loaded, target)
    copy = drafter.model
    assert {layer.gate_up.qtype for layer in copy.layers} == {Q4_1} and copy.lm_head.qtype == Q8_0
    prompt = torch.tensor(loaded.tokenizer(COUNTING).input_ids)
    plain = greedy(target, NoDrafter(), 0, prompt, Stats())
    stats = Stats()
    assert greedy(target, drafter, 4, prompt, stats) == plain
    assert stats.accepted_tokens > stats.drafted_tokens / 2  # the file's blocks compute the target's weights


def test_only_files_of_at_most_8_bit_blocks_draft_on_their_blocks(tmp_path):
    """`drafts_on_blocks`: a file of Q8_0 (or fewer bits) layer matrices, yes; one with an F16 or F32 layer
    matrix (dequantized to float32 panels: no cheaper than int8), or of an architecture the blocks do not
    build, no."""
    def write(name: str, matrix_type: GGMLQuantizationType, arch: str = "llama"):
        path = tmp_path / name
        writer = GGUFWriter(str(path), arch)
        writer.add_block_count(1)
        writer.add_embedding_length(32)
        writer.add_head_count(2)
        writer.add_layer_norm_rms_eps(1e-5)
        weights = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
        data = weights if matrix_type == GGMLQuantizationType.F32 else quantize(weights, matrix_type)
        writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=matrix_type)
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))  # 1-D: not a matrix
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    assert gguf_blocks.drafts_on_blocks(write("q8.gguf", Q8_0))
    assert gguf_blocks.drafts_on_blocks(write("q4.gguf", Q4_0))
    assert not gguf_blocks.drafts_on_blocks(write("f32.gguf", GGMLQuantizationType.F32))
    assert not gguf_blocks.drafts_on_blocks(write("f16.gguf", GGMLQuantizationType.F16))
    assert not gguf_blocks.drafts_on_blocks(write("phi3.gguf", Q8_0, arch="phi3"))


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The bundled model requantized by llama.cpp's own quantizer, made on first use: copies("Q4_K_M")
    is the path of that file; with the bundled tokenizer (the vocabulary is the same)."""
    from specsample.models.loading import load_model

    pytest.importorskip("llama_cpp")  # the optional extra (conftest.py)
    from specsample.models import llamacpp
    if not kernels.available():
        pytest.skip("the kernels could not be built here")
    try:
        loaded = load_model(tokenizer_only=True)
    except FileNotFoundError as error:
        pytest.skip(str(error))
    directory, made = tmp_path_factory.mktemp("copies"), {}

    def copy(type_name: str):
        if type_name not in made:
            try:
                made[type_name] = llamacpp.quantize(loaded.gguf, directory / f"model.{type_name}.gguf", type_name, 2)
            except (ImportError, OSError) as error:
                pytest.skip(f"llama.cpp's quantizer is unavailable: {error}")
        return made[type_name]

    return copy, loaded.tokenizer


COUNTING = "Count: one, two, three, four, five, six. Again: one, two, three, four, five, six. Again:"


@pytest.mark.slow
def test_a_q4_k_m_file_runs_on_its_k_blocks_and_speculates_token_identically(copies):
    """The Q4_K_M file: Q4_K and Q6_K in the MLP's down projections (the only matrices whose rows, 1536
    inputs, are whole super-blocks), Q5_0 and Q8_0 elsewhere (float32 panels where fused with another type)."""
    from specsample.drafters import NoDrafter, SuffixDrafter
    from specsample.stats import Stats

    copy, tokenizer = copies
    target = gguf_blocks.file_target(copy("Q4_K_M"))
    downs = {GGMLQuantizationType(layer.down.qtype) for layer in target.layers}
    assert downs == {Q4_K, Q6_K}
    prompt = torch.tensor(tokenizer(COUNTING).input_ids)
    plain = greedy(target, NoDrafter(), 0, prompt, Stats())
    stats = Stats()
    assert greedy(target, SuffixDrafter(), 4, prompt, stats) == plain
    assert stats.accepted_tokens > 0
    assert "six" in tokenizer.decode(plain)  # the requantized model still counts


@pytest.mark.slow
def test_a_q8_0_target_drafts_with_its_q4_0_copy_token_identically(copies):
    from specsample.defaults import default_configuration
    from specsample.drafters import NoDrafter
    from specsample.drafters.quantized import quantized_drafter
    from specsample.stats import Stats

    copy, tokenizer = copies
    target = gguf_blocks.file_target(copy("Q8_0"))
    drafter = quantized_drafter(None, target)
    lower = drafter.model
    assert {GGMLQuantizationType(layer.gate_up.qtype) for layer in lower.layers} == {Q4_0}
    assert lower.lm_head is target.lm_head and lower.norm is target.norm  # shared, not copied
    assert target.copy_cost == gguf_blocks.MEASURED_COPY_COST["Q8_0"]
    assert default_configuration(target).drafter == "suffix"  # measured not cheap enough to draft by default
    prompt = torch.tensor(tokenizer(COUNTING).input_ids)
    plain = greedy(target, NoDrafter(), 0, prompt, Stats())
    stats = Stats()
    assert greedy(target, drafter, 4, prompt, stats) == plain
    assert stats.accepted_tokens > 0


def test_a_4_bit_target_has_no_lower_bit_copy(bundled):
    """The bundled Q4_1 file: its layers are at 5 bits, its Q8_0 LM head is kept, so nothing is cheaper."""
    from specsample.defaults import default_configuration

    if not kernels.available():
        pytest.skip("the kernels could not be built here")
    target = gguf_blocks.file_target(bundled.path)
    assert target.copy_cost is None and default_configuration(target).drafter == "suffix"
    with pytest.raises(ValueError, match="no cheaper copy"):
        target.quantized_copy()


def test_the_head_drafts_from_int8_on_every_build(isa):
    """The draft head's decoder (drafters/head.py `fast_head`) runs int8 panels on each instruction set,
    within int8 rounding of its float32 panels."""
    from specsample.drafters.head import DraftHead, HeadConfig, fast_head

    config = HeadConfig(target="t", fingerprint="f", hidden_size=64, vocab_size=96, vocab_subset=96, layers=1, heads=4,
                        kv_heads=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    head = DraftHead(config).eval()
    rows = torch.randn(96, 64)
    _, _, int8 = fast_head(head, rows, 64)
    _, _, float32 = fast_head(head, rows, 64, int8=False)
    assert int8.layers[0].qkv.weight.dtype == torch.int8 and int8.lm_head.weight.dtype == torch.int8
    x = torch.randn(5, 64)
    ours, theirs = int8.forward_embeddings(x.clone()), float32.forward_embeddings(x.clone())
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_a_stack_of_types_runs_each_part_as_alone(isa):
    """A fused matrix of parts of different types (a Q4_K_M file's Q6_K V beside Q4_K Q and K) runs each
    part on its own kernel (the kernels' STACKED entry): bitwise the parts' products side by side."""
    parts = [gguf_blocks.pack_blocks(random_raw(qtype, rows, 512, seed=rows), qtype)
             for qtype, rows in ((Q4_K, 48), (Q6_K, 37), (Q8_0, 16), (Q4_0, 5))]
    stacked = gguf_blocks.stacked_linear(parts, torch.randn(106))
    x = activations(7, 512, seed=11)
    alone = torch.cat([part(x) for part in parts], -1) + stacked.bias
    assert torch.equal(stacked(x), alone)
    rows = torch.tensor([0, 47, 48, 84, 85, 101, 105])
    assert torch.equal(gguf_blocks.linear_rows(stacked, rows), torch.cat([part.dequantize() for part in parts])[rows])
    stacked.weight[2] += 1  # the table's rows no longer add up
    with pytest.raises(ValueError):
        stacked(x)


def test_a_layer_runs_a_stacked_qkv_in_its_cxx_call(bundled):
    """The decoder layer's C++ call takes a stacked QKV: the bundled model with each layer's Q, K and V
    packed apart and stacked gives bitwise the logits of the fused matrix (576 and 192 rows are whole panels)."""
    from dataclasses import replace

    from specsample.models.llama import LlamaTarget

    if not kernels.available():
        pytest.skip("the kernels could not be built here")
    fused = gguf_blocks.file_target(bundled.path)
    heads = [fused.heads, fused.kv_heads, None]
    layers = [
        replace(layer, qkv=gguf_blocks.stacked_linear(
            [gguf_blocks.read_matrix(bundled, [f"blk.{i}.attn_{x}.weight"], [h]) for x, h in zip("qkv", heads)], None))
        for i, layer in enumerate(fused.layers)
    ]
    stacked = LlamaTarget(layers, None, fused.norm, fused.lm_head, fused.cos, fused.sin, heads=fused.heads,
                          kv_heads=fused.kv_heads, head_dim=fused.head_dim, eps=fused.eps, kv_dtype=fused.k_cache.dtype)
    assert stacked.layers[0].qkv.qtype == gguf_blocks.STACKED
    ids = torch.arange(100, 120)
    assert torch.equal(stacked.score(ids), fused.score(ids))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0, Q6_K])
def test_a_non_finite_activation_makes_its_row_nan_and_leaves_the_others_be(isa, qtype, bad):
    """A NaN input had quantized to 0 (the block's amax skips NaNs), so a NaN hidden state gave finite
    outputs, all-zero logits through a tied head on the blocks: a uniform distribution, silently. Now its
    block's scale is NaN and the row's outputs are NaN, as a float product's are (an infinite input was
    NaN already: inf / 127 times 0); the other rows are what they are alone, on every instruction set."""
    matrix = gguf_blocks.pack_blocks(random_raw(qtype, OUT, inputs(qtype), seed=9), qtype)
    x = activations(5, inputs(qtype), seed=10)
    clean = matrix(x)
    x[2, 70] = bad
    _, d, _ = kernels.quantize_activations(x)
    assert torch.isnan(d[2, 2]) if bad != bad else torch.isinf(d[2, 2])
    assert torch.isfinite(d[[0, 1, 3, 4]]).all() and torch.isfinite(d[2, [0, 1, 3]]).all()
    y = matrix(x)
    assert torch.isnan(y[2]).all()
    assert torch.equal(y[[0, 1, 3, 4]], clean[[0, 1, 3, 4]])
