"""`--backend auto` on a GGUF file: the faster of llama.cpp and the float32 path, measured once and remembered."""

from __future__ import annotations

import json

import pytest

from specsample import SpecSampler
from specsample.models import choice, kernels
from specsample.models.llama import LlamaTarget
from specsample.models.llamacpp import LlamaCppTarget

from conftest import needs_kernels
from test_llamacpp import tiny_gguf, tiny_model  # noqa: F401  (fixtures)
from test_qwen3_gguf import files, qwen3  # noqa: F401  (fixtures)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cheapest_pass_wins_and_ties_go_to_the_project_kernels():
    made = choice.choose({"llamacpp": 0.010, "auto": 0.025, "gguf": 0.012})
    assert made.backend == "llamacpp"
    assert made.reason == ("auto: the cheapest single-token pass on this machine: llamacpp 10.0 ms, "
                           "fast backend on the GGUF blocks 12.0 ms, float32 fast backend 25.0 ms")
    assert choice.choose({"llamacpp": 0.030, "auto": 0.020}).backend == "auto"
    assert choice.choose({"llamacpp": 0.020, "auto": 0.020, "gguf": 0.020}).backend == "gguf"
    assert choice.choose({"llamacpp": 0.020, "auto": 0.020}).backend == "auto"


@needs_kernels
def test_a_choice_made_with_the_kernels_is_not_used_without_them(tiny_gguf, cache, monkeypatch):
    """The choice is remembered per kernel build (`kernels.build_key`): blocks chosen where the kernels
    built are not loaded under SPECSAMPLE_NO_KERNELS=1 (or without a compiler), where they cannot run; the
    file is measured again among the backends that can."""
    choice.backend_for(tiny_gguf, None, lambda: {"llamacpp": 0.02, "gguf": 0.01, "auto": 0.03})
    assert choice.resolve(tiny_gguf, "auto", threads=None)[0] == "gguf"
    monkeypatch.setattr(kernels, "available", lambda: False)
    backend, reason = choice.resolve(tiny_gguf, "auto", threads=None)
    assert backend in ("llamacpp", "auto") and "GGUF blocks" not in reason, reason
    assert len(list((cache / "backend-choice").glob("*.json"))) == 2


def test_a_given_backend_and_a_model_directory_are_not_measured(tiny_dir, monkeypatch):
    monkeypatch.setattr(choice, "measure", lambda *a: pytest.fail("measured"))
    assert choice.resolve(tiny_dir, "fast") == ("fast", "given")
    backend, reason = choice.resolve(tiny_dir, "auto")
    assert backend == "fast" and "model type 'llama'" in reason and "model directory" in reason


def test_a_directory_the_fast_backend_does_not_take_names_transformers(tmp_path):
    """The backend reported for a model directory is the one that runs it, not "auto"."""
    from transformers import PhiConfig

    PhiConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # not read: the backend is chosen from the config
    backend, reason = choice.resolve(tmp_path, "auto")
    assert backend == "transformers" and "model type 'phi' is not one of" in reason
    assert choice.resolve(tmp_path / "missing", "auto")[0] == "auto"  # loading names what is missing


@pytest.mark.llamacpp
def test_a_gguf_file_is_measured_once_per_machine_and_thread_count(tiny_gguf, cache, monkeypatch):
    backend, reason = choice.resolve(tiny_gguf, "auto", threads=1)
    assert backend in ("llamacpp", "gguf", "auto") and reason.startswith("auto: ")
    [kept] = (cache / "backend-choice").glob("*.json")
    seconds = json.loads(kept.read_text())["seconds_per_token"]
    blocks = {"gguf"} if kernels.available() else set()  # measured only where the kernels build
    assert set(seconds) == {"llamacpp", "auto"} | blocks and all(0 < s < 1 for s in seconds.values())
    monkeypatch.setattr(choice, "measure", lambda *a: pytest.fail("measured again"))
    assert choice.resolve(tiny_gguf, "auto", threads=1) == (backend, reason)
    monkeypatch.setattr(choice, "measure", lambda *a: {"llamacpp": 1.0, "auto": 2.0})
    assert choice.resolve(tiny_gguf, "auto", threads=2)[0] == "llamacpp"  # another thread count: measured anew


@pytest.mark.llamacpp
def test_a_choice_is_remembered_apart_for_an_installed_llama_cpp_and_measured_again_when_unreadable(tiny_gguf, cache,
                                                                                                 monkeypatch):
    """llama.cpp installed after a choice was made among the others, or uninstalled after it won: the file
    is measured again among what is there. A remembered choice that cannot be read is measured again too."""
    choice.backend_for(tiny_gguf, None, lambda: {"llamacpp": 0.01, "auto": 0.03})
    monkeypatch.setattr(choice, "llamacpp_build", lambda: "")
    assert choice.backend_for(tiny_gguf, None, lambda: {"auto": 0.03}).backend == "auto"
    assert len(list((cache / "backend-choice").glob("*.json"))) == 2
    choice.choice_path(tiny_gguf, None).write_text('{"backend": "auto"}')  # a field missing
    assert choice.backend_for(tiny_gguf, None, lambda: {"auto": 0.02}).seconds_per_token == {"auto": 0.02}


@pytest.mark.parametrize("winner, target_type", [
    pytest.param("llamacpp", LlamaCppTarget, marks=pytest.mark.llamacpp), pytest.param("gguf", LlamaTarget, marks=needs_kernels),
    ("auto", LlamaTarget),
])
def test_the_sampler_loads_on_the_remembered_choice_and_says_why(tiny_gguf, cache, winner, target_type):
    seconds = {name: 0.02 for name in ("llamacpp", "gguf", "auto")} | {winner: 0.01}
    choice.backend_for(tiny_gguf, None, lambda: seconds)
    sampler = SpecSampler.load(str(tiny_gguf), "none")
    assert isinstance(sampler.target, target_type)
    assert sampler.backend == winner and sampler.backend_reason.startswith("auto: ")
    out = sampler.generate("ab", chat=False, temperature=0, max_new_tokens=4)
    assert len(out.token_ids) == 4 or out.finish_reason == "stop"


@pytest.mark.slow
@needs_kernels
def test_the_bundled_model_on_its_blocks_defaults_to_a_lookup_drafter():
    """On the bundled Q4_1 blocks the int8 copy is no cheaper than the target, so no `quantized` by default."""
    sampler = SpecSampler.load(None, backend="gguf")
    assert sampler.target.copy_cost is None and sampler.target.lm_head.qtype
    assert sampler.configuration.drafter == "suffix" and sampler.backend_reason == "given"
    assert SpecSampler.load(None, backend="fast").configuration.drafter in ("suffix+quantized", "none")


@pytest.mark.llamacpp
@needs_kernels
def test_a_file_transformers_cannot_convert_is_measured_on_the_other_backends(files, cache):
    """transformers' GGUF converter refuses the tiny Qwen3 (its head size is not Qwen3's default): the
    choice is made between llama.cpp and the blocks built from the file alone, and the file runs."""
    backend, reason = choice.resolve(files[1], "auto", threads=1)
    assert backend in ("gguf", "llamacpp") and "float32" not in reason and "GGUF blocks" in reason, reason
    sampler = SpecSampler.load(str(files[1]), "suffix", threads=1)
    assert 1 <= len(sampler.generate("abba cafe", max_new_tokens=8, temperature=0).token_ids) <= 8


def test_a_choice_is_remembered_apart_for_another_llama_cpp_build_or_core_count(tiny_gguf, cache, monkeypatch):
    """llama.cpp rebuilt (another version, other flags, the batch-invariance patch) runs at another speed,
    and a process on fewer cores (taskset, a smaller VM) too: each measures again."""
    paths = {choice.choice_path(tiny_gguf, None)}
    monkeypatch.setattr(choice, "llamacpp_build", lambda: "0.3.99 [('libllama.so', 1, 2)]")
    paths.add(choice.choice_path(tiny_gguf, None))
    monkeypatch.setattr(choice, "default_threads", lambda: 7)
    paths.add(choice.choice_path(tiny_gguf, None))
    assert len(paths) == 3 and choice.choice_path(tiny_gguf, 7) == choice.choice_path(tiny_gguf, None)


@pytest.mark.llamacpp
def test_cost_curve_measures_the_backend_auto_resolves_to_and_says_so(tiny_gguf, cache, capsys, tmp_path):
    """`bench cost-curve --backends auto` times what `generate --backend auto` would run (the remembered
    choice for the file), in a column named after it; auto beside the backend it resolves to is refused."""
    from test_cli import cli

    choice.backend_for(tiny_gguf, 1, lambda: {"llamacpp": 0.01, "auto": 0.03})
    out = tmp_path / "curve.json"
    code, stdout, err = cli(capsys, "bench", "cost-curve", "--model", str(tiny_gguf), "--backends", "auto,fast",
                            "--threads", "1", "--context-length", "20", "--max-n", "2", "--repeats", "1",
                            "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    assert [c["backend"] for c in result["curves"]] == ["llamacpp (auto)", "fast"]
    assert "LlamaCppTarget" in result["backends"][0] and "llamacpp (auto) f(n)/f(1)" in stdout
    code, _, err = cli(capsys, "bench", "cost-curve", "--model", str(tiny_gguf), "--backends", "auto,llamacpp",
                       "--threads", "1")
    assert code == 2 and "--backends names llamacpp twice: auto resolves to it here" in err
