"""The `quantized` drafter on the llamacpp backend: a lower-bit copy of the same GGUF file made by
llama.cpp's own quantizer, cached, drafting in a context of its own.

The tiny F32 GGUF of tests/test_llamacpp.py is the target; its copy is Q8_0. Greedy speculative
output must be token-identical to plain decoding on this backend (its batch invariance);
sampling exactness with a draft model on this backend is tests/test_llamacpp.py's chi-square test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specsample.api import SpecSampler
from specsample.defaults import default_configuration
from specsample.models.target import CopyCost
from specsample.drafters import NoDrafter, make_drafter
from specsample.drafters.quantized import QuantizedDrafter
from specsample.engine import decode
from specsample.models import load_target
from specsample.models.llamacpp import COPY_TYPES, LlamaCppTarget, copy_type, ftype_id, ftype_name, quantize
from specsample.models.target import QuantizedCopies
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource
from specsample.stats import Stats
from test_llamacpp import GREEDY, VOCAB, random_ids, tiny_gguf, tiny_model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.llamacpp  # skipped without llama-cpp-python (conftest.py)
llama_cpp = pytest.importorskip("llama_cpp")  # imported by name below


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache directory of the test's own (SPECSAMPLE_CACHE), so every test makes its copy afresh."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def quantizations(monkeypatch) -> list[bytes]:
    """The output paths of every call to llama.cpp's quantizer during the test."""
    calls: list[bytes] = []
    real = llama_cpp.llama_model_quantize

    def counted(source: bytes, out: bytes, params) -> int:
        calls.append(out)
        return real(source, out, params)

    monkeypatch.setattr(llama_cpp, "llama_model_quantize", counted)
    return calls


def test_the_copy_rule_names_types_llama_cpp_knows():
    for source, copy in COPY_TYPES.items():
        assert ftype_name(ftype_id(source)) == source and ftype_name(ftype_id(copy)) == copy
    assert copy_type("ALL_F32") == copy_type("F16") == "Q8_0"
    assert copy_type("Q8_0") == copy_type("Q4_1") == copy_type("Q4_K_M") == "Q3_K_S"


def test_the_copy_is_made_once_and_reused_from_the_cache(tiny_gguf, cache, quantizations):
    target = LlamaCppTarget(tiny_gguf, n_threads=1, max_length=64)
    assert isinstance(target, QuantizedCopies) and target.file_type == "ALL_F32"
    first = target.quantized_copy()
    second = target.quantized_copy()
    again = LlamaCppTarget(tiny_gguf, n_threads=1, max_length=64).quantized_copy()  # another target, same file
    assert len(quantizations) == 1
    assert first.path == second.path == again.path and first.path.parent == cache
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]  # the temporary file was renamed
    assert first.file_type == "Q8_0" and first.n_threads == 1 and first.max_length == 64
    assert first.vocab_size == target.vocab_size == VOCAB
    ids = random_ids(12, seed=11)
    target.prefill(ids[:8])
    first.prefill(ids[:8])
    exact, copied = target.score(ids[8:]), first.score(ids[8:])  # [4, vocab] each
    assert not torch.equal(exact, copied)  # a copy at fewer bits, not the file itself
    correlation = torch.corrcoef(torch.stack([exact.flatten(), copied.flatten()]))[0, 1]
    assert correlation > 0.99, correlation  # the same model, at 8 bits


def test_a_changed_source_gets_a_new_copy(tiny_model, tmp_path, cache, quantizations):
    """The cache is keyed by the source's content: touched, it keeps its copy; a weight changed, it gets another."""
    from test_llamacpp import write_gguf

    path = write_gguf(tiny_model, tmp_path / "model.gguf")
    LlamaCppTarget(path, n_threads=1, max_length=32).quantized_copy()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    LlamaCppTarget(path, n_threads=1, max_length=32).quantized_copy()
    assert len(quantizations) == 1
    with path.open("r+b") as file:  # the last bytes are weights: flip one bit
        file.seek(-4, 2)
        byte = file.read(1)
        file.seek(-4, 2)
        file.write(bytes([byte[0] ^ 1]))
    LlamaCppTarget(path, n_threads=1, max_length=32).quantized_copy()
    assert len(quantizations) == 2 and quantizations[0] != quantizations[1]


def test_another_llama_cpp_gets_a_new_copy(tiny_gguf, cache, quantizations, monkeypatch):
    """A copy is keyed by llama-cpp-python's version too: an upgraded quantizer writes its own."""
    import importlib.metadata

    LlamaCppTarget(tiny_gguf, n_threads=1, max_length=32).quantized_copy()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == "llama_cpp_python" else real(name))
    LlamaCppTarget(tiny_gguf, n_threads=1, max_length=32).quantized_copy()
    assert len(quantizations) == 2
    assert len([p for p in cache.iterdir() if p.name.endswith("-llamacpp9.9.9.gguf")]) == 1


def test_a_file_below_four_bits_has_no_cheaper_copy(tiny_gguf, tmp_path, cache):
    low = LlamaCppTarget(quantize(tiny_gguf, tmp_path / "low.gguf", "Q2_K", threads=1), n_threads=1, max_length=32)
    assert low.file_type == "Q2_K"
    with pytest.raises(ValueError, match="no type below Q2_K") as raised:
        low.quantized_copy()
    assert "\n" not in str(raised.value)


def run(target, drafter, k: int, prompt: torch.Tensor, max_new_tokens: int) -> tuple[list[int], Stats]:
    stats = Stats()
    steps = decode(
        target, drafter, FixedK(k), prompt, GREEDY, max_new_tokens=max_new_tokens,
        eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats,
    )
    return [t for step in steps for t in step], stats


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_with_the_copy_is_token_identical_to_plain_decoding(tiny_gguf, cache, k):
    loaded, target = load_target(str(tiny_gguf), "llamacpp", threads=1)
    drafter = make_drafter("quantized", loaded, target, backend="llamacpp")
    assert isinstance(drafter, QuantizedDrafter) and isinstance(drafter.model, LlamaCppTarget)
    prompt = random_ids(8, seed=7)
    plain, _ = run(target, NoDrafter(), 0, prompt, 100)
    speculative, stats = run(target, drafter, k, prompt, 100)
    assert speculative == plain
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0


def test_suffix_and_the_copy_through_the_api_match_plain_decoding(tiny_gguf, cache):
    prompt = "abba cafe abba cafe abba"
    options = dict(chat=False, temperature=0, max_new_tokens=40)
    plain = SpecSampler.load(str(tiny_gguf), "none", backend="llamacpp", threads=1).generate(prompt, **options)
    sampler = SpecSampler.load(str(tiny_gguf), "suffix+quantized", backend="llamacpp", threads=1)
    out = sampler.generate(prompt, k=3, **options)
    assert out.token_ids == plain.token_ids and out.stats.drafted_tokens > 0


def test_the_default_on_llamacpp_stays_a_lookup_drafter(tiny_gguf):
    """The copy is declared (`CopyCost`) not measured cheap enough here: no quantized copy by default."""
    target = LlamaCppTarget(tiny_gguf, n_threads=1, max_length=32)
    assert isinstance(target, CopyCost) and target.instruction_set in ("avx512", "avx2", "portable")
    configuration = default_configuration(target)
    assert (configuration.drafter, configuration.k) == ("suffix", "auto")
