"""Tiny random models built from a config: fast enough for statistics, real enough to load."""

from __future__ import annotations

import gc
import os
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specsample.models import kernels

# Tiny models are bound by per-operation overhead: one thread each avoids
# oversubscribing the cores when pytest runs on several workers.
torch.set_num_threads(1)

# The GGUF blocks (`--backend gguf`) and the slots run on the C++ kernels: without a compiler, or with
# SPECSAMPLE_NO_KERNELS=1, their tests are skipped.
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels could not be built here")


LLAMACPP_INSTALLED = find_spec("llama_cpp") is not None
NEED_LLAMACPP = "SPECSAMPLE_TESTS_NEED_LLAMACPP"  # scripts/test.sh: a broken install fails, not skips


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(NEED_LLAMACPP) and not LLAMACPP_INSTALLED:
        raise pytest.UsageError(f"{NEED_LLAMACPP} is set and llama-cpp-python is not installed (bash scripts/install.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without llama-cpp-python (an optional extra) the tests marked `llamacpp` are skipped, not failed."""
    if LLAMACPP_INSTALLED:
        return
    skip = pytest.mark.skip(reason="needs llama-cpp-python, the optional extra specsample[llamacpp]")
    for item in items:
        if item.get_closest_marker("llamacpp"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def thaw_the_collector():
    """The command line freezes every object alive once its model is loaded (`specsample.gcfreeze`); a
    test process that runs it in process thaws them after each test, so what a test leaves in cycles is
    still collected."""
    yield
    gc.unfreeze()


def tiny_llama(vocab_size: int = 16, seed: int = 0, init_scale: float = 0.5, layers: int = 2) -> LlamaForCausalLM:
    """A 2-layer Llama with weights large enough that its next-token distributions are peaked."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=init_scale, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w0 .. w{n-1}, w1 as end of sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")


def save_tiny(directory: Path, vocab_size: int, seed: int) -> Path:
    model = tiny_llama(vocab_size, seed)
    model.config.eos_token_id = 1
    model.generation_config.eos_token_id = 1
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer(vocab_size).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-target"), 64, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-draft"), 64, seed=1)


@pytest.fixture(scope="session")
def other_vocab_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-other"), 48, seed=2)


def drafting_cost_model(k_max: int = 16):
    """The cost-model K policy with a prior worth 1000 steps: its choices follow timings, and this keeps it
    drafting (K growing 1, 2, 4, ...) on a loaded machine too, so a test exercises its varying K,
    not the machine's speed."""
    from specsample.policy import CostModelK

    return CostModelK(k_max=k_max, prior_weight=1e3)
