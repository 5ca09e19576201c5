"""`specsample bench` on the llamacpp backend, on tiny random GGUF files written by test_llamacpp's
`write_gguf`: cost curve, decode, run with llama.cpp's own baselines, the K policy's record and
its choice of K on this backend's cost curve.

llama.cpp's tools (llama-lookup, llama-speculative-simple) are built by
scripts/build_llamacpp_tools.sh (the batch-invariant llama-lookup by `PATCHED=1 bash
scripts/build_llamacpp_tools.sh`), not by install.sh or CI: without them the run must say they are
not available; with them (SPECSAMPLE_LLAMACPP_TOOLS, SPECSAMPLE_LLAMACPP_INVARIANT_TOOLS or the
default cache directories), the last tests run them for real.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_llama
from specsample.bench import harness, llamacpp_baselines, report, run_notes
from specsample.models import load_model, load_target
from specsample.openmp import default_threads
from specsample.policy import CostModelK
from specsample.prompts import read_prompts
from specsample.stats import Step
from test_cli import cli
from test_llamacpp import VOCAB, write_gguf

pytestmark = pytest.mark.llamacpp  # skipped without llama-cpp-python (conftest.py)

# byte-level vocabulary: any text; short, so that prompt + answer fit the tiny model's 128 positions
PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["abba cafe abba", "dead beef"]},
    {"question_id": 3, "category": "qa", "turns": ["face bead face bead"]},
]
TOOLS_BUILT = all((llamacpp_baselines.tools_dir() / "bin" / tool).is_file()
                  for tool in (llamacpp_baselines.LOOKUP_TOOL, llamacpp_baselines.SPECULATIVE_TOOL))
INVARIANT_TOOLS_BUILT = (llamacpp_baselines.tools_dir(invariant=True) / "bin" / llamacpp_baselines.LOOKUP_TOOL).is_file()


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target GGUF and a draft GGUF of the same vocabulary."""
    directory = tmp_path_factory.mktemp("bench-gguf")
    return (write_gguf(tiny_llama(VOCAB, seed=0), directory / "target.gguf"),
            write_gguf(tiny_llama(VOCAB, seed=1), directory / "draft.gguf"))


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The float32 conversion of a tiny GGUF (transformers baselines, the fast backend) goes here."""
    monkeypatch.setenv("SPECSAMPLE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp_baselines.TOOLS_ENV, str(tmp_path / "no-tools"))
    monkeypatch.setenv(llamacpp_baselines.INVARIANT_TOOLS_ENV, str(tmp_path / "no-invariant-tools"))


def test_cost_curve_on_llamacpp_alone_and_beside_fast(capsys, tmp_path, ggufs, cache):
    out = tmp_path / "curve.json"
    code, stdout, err = cli(capsys, "bench", "cost-curve", "--model", str(ggufs[0]), "--backends", "llamacpp",
                            "--threads", "1", "--context-length", "40", "--max-n", "16", "--repeats", "1",
                            "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    (curve,) = result["curves"]
    assert curve["backend"] == "llamacpp" and curve["ns"] == list(range(1, 17)) and curve["ratios"][0] == 1.0
    assert all(ms > 0 for ms in curve["ms"]) and "LlamaCppTarget, 1 threads" in result["backends"][0]
    assert "llamacpp f(n)/f(1)" in stdout
    code, stdout, err = cli(capsys, "bench", "cost-curve", "--model", str(ggufs[0]), "--backends", "fast,llamacpp",
                            "--threads", "1", "--context-length", "40", "--max-n", "4", "--repeats", "1",
                            "--json", str(out))
    assert code == 0, err
    assert [c["backend"] for c in json.loads(out.read_text())["curves"]] == ["fast", "llamacpp"]


def test_cost_curve_rejects_an_unknown_backend(capsys, ggufs):
    code, _, err = cli(capsys, "bench", "cost-curve", "--model", str(ggufs[0]), "--backends", "llamacpp,vllm")
    assert code == 2 and "unknown backend 'vllm'" in err


def test_bench_decode_on_llamacpp_runs_llama_cpp_plain_decoding_too(capsys, tmp_path, prompts_file, ggufs, cache):
    out = tmp_path / "decode.json"
    code, stdout, err = cli(capsys, "bench", "decode", "--model", str(ggufs[0]), "--prompts", str(prompts_file),
                            "--backend", "llamacpp", "--threads", "1", "--limit", "2", "--max-new-tokens", "12",
                            "--drafter", "suffix", "--drafter", "self", "--drafter", str(ggufs[1]), "--k", "3",
                            "--json", str(out))
    assert code == 0, err
    summaries = {s["system"]: s for s in json.loads(out.read_text())["summaries"]}
    assert list(summaries) == ["transformers", "specsample", "specsample+suffix", "specsample+self",
                               f"specsample+{ggufs[1]}", "llama.cpp"]
    for s in summaries.values():  # greedy: every system gives transformers' tokens (F32 file, F16 cache: no near-ties here)
        assert s["matches_transformers"] == 2 and s["tokens"] == summaries["transformers"]["tokens"], s
    assert summaries["llama.cpp"]["decode_tokens_per_second"] > 0


def test_bench_decode_auto_measures_the_backend_generate_would_pick(capsys, prompts_file, ggufs, cache):
    """`--backend auto` on a GGUF file is the measured choice among llama.cpp, the blocks and float32, as in
    `generate` and `bench run`, not the float32 path alone."""
    from specsample.models.choice import resolve

    code, stdout, err = cli(capsys, "bench", "decode", "--model", str(ggufs[0]), "--prompts", str(prompts_file),
                            "--threads", "1", "--limit", "1", "--max-new-tokens", "4")
    assert code == 0, err
    backend, reason = resolve(str(ggufs[0]), "auto", threads=1)
    assert reason.startswith("auto: the cheapest single-token pass") and f"backend {backend}: {reason}" in stdout


def test_check_names_the_backend_auto_resolved_to(capsys, ggufs, cache):
    from specsample.models.choice import resolve

    code, stdout, err = cli(capsys, "check", "--model", str(ggufs[0]), "--drafter", "suffix", "--k", "2", "--samples",
                            "20", "--context", "w5 w9", "--threads", "1", "--temperature", "0")
    assert code == 0, stdout + err
    backend, reason = resolve(str(ggufs[0]), "auto", threads=1)
    assert reason.startswith("auto: the cheapest single-token pass") and f"backend {backend} ({reason})" in stdout


def run_on_llamacpp(capsys, out: Path, prompts_file: Path, ggufs, *extra: str) -> dict:
    code, stdout, err = cli(capsys, "bench", "run", "--model", str(ggufs[0]), "--prompts", str(prompts_file),
                            "--backend", "llamacpp", "--threads", "1", "--max-new-tokens", "10", "--no-baselines",
                            "--config", "name=suffix-auto,drafter=suffix,k=auto",
                            "--config", f"name=draft-k3,drafter={ggufs[1]},k=3", "--out", str(out), *extra)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert stdout == (out / "table.md").read_text()
    assert (out / "notes.md").read_text() in err
    return results


def test_bench_run_on_llamacpp_says_which_llama_cpp_tools_are_not_available(capsys, tmp_path, prompts_file,
                                                                           ggufs, cache, no_tools):
    results = run_on_llamacpp(capsys, tmp_path / "run", prompts_file, ggufs)
    names = [c["name"] for c in results["configs"]]
    assert names == ["plain", "suffix-auto", "draft-k3", "llamacpp-plain", "llamacpp-lookup-k4",
                     "llamacpp-lookup-invariant-k4", "llamacpp-speculative-draft.gguf-k3"]
    unavailable = results["meta"]["unavailable"]
    assert set(unavailable) == {"llamacpp-lookup-k4", "llamacpp-lookup-invariant-k4", "llamacpp-speculative-draft.gguf-k3"}
    assert all("scripts/build_llamacpp_tools.sh" in reason for reason in unavailable.values())
    assert "PATCHED=1 bash scripts/build_llamacpp_tools.sh" in unavailable["llamacpp-lookup-invariant-k4"]
    assert "PATCHED=1" not in unavailable["llamacpp-lookup-k4"]
    assert {r["config"] for r in results["records"]} == {"plain", "suffix-auto", "draft-k3", "llamacpp-plain"}
    overall = {r["config"]: r for r in results["summary"] if r["category"] == report.OVERALL}
    assert overall["llamacpp-lookup-k4"]["answers"] == 0 and overall["llamacpp-lookup-k4"]["speedup"] is None
    for name in ("plain", "suffix-auto", "draft-k3", "llamacpp-plain"):
        assert overall[name]["checked"] == 3 and overall[name]["mismatches"] == 0, overall[name]
        assert overall[name]["decode_tokens_per_second"] > 0
    assert results["meta"]["llamacpp"]["threads"] == 1 and results["meta"]["llamacpp"]["cpu"].startswith("CPU:")
    table, notes = ((tmp_path / "run" / name).read_text() for name in ("table.md", "notes.md"))
    assert "| llamacpp-plain | " in table and "| llamacpp-lookup-k4 | n/a |" in table
    assert "llamacpp-lookup-k4: not available: llama-lookup is not built" in notes
    assert "| llamacpp-plain | " in notes and "llama.cpp plain, extra buffer types" in notes
    assert "K policy (`--k auto`)" in notes and "- suffix-auto: " in notes


def test_the_k_policy_records_the_k_it_chose_and_the_llamacpp_cost_curve(ggufs, prompts_file, cache):
    loaded, target = load_target(str(ggufs[0]), "llamacpp", threads=1)
    defaults, configs = harness.read_configs([f"name=draft-auto,drafter={ggufs[1]},k=auto"], {"max_new_tokens": 12})
    configs = harness.with_baselines(defaults, configs, transformers=False)
    records = harness.run(loaded, target, configs, read_prompts(prompts_file, spec_bench=True), warmup=0,
                          progress=False, backend="llamacpp", threads=1)
    mine = [r for r in records if r.config == "draft-auto"]
    for r in mine:
        chosen = r.stats["chosen_k"]
        assert sum(chosen.values()) == r.stats["steps"]  # a K per step, 0 for a plain step
        assert r.stats["policy"]["target_ms"][1] > 0  # f(1), measured on llama.cpp
    assert all(r.matches_plain for r in records)
    notes = run_notes.k_policy(harness.record_dicts(records), ["draft-auto"])
    assert notes.startswith("K policy") and "K chosen (K: steps)" in notes


def test_a_non_gguf_target_has_no_llama_cpp_baselines(tiny_dir):
    loaded = load_model(tiny_dir)
    config = harness.make_config({**harness.DEFAULTS, "name": "llamacpp-plain", "kind": "llamacpp-plain"})
    with pytest.raises(llamacpp_baselines.Unavailable, match="run GGUF files"):
        harness.llamacpp_runner(config, harness.Setup(loaded, None))


def test_without_llama_cpp_python_the_baselines_are_unavailable_not_the_run(ggufs, monkeypatch):
    """They are reported as not available and the engine's configurations run (the whole run had ended
    on the backend's error)."""
    from specsample.models import choice

    loaded = load_model(str(ggufs[0]), tokenizer_only=True)
    monkeypatch.setattr(choice, "llamacpp_installed", lambda: False)
    config = harness.make_config({**harness.DEFAULTS, "name": "llamacpp-plain", "kind": "llamacpp-plain"})
    with pytest.raises(llamacpp_baselines.Unavailable, match="need llama-cpp-python"):
        harness.llamacpp_runner(config, harness.Setup(loaded, None))


def test_llama_cpp_baselines_beside_our_own_backend_take_the_default_threads(ggufs, cache):
    """A target of the project's own backends has no llama.cpp threads: without --threads the baseline runs
    on `default_threads()` (README's summary command, `--backend gguf --llamacpp-baselines`, had crashed)."""
    loaded, target = load_target(str(ggufs[0]), "fast")
    config = harness.make_config({**harness.DEFAULTS, "name": "llamacpp-plain", "kind": "llamacpp-plain"})
    runner = harness.llamacpp_runner(config, harness.Setup(loaded, target, backend="fast"))
    assert runner.lib.llama_n_threads(runner.ctx) == default_threads()


def test_tool_output_is_parsed_into_timings_and_text():
    prompt = b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    stdout = b"\n\n" + prompt + b"Hello there\xe2\x80.\n<|im_end|>" + b"\n\n" + b"\n\n"
    stderr = ("load ...\nencoded   31 tokens in    0.120 seconds, speed:  258.333 t/s\n"
              "decoded   12 tokens in    0.250 seconds, speed:   48.000 t/s\n\nn_draft   = 4\n"
              "n_predict = 12\nn_drafted = 9\nn_accept  = 5\naccept    = 55.556%\n")
    run = llamacpp_baselines.parse_tool_output(stdout, stderr, prompt)
    assert (run.prompt_tokens, run.encode_seconds, run.generated, run.decode_seconds) == (31, 0.12, 12, 0.25)
    assert (run.drafted, run.accepted, run.text) == (9, 5, b"Hello there\xe2\x80.\n<|im_end|>")  # bytes as printed
    with pytest.raises(llamacpp_baselines.IncompleteOutput, match="no timings"):
        llamacpp_baselines.parse_tool_output(stdout, "error: bad flag\n", prompt)
    with pytest.raises(llamacpp_baselines.IncompleteOutput):  # the log thread lost the last lines at exit
        llamacpp_baselines.parse_tool_output(stdout[:-2], stderr, prompt)


def test_a_tool_s_stats_count_its_decoding_past_the_answer_s_end():
    """llama-lookup decodes 12 tokens (5 accepted from drafts) and the answer ends at the 8th: its mean
    accepted length is its run's, 11 tokens after the first over 6 steps, not 7 over 2."""
    run = llamacpp_baselines.ToolRun(31, 0.1, 12, 0.25, 9, 5, b"")
    stats = llamacpp_baselines.tool_stats(run, 8, True, "llama-lookup")
    assert (stats.generated_tokens, stats.steps, stats.accepted_tokens) == (11, 6, 5)
    assert stats.mean_accepted_length == pytest.approx(11 / 6)
    # llama-speculative-simple stopped at an end token it does not print: the answer has one token more
    assert llamacpp_baselines.tool_stats(llamacpp_baselines.ToolRun(31, 0.1, 7, 0.2, 4, 2, b""), 8, False,
                                         "s").generated_tokens == 8


@pytest.mark.skipif(not TOOLS_BUILT, reason="llama.cpp tools not built (scripts/build_llamacpp_tools.sh)")
def test_bench_run_on_llamacpp_runs_llama_cpp_lookup_and_speculative(capsys, tmp_path, prompts_file, ggufs, cache):
    results = run_on_llamacpp(capsys, tmp_path / "run", prompts_file, ggufs)
    assert set(results["meta"]["unavailable"]) == (set() if INVARIANT_TOOLS_BUILT else {"llamacpp-lookup-invariant-k4"})
    overall = {r["config"]: r for r in results["summary"] if r["category"] == report.OVERALL}
    names = ["llamacpp-lookup-k4", "llamacpp-speculative-draft.gguf-k3"]
    for name in names + ["llamacpp-lookup-invariant-k4"] * INVARIANT_TOOLS_BUILT:
        row = overall[name]
        assert row["answers"] == 3 and row["decode_tokens_per_second"] > 0 and row["checked"] == 3
        # llama.cpp's own kernels and settings (flash attention): the same greedy text on this tiny F32 model
        assert row["mismatches"] == 0, row
    records = [r for r in results["records"] if r["config"] == "llamacpp-speculative-draft.gguf-k3"]
    assert sum(r["stats"]["drafted_tokens"] for r in records) > 0
    assert all(r["stats"]["drafter"].startswith("llama-speculative-simple") for r in records)


# f(n)/f(1), n = 1..17, measured on the bundled model (docs/llamacpp-backend.md, one thread): each
# extra scored token costs about a third of a pass on llama.cpp, next to nothing on the fast backend
LLAMACPP_CURVE = [1.00, 1.30, 1.67, 2.06, 2.33, 2.68, 3.02, 3.37, 3.71, 4.05, 4.51, 4.75, 5.11, 5.47, 5.90, 6.26, 6.6]
FAST_CURVE = [1.00, 1.02, 0.99, 1.05, 1.05, 1.08, 1.12, 1.13, 1.15, 1.17, 1.18, 1.23, 1.41, 1.43, 1.47, 1.48, 1.5]


def chosen_k(curve: list[float], acceptance: float, steps: int = 600) -> Counter:
    """The K `--k auto` chooses over the last 200 of `steps` steps, where scoring n positions costs
    curve[n - 1] passes and each draft token is accepted with probability `acceptance` (a free drafter)."""
    rng = np.random.default_rng(0)
    policy = CostModelK()
    policy.begin()
    ks = []
    for _ in range(steps):
        k = policy.choose()
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policy.observe(Step(k, accepted, accepted + 1, 1e-4 * k, 0.02 * curve[k]))
    return Counter(ks[-200:])


@pytest.mark.parametrize("acceptance, llamacpp_most, fast_least", [(0.5, 1, 2), (0.8, 3, 5)])
def test_the_k_policy_drafts_less_on_llamacpps_steep_cost_curve(acceptance, llamacpp_most, fast_least):
    on_llamacpp, on_fast = chosen_k(LLAMACPP_CURVE, acceptance), chosen_k(FAST_CURVE, acceptance)
    assert max(on_llamacpp, key=on_llamacpp.get) <= llamacpp_most, on_llamacpp
    assert max(on_fast, key=on_fast.get) >= fast_least, on_fast


def test_llama_cpp_baselines_sample_from_the_engine_s_distribution():
    """Top-p cuts the tempered distribution, as `sampling.probs_from_logits` does: at temperature 0.5 and
    top-p 0.8 llama.cpp's chain keeps the tokens the engine gives mass, where top-p before the temperature
    kept a third."""
    import ctypes

    import torch

    from specsample.models.llamacpp import _bindings, init_backend
    from specsample.sampling import SamplingParams, probs_from_logits

    init_backend()
    lib = _bindings()
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
    for params in (SamplingParams(temperature=0.5, top_p=0.8), SamplingParams(temperature=2.0, top_k=4, top_p=0.7)):
        chain = llamacpp_baselines.sampler_chain(lib, params, seed=0)
        data = (lib.llama_token_data * len(logits))(*[lib.llama_token_data(i, v, 0.0) for i, v in enumerate(logits)])
        candidates = lib.llama_token_data_array(data, len(logits), -1, False)
        lib.llama_sampler_apply(chain, ctypes.byref(candidates))
        lib.llama_sampler_free(chain)
        kept = sorted(int(candidates.data[i].id) for i in range(candidates.size))
        assert kept == torch.nonzero(probs_from_logits(torch.tensor(logits), params)).flatten().tolist(), params


@pytest.mark.skipif(not TOOLS_BUILT, reason="llama.cpp tools not built (scripts/build_llamacpp_tools.sh)")
def test_a_one_token_answer_is_not_an_unlimited_one_for_the_tools(ggufs, cache):
    """The tools read -n 0 as no limit: one new token asks for -n 1 (then cut to one), and sampling names
    the engine's order of samplers."""
    from specsample.sampling import SamplingParams

    target, _ = ggufs
    runner = llamacpp_baselines.LlamaCppToolRunner(load_model(str(target)), llamacpp_baselines.LOOKUP_TOOL, target,
                                                   threads=1, n_ctx=256, params=SamplingParams(temperature=0.7, top_p=0.9),
                                                   max_new_tokens=1, k=4)
    assert runner.args[runner.args.index("-n") + 1] == "1"
    assert runner.args[runner.args.index("--samplers") + 1] == "temperature;top_k;top_p"
    output = runner.run([{"role": "user", "content": "face bead"}])
    assert len(output.token_ids) == 1 and output.generated_tokens <= 2


@pytest.mark.skipif(not INVARIANT_TOOLS_BUILT, reason="batch-invariant llama.cpp tools not built "
                    "(PATCHED=1 bash scripts/build_llamacpp_tools.sh)")
def test_the_batch_invariant_lookup_runs_with_the_backend_s_settings_and_decodes_plain_decoding_s_text(ggufs, cache):
    """`llamacpp-lookup-invariant`: the patched build, flash attention, the backend's prompt blocks as
    ubatches, repacking only where the backend repacks; at temperature 0 its answer is the engine's."""
    from specsample.models.llamacpp import PREFILL_ROWS, repack_is_batch_invariant
    from specsample.sampling import SamplingParams

    target, _ = ggufs
    model = load_model(str(target))
    runner = llamacpp_baselines.LlamaCppToolRunner(model, llamacpp_baselines.LOOKUP_TOOL, target, threads=1,
                                                   n_ctx=256, params=SamplingParams(temperature=0), max_new_tokens=40,
                                                   k=4, invariant=True)
    assert runner.executable.parent.parent == llamacpp_baselines.tools_dir(invariant=True)
    assert runner.args[runner.args.index("-fa") + 1] == "on"
    assert runner.args[runner.args.index("-ub") + 1] == str(PREFILL_ROWS)
    assert runner.no_repack == (not repack_is_batch_invariant(target))
    assert runner.label.startswith("llama-lookup, batch-invariant build")
    messages = [{"role": "user", "content": "abba cafe abba cafe abba"}]
    output = runner.run(messages)
    _, engine_target = load_target(str(target), "llamacpp", threads=1)
    from specsample.api import SpecSampler

    plain = SpecSampler.build(model, engine_target, "none", backend="llamacpp", threads=1)
    expected = plain.generate(messages, max_new_tokens=40, temperature=0, k=0).token_ids
    # the tool prints bytes, which the tiny byte-level vocabulary tokenizes back otherwise: compare the text
    assert runner.same_text(expected, output.raw, 40)
    assert output.stats.drafted_tokens > 0
