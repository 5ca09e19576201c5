"""The default configuration: with no drafter named, the best measured one for the backend at hand
is used, falls back where it cannot run, and is reported (--json, stats, /v1/models)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from specsample.api import SpecSampler
from specsample.defaults import VECTOR_KERNELS, default_configuration
from specsample.drafters import FallbackDrafter, NoDrafter, SuffixDrafter
from specsample.drafters.quantized import QuantizedDrafter
from specsample.models import kernels
from specsample.server import create_app

from conftest import needs_kernels
from test_cli import cli

REPEATING = "w5 w9 w7 w3 w5 w9 w7 w3 w5 w9 w7 w3 w5 w9"


def generate_json(*args: str, env: dict[str, str] | None = None) -> dict:
    """`specsample generate --json` in a process of its own (kernel settings are read once per process)."""
    command = [sys.executable, "-m", "specsample.cli", "generate", *args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not kernels.available() or kernels.instruction_set() not in VECTOR_KERNELS,
                    reason="needs AVX-512 or AVX2 kernels")
def test_the_fast_backend_on_vector_kernels_speculates_with_suffix_and_the_quantized_copy(tiny_dir):
    sampler = SpecSampler.load(str(tiny_dir))
    assert sampler.configuration.drafter == "suffix+quantized" and sampler.configuration.k == "auto"
    assert isinstance(sampler.drafter, FallbackDrafter)
    assert isinstance(sampler.drafter.first, SuffixDrafter) and isinstance(sampler.drafter.second, QuantizedDrafter)
    out = sampler.generate(REPEATING, chat=False, temperature=0, max_new_tokens=24)
    assert out.stats.drafter == "suffix+quantized" and out.stats.drafted_tokens > 0
    plain = SpecSampler.load(str(tiny_dir), "none").generate(REPEATING, chat=False, temperature=0, max_new_tokens=24)
    assert out.token_ids == plain.token_ids


def test_the_transformers_backend_falls_back_to_a_lookup_drafter(capsys, tiny_dir):
    code, out, err = cli(capsys, "generate", REPEATING, "--model", str(tiny_dir), "--no-chat", "--backend",
                         "transformers", "--temperature", "0", "--max-new-tokens", "16", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["drafter"] == "suffix" and result["k"] == "auto" and "lookup drafter" in result["drafter_reason"]
    assert result["stats"]["drafter"] == "suffix"


@needs_kernels  # the instruction set asked for is the kernels'
@pytest.mark.parametrize("isa, drafter", [("avx2", "suffix+quantized"), ("portable", "none")])
def test_the_default_follows_the_kernels_instruction_set(tiny_dir, isa, drafter):
    """AVX2 kernels speculate as AVX-512 ones do (suffix+quantized measured 1.53x plain decoding on an
    AVX2-only AMD EPYC); portable ones decode plainly. Narrower kernels are forced on a wider x86 machine
    with SPECSAMPLE_KERNEL_ISA (models/kernels.py)."""
    result = generate_json(REPEATING, "--model", str(tiny_dir), "--no-chat", "--temperature", "0",
                           "--max-new-tokens", "8", env={kernels.ISA_VARIABLE: isa})
    assert result["drafter"] == drafter and isa in result["drafter_reason"]
    if drafter == "none":
        assert result["stats"]["drafted_tokens"] == 0


def test_the_fast_backend_on_torch_ops_falls_back_to_a_lookup_drafter(tiny_dir):
    result = generate_json(REPEATING, "--model", str(tiny_dir), "--no-chat", "--temperature", "0",
                           "--max-new-tokens", "8", env={"SPECSAMPLE_NO_KERNELS": "1"})
    assert result["drafter"] == "suffix"


@pytest.mark.parametrize("arguments, message", [
    (dict(threads=1.5), "threads must be an integer, got 1.5"),  # a traceback from torch's set_num_threads
    (dict(threads="2"), "threads must be an integer, got '2'"),
    (dict(threads=True), "threads must be an integer, got True"),
    (dict(drafter=123), "a drafter is named by a string"),
])
def test_bad_arguments_to_load_are_value_errors(tiny_dir, arguments, message):
    with pytest.raises(ValueError, match=message):
        SpecSampler.load(str(tiny_dir), **arguments)


def test_k_is_a_policy_or_a_spec_of_one(tiny_dir):
    """A numpy integer is a K as an int is (it had been taken for a policy object: an AttributeError deep in
    the engine); anything neither a spec nor a `KPolicy` is a ValueError."""
    sampler = SpecSampler.load(str(tiny_dir), "ngram", backend="transformers")
    options = dict(max_new_tokens=4, temperature=0, chat=False)
    assert sampler.generate("w5 w6", k=np.int64(3), **options).token_ids == sampler.generate("w5 w6", k=3, **options).token_ids
    with pytest.raises(ValueError, match="k must be an integer >= 0 or one of"):
        sampler.generate("w5 w6", k=object(), **options)


def test_a_named_drafter_is_used_as_given(tiny_dir):
    """Its K, where none is given, is 4, and 0 for plain decoding (`--drafter none --json` had reported K 4)."""
    sampler = SpecSampler.load(str(tiny_dir), "none")
    assert isinstance(sampler.drafter, NoDrafter)
    assert (sampler.configuration.drafter, sampler.configuration.k, sampler.configuration.reason) == ("none", "0", "given")
    assert SpecSampler.load(str(tiny_dir), "ngram").configuration.k == "4"


def test_the_server_lists_its_configuration(tiny_dir):
    sampler = SpecSampler.load(str(tiny_dir), backend="transformers")
    with TestClient(create_app(sampler)) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["speculative"] == {"drafter": "suffix", "k": "auto", "reason": sampler.configuration.reason,
                                       "backend": "transformers", "backend_reason": "given"}
        body = {"prompt": REPEATING, "max_tokens": 8, "temperature": 0}
        assert client.post("/v1/completions", json=body).json()["speculative"]["drafter"] == "suffix"


def test_the_choice_reads_capabilities_not_types(tiny_dir):
    """A wrapper that forwards the fast backend's capabilities gets the fast backend's default."""
    from specsample.verify.check import PrefixCache

    sampler = SpecSampler.load(str(tiny_dir), "none")
    assert default_configuration(PrefixCache(sampler.target)) == default_configuration(sampler.target)


def readme_arguments() -> list[str]:
    """README's first command's arguments, as `benchmarks/readme_example.py` reads them."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "readme_example.py"
    spec = importlib.util.spec_from_file_location("readme_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.readme_arguments()


@pytest.mark.slow
def test_readme_first_command_speculates_and_matches_plain_decoding(capsys):
    """README's example asks for a sentence back with its spelling fixed: text a lookup drafter finds in
    the prompt, so the default drafts on either instruction set, and gives plain decoding's tokens."""
    args = readme_arguments()
    assert args[0] == "generate" and "--json" in args and "--drafter" not in args
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    result = json.loads(out)
    # the bundled GGUF runs where it measured faster (models/choice.py), with that backend's default
    assert result["backend"] in ("llamacpp", "gguf", "auto") and result["backend_reason"].startswith("auto: ")
    assert result["drafter"] != "none" and result["k"] == "auto"
    assert result["stats"]["drafted_tokens"] > 0 and result["stats"]["accepted_tokens"] > 0
    code, plain, err = cli(capsys, *args, "--drafter", "none", "--backend", result["backend"])
    assert code == 0, err
    assert json.loads(plain)["token_ids"] == result["token_ids"]


class DeclaredCopy:
    """A target stub declaring a quantized copy on AVX-512 and what the copy costs (`CopyCost`)."""

    vocab_size, max_length, length = 8, 8, 0
    instruction_set = "avx512"

    def __init__(self, copy_cost: float | None) -> None:
        self.copy_cost = copy_cost

    def quantized_copy(self):
        raise NotImplementedError


@pytest.mark.parametrize("cost", [None, 1.0, 0.5])
def test_a_copy_declared_not_cheap_gives_a_lookup_drafter(cost):
    """The llamacpp backend's case: its copy runs on AVX-512 too, but costs about a target pass."""
    configuration = default_configuration(DeclaredCopy(cost))
    assert (configuration.drafter, configuration.k) == ("suffix", "auto")
    assert ("not measured" if cost is None else f"{cost:.2f} of a target pass") in configuration.reason


def test_a_copy_declared_as_cheap_as_the_int8_one_drafts_by_default():
    assert default_configuration(DeclaredCopy(0.29)).drafter == "suffix+quantized"
