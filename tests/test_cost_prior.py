"""The cost model's prior: the target's cost curve measured on this machine, remembered per GGUF file."""

from __future__ import annotations

import json

import pytest

from specsample import SpecSampler
from specsample.cost_curve import PRIOR_NS, machine_ratios, ratios_path
from specsample.drafters import NoDrafter
from specsample.models import LoadedModel, kernels, make_target
from specsample.policy import CostModelK
from specsample.stats import Step

from conftest import needs_kernels, tiny_llama

FLAT = {n: 1.0 + 0.03 * (n - 1) for n in PRIOR_NS}  # a weight-streaming CPU pass: extra rows nearly free


def k_after_a_cold_pass(prior: dict[int, float] | None) -> int:
    """A fresh policy's K after one plain step (10 ms) and one K = 1 step whose pass, the first over two
    positions in the process, was cold (30 ms) though its draft token was accepted."""
    policy = CostModelK(k_max=8)
    if prior is not None:
        policy.see_cost_curve(prior)
    assert policy.choose() == 0  # f(1) is measured first
    policy.observe(Step(0, 0, 1, 0.0, 0.010))
    assert policy.choose() == 1
    policy.observe(Step(1, 1, 2, 0.0, 0.030))
    return policy.choose()


def test_one_cold_pass_keeps_k_at_zero_without_the_machines_curve_but_not_with_it():
    assert k_after_a_cold_pass(None) == 0  # f(2) = 3 f(1) measured once: never measured again at K = 0
    assert k_after_a_cold_pass(FLAT) > 0  # the cold pass moves the measured 1.03 by a fifth of the way


def test_the_prior_gives_way_to_the_passes_the_policy_times():
    policy = CostModelK(k_max=8)
    policy.see_cost_curve(FLAT)
    policy.observe(Step(0, 0, 1, 0.0, 0.010))
    for _ in range(40):
        policy.observe(Step(3, 3, 4, 0.0, 0.020))  # f(4) is really 2 f(1) here
    assert policy.relative_cost[4] == pytest.approx(2.0, rel=0.01)
    f1, f4 = policy.target_seconds([1.0, 4.0])
    assert f4 / f1 > 1.5  # from 1.09; the larger n's prior, fitted nondecreasing with it, holds it below 2
    policy.see_cost_curve(FLAT)  # a later request: what was measured stays
    assert policy.relative_cost[4] == pytest.approx(2.0, rel=0.01)


def test_an_unmeasured_n_between_prior_points_is_interpolated():
    policy = CostModelK(k_max=16)
    policy.see_cost_curve({1: 1.0, 9: 1.8, 17: 2.6})
    policy.observe(Step(0, 0, 1, 0.0, 0.010))
    assert policy.target_seconds([5.0])[0] == pytest.approx(0.014)


def tiny_target():
    return make_target(LoadedModel(tiny_llama(vocab_size=64), None, "tiny", frozenset(), 0.0), "fast")


def test_machine_ratios_are_measured_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path))
    target = tiny_target()
    ratios = machine_ratios(target, "tiny|fast|1")
    assert list(ratios) == list(PRIOR_NS) and ratios[1] == 1.0
    assert all(r > 0 for r in ratios.values())
    assert target.length == 0  # the cache is left empty for the first request
    path = ratios_path("tiny|fast|1")
    assert path.is_file()
    path.write_text(json.dumps({"1": 1.0, "2": 7.0}))  # what is remembered is what is used
    assert machine_ratios(target, "tiny|fast|1") == {1: 1.0, 2: 7.0}
    assert machine_ratios(target, "tiny|fast|2") != {1: 1.0, 2: 7.0}  # another key measures anew
    assert machine_ratios(target, None) != {1: 1.0, 2: 7.0}  # no key: measured, not remembered


def test_the_remembered_curve_is_kept_per_kernel_build(tmp_path, monkeypatch):
    """A curve measured on one kernel build (native, SPECSAMPLE_KERNEL_ISA=avx2, none) is not another's."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path))
    native = ratios_path("tiny|fast|1")
    monkeypatch.setattr(kernels, "build_key", lambda: "avx2/avx2")
    assert ratios_path("tiny|fast|1") != native


def test_the_remembered_curve_is_kept_per_llamacpp_variant(tmp_path, monkeypatch):
    """A curve (and a backend choice: the same key) measured on llama.cpp's best CPU variant is not the one
    SPECSAMPLE_LLAMACPP_VARIANT asks for."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECSAMPLE_LLAMACPP_VARIANT", raising=False)
    best = ratios_path("tiny|llamacpp|1")
    monkeypatch.setenv("SPECSAMPLE_LLAMACPP_VARIANT", "haswell")
    assert ratios_path("tiny|llamacpp|1") != best


def test_the_remembered_curve_is_keyed_by_the_named_backend(tmp_path, monkeypatch):
    """The fast and gguf backends both run a LlamaTarget: a sampler given its target directly remembers no
    curve (it once keyed both by the type, so `bench run --backend fast` priced its passes by the curve a
    `--backend gguf` run had measured, and kept K at 4 where the float32 pass is flat to 9 positions), and
    samplers of named backends keep one curve each, and one for each build of llama.cpp (what runs the
    llamacpp backend; a rebuild with other flags or without the batch-invariance patch changes its cost)."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF" + bytes(64))
    loaded = LoadedModel(tiny_llama(vocab_size=64), None, "tiny", frozenset(), 0.0, file)
    target = make_target(LoadedModel(loaded.model, None, "tiny", frozenset(), 0.0), "fast")
    drafter = NoDrafter()
    SpecSampler(loaded, target, drafter).cost_ratios()
    assert not (tmp_path / "cache" / "cost-curve").exists()
    for backend in ("fast", "gguf"):
        sampler = SpecSampler(loaded, target, drafter, backend=backend)
        assert sampler.backend == backend
        sampler.cost_ratios()
    assert len(list((tmp_path / "cache" / "cost-curve").iterdir())) == 2
    import specsample.api

    monkeypatch.setattr(specsample.api, "llamacpp_build", lambda: "another build of llama.cpp")  # flags, patch
    SpecSampler(loaded, target, drafter, backend="fast").cost_ratios()
    assert len(list((tmp_path / "cache" / "cost-curve").iterdir())) == 3


def test_a_target_with_a_short_context_measures_what_fits():
    target = tiny_target()
    target.max_length = 10
    assert list(machine_ratios(target, None)) == [n for n in PRIOR_NS if n < 10]


def test_the_sampler_hands_its_targets_curve_to_the_cost_model(tiny_dir):
    sampler = SpecSampler.load(str(tiny_dir), "suffix")
    out = sampler.generate("w3 w4 w5", chat=False, temperature=0, max_new_tokens=4, k="auto")
    assert set(out.stats.policy["target_ms"]) >= set(PRIOR_NS)  # known before any pass over 17 positions
    fixed = SpecSampler.load(str(tiny_dir), "suffix")
    fixed.generate("w3 w4 w5", chat=False, temperature=0, max_new_tokens=4, k=2)
    assert fixed._cost_ratios is None  # a fixed K never pays for the measurement


@needs_kernels
def test_a_request_alone_in_a_batch_starts_from_the_same_curve(tiny_dir):
    """The batch's per-slot cost models get the machine's curve as `generate`'s does: without it, one cold
    pass over two positions left a request alone in a server's batch at K = 0 (BENCHMARKS.md, 2026-11-26)."""
    sampler = SpecSampler.load(str(tiny_dir), "suffix")
    out = sampler.generate_batch(["w3 w4 w5"], chat=False, temperature=0, max_new_tokens=4, k="auto")[0]
    assert set(out.stats.policy["target_ms"]) >= set(PRIOR_NS)  # known before any pass over 17 positions


class Clock:
    """A fake `perf_counter`: the seconds the passes below say they took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class EvictingTarget:
    """A real tiny target whose pass over n tokens takes 1 + 0.1 (n - 1) ms on `clock`, plus 2 ms when the
    pass before it was of another size (as a pass after a larger one reloads the caches it needs)."""

    def __init__(self, target, clock: Clock) -> None:
        self.target, self.clock, self.last = target, clock, None

    def __getattr__(self, name):
        return getattr(self.target, name)

    def score(self, tokens):
        n = int(tokens.shape[0])
        self.clock.now += 1e-3 * (1 + 0.1 * (n - 1)) + (2e-3 if self.last not in (None, n) else 0.0)
        self.last = n
        return self.target.score(tokens)


def test_each_pass_is_timed_after_one_of_its_own_size(monkeypatch):
    """f(n) is what decoding at a steady K sees: timed after a pass of the same size, never right after
    a larger one (which read f(1) 3 ms here, and the ratios 1.4 times too low)."""
    from specsample import cost_curve

    clock = Clock()
    monkeypatch.setattr(cost_curve, "perf_counter", clock)
    (curve,) = cost_curve.measure_synthetic({"t": EvictingTarget(tiny_target(), clock)}, 8, (1, 2, 5, 9), repeats=3)
    assert curve.ms == pytest.approx([1.0, 1.1, 1.4, 1.8])
    assert curve.ratio(9) == pytest.approx(1.8)


@pytest.mark.parametrize("damage", ['{"1": 1.0, "2": 1.', "[1, 2]", '{"1": 2.0}', '{"one": 1.0}', ""])
def test_a_damaged_remembered_curve_is_measured_anew(tmp_path, monkeypatch, damage):
    """A remembered file cut short (a full disk) or not a curve is measured anew and written whole, not a
    traceback at every request's first step."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path))
    target = tiny_target()
    path = ratios_path("tiny|fast|1")
    path.parent.mkdir(parents=True)
    path.write_text(damage)
    ratios = machine_ratios(target, "tiny|fast|1")
    assert list(ratios) == list(PRIOR_NS) and ratios[1] == 1.0
    assert json.loads(path.read_text()) == {str(n): r for n, r in ratios.items()}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
