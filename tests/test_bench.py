"""The Spec-Bench harness on a tiny model and a three-prompt file: JSON, table, plot, mismatch counting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from specsample.bench import harness, report
from specsample import api
from specsample.api import SpecSampler
from specsample.verify import ChainVerifier
from specsample.verify.check import accept_all_coupled, accept_all_greedy
from specsample.drafters import REGISTRY
from specsample.engine import looks
from specsample.models import load_model, make_target
from specsample.models.target import NotOnThisBackend
from specsample.prompts import read_prompts
from specsample.sampling import SamplingParams

from conftest import needs_kernels
from test_cli import cli

PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["w5 w9 w7 w3", "w4 w4 w8"]},
    {"question_id": 2, "category": "writing", "turns": ["w12 w30 w12 w30"]},
    {"question_id": 3, "category": "qa", "turns": ["w2 w6 w10 w14 w2 w6"]},
]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def test_configs_from_toml_and_pairs_with_precedence(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[defaults]\nmax_new_tokens = 64\nk = 3\n\n[[config]]\nname = "a"\ndrafter = "ngram"\n'
                    '\n[[config]]\ndrafter = "suffix"\nk = "auto"\ntemperature = 0.7\n')
    defaults, configs = harness.read_configs([str(toml), "drafter=ngram,k=5"], {"max_new_tokens": 32, "seed": None})
    assert defaults["max_new_tokens"] == 32 and defaults["k"] == "3"
    assert [(c.name, c.drafter, c.k, c.temperature, c.max_new_tokens) for c in configs] == [
        ("a", "ngram", "3", 0.0, 32), ("suffix-kauto-t0.7", "suffix", "auto", 0.7, 32), ("ngram-k5", "ngram", "5", 0.0, 32)]
    names = [c.name for c in harness.with_baselines(defaults, configs)]
    assert names[0] == harness.REFERENCE and "hf-generate" in names and "hf-lookup" in names
    baselines = {c.name: c for c in harness.with_baselines({**defaults, "k": "auto"}, configs)}
    assert baselines["hf-lookup"].k == "4"  # transformers takes an integer K: the built-in default


@pytest.mark.parametrize("spec, message", [
    ("drafter=ngram,colour=red", "unknown configuration keys"),
    ("temperature=hot", "not a float"),
    ("drafter", "key=value"),
    ("temperature=-1", "temperature"),
    ("kind=vllm", "unknown kind"),
    ("seed=-5", "seed must be an integer from 0 to 2\\*\\*64 - 1, got -5"),
    ("drafter=ngram,k=banana", "k must be an integer >= 0 or one of auto"),
    (f"seed={2**64}", "seed must be an integer from 0 to 2"),
    ("drafter=sufix,k=4", "unknown drafter 'sufix'"),  # before any model loads (it was an unavailable row)
    ("drafter=ngram+nope,k=4", "unknown drafter 'nope'"),
    ("kind=hf-assisted", "kind hf-assisted needs drafter=PATH of a draft model, got 'none'"),
    ("kind=llamacpp-speculative,drafter=/no/such.gguf", "kind llamacpp-speculative needs drafter=PATH"),
    ("nofile.toml", "--config nofile.toml: No such file or directory"),
    ("drafter=ngram,k=4,k=5", "gives k twice"),  # not the last one silently
    ("drafter=ngram,kind=hf-lookup", "kind hf-lookup takes no drafter, got 'ngram'"),
    ("drafter=ngram,name=", "it heads a row of the Markdown tables"),
    ("drafter=ngram,name=a|b", "without '\\|' or line breaks"),
])
def test_bad_configurations_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        harness.read_configs([spec], {})


def test_a_toml_file_that_is_not_utf8_is_named(tmp_path):
    toml = tmp_path / "binary.toml"
    toml.write_bytes(b"\xff\xfe[[config]]\n")
    with pytest.raises(ValueError, match=f"--config {toml} is not UTF-8 text"):
        harness.read_configs([str(toml)], {})


@pytest.mark.parametrize("text", ["seed = 2.9", "top_k = true", "temperature = true", "max_new_tokens = 16.0"])
def test_toml_values_of_another_type_are_refused(tmp_path, text):
    """Not silently truncated or converted (2.9 to 2, true to 1)."""
    toml = tmp_path / "c.toml"
    toml.write_text(f'[[config]]\ndrafter = "ngram"\n{text}\n')
    with pytest.raises(ValueError, match="is not a"):
        harness.read_configs([str(toml)], {})


def test_two_files_that_set_a_default_differently_are_refused(tmp_path):
    """One file's [defaults] never applies to another file's entries."""
    a, b, c = tmp_path / "a.toml", tmp_path / "b.toml", tmp_path / "c.toml"
    a.write_text('[defaults]\ntemperature = 0.0\nmax_new_tokens = 16\n\n[[config]]\nname = "a-ngram"\ndrafter = "ngram"\n')
    b.write_text('[defaults]\ntemperature = 1.0\nmax_new_tokens = 16\n\n[[config]]\ndrafter = "suffix"\n')
    c.write_text('[defaults]\nmax_new_tokens = 16\n\n[[config]]\ndrafter = "suffix"\n')
    with pytest.raises(ValueError, match="set temperature to 0.0 and 1.0 in \\[defaults\\]"):
        harness.read_configs([str(a), str(b)], {})
    defaults, configs = harness.read_configs([str(a), str(c)], {})  # the same value twice is one default
    assert defaults["max_new_tokens"] == 16 and [x.temperature for x in configs] == [0.0, 0.0]


@pytest.mark.parametrize("text, message", [
    ('drafter = "suffix"\nk = "foo"\n', "found keys 'drafter', 'k'"),  # a configuration without its [[config]]
    ('[defaults]\nk = 3\n', "found no \\[\\[config\\]\\]"),
    ('defaults = 3\n[[config]]\ndrafter = "ngram"\n', "must be tables of key = value"),
    ('config = [1, 2]\n', "must be tables of key = value"),
    ('config = "ngram"\n', "must be tables of key = value"),
    ('[[config]\ndrafter = "ngram"\n', "c.toml is not valid TOML"),
])
def test_a_configuration_file_without_configurations_is_refused(tmp_path, text, message):
    """Not a run of the baselines alone, with the file's keys silently unread."""
    toml = tmp_path / "c.toml"
    toml.write_text(text)
    with pytest.raises(ValueError, match=message):
        harness.read_configs([str(toml)], {})


def test_bench_run_refuses_a_file_as_its_output_directory_before_running(capsys, tmp_path):
    taken = tmp_path / "results"
    taken.write_text("not a directory")
    code, _, err = cli(capsys, "bench", "run", "--model", "/nonexistent/model", "--out", str(taken))
    assert code == 2 and err.strip() == f"specsample: error: --out {taken} is a file, not a directory for the results"


def test_bench_outputs_and_drafters_are_checked_before_loading(capsys, tmp_path):
    """A place the results cannot be written to, or a drafter that does not exist, is refused before the
    model loads, not after the run."""
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    cases = [
        (["run", "--out", str(a_file / "sub")], f"--out {a_file / 'sub'}: {a_file} is a file, so nothing can be written under it"),
        (["run", "--out", ""], "--out is empty: name a path"),
        (["decode", "--json", str(tmp_path)], f"--json {tmp_path} is a directory, not a file for the results"),
        (["cost-curve", "--json", str(a_file / "x.json")], f"--json {a_file / 'x.json'}: {a_file} is a file"),
        (["batch", "--json", " "], "--json is empty: name a path"),
        (["decode", "--drafter", "bogus"], "unknown drafter 'bogus'"),
        (["decode", "--drafter", "ngram+bogus"], "unknown drafter 'bogus'"),
    ]
    for args, message in cases:
        code, _, err = cli(capsys, "bench", *args, "--model", "/nonexistent/model")
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (args, err)


@pytest.mark.parametrize("args, message", [
    (["decode", "--threads", "0"], "--threads must be from 1 to 512, got 0"),
    (["batch", "--threads", "-1"], "--threads must be from 1 to 512, got -1"),
    (["cost-curve", "--threads", "0"], "--threads must be from 1 to 512, got 0"),
    (["run", "--threads", "0"], "--threads must be from 1 to 512, got 0"),
    (["batch", "--k", ","], "--k needs one or more distinct K specs, comma-separated, got ','"),
    (["batch", "--k", "auto,auto"], "--k needs one or more distinct K specs"),
    (["batch", "--k", "3,zz"], "k must be an integer >= 0 or one of auto"),
    (["batch", "--backend", "transformers"], "bench batch decodes on a backend's slots"),
    (["run", "--k", "-1", "--no-baselines"], "k must be an integer >= 0 or one of auto"),
    (["cost-curve", "--backends", "gguf,gguf"], "--backends names a backend twice: 'gguf,gguf'"),
    (["copy-bound", "--k", "4", "--k", "4"], "--k names a speculation length twice: [4, 4]"),
    (["run", "--config", "k=abc", "--no-baselines"], "k must be an integer >= 0 or one of auto"),  # was after the load
    (["run", "--split", "bogus", "--no-baselines"], "split"),
])
def test_bench_commands_refuse_bad_options_in_one_line_before_loading(capsys, args, message):
    code, _, err = cli(capsys, "bench", *args, "--model", "/nonexistent/model")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_cost_curve_refuses_a_context_past_the_window_before_prefilling(capsys, tiny_dir):
    code, _, err = cli(capsys, "bench", "cost-curve", "--model", str(tiny_dir), "--backends", "transformers",
                       "--context-length", "120", "--max-n", "16")
    assert code == 2 and "--context-length 120 + --max-n 16 exceeds the context window of 128 tokens" in err, err


def test_bench_run_writes_json_table_and_plot(capsys, tmp_path, prompts_file, tiny_dir, tiny_draft_dir):
    out = tmp_path / "run"
    code, stdout, err = cli(capsys, "bench", "run", "--model", str(tiny_dir), "--prompts", str(prompts_file),
                            "--config", f"name=draft,drafter={tiny_draft_dir},k=3", "--config", "drafter=ngram,k=2",
                            "--max-new-tokens", "8", "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    names = [c["name"] for c in results["configs"]]
    assert names == ["plain", "draft", "ngram-k2", "hf-generate", "hf-lookup", f"hf-assisted-{tiny_draft_dir.name}-k3"]
    assert len(results["records"]) == len(names) * 4  # four answers: a two-turn prompt and two one-turn prompts
    record = next(r for r in results["records"] if r["config"] == "draft")
    for key in ("question_id", "category", "turn", "prompt_tokens", "generated_tokens", "wall_seconds", "matches_plain"):
        assert key in record
    assert record["stats"]["mean_accepted_length"] >= 1
    overall = {r["config"]: r for r in results["summary"] if r["category"] == report.OVERALL}
    assert overall["plain"]["speedup"] == pytest.approx(1.0)
    assert all(r["checked"] == 4 and r["mismatches"] == 0 for r in overall.values())  # all greedy, all lossless
    table = (out / "table.md").read_text()
    assert stdout == table and "| draft |" in table and "| writing | qa | overall |" in table
    # three questions: no interval, said so (a table of headers alone had looked broken)
    assert "paired bootstrap over the questions)\n\nnone: every configuration answered fewer than 4" in table
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out / "plot.png").unlink()
    code, again, err = cli(capsys, "bench", "report", str(out))
    assert code == 0, err
    assert again == table and (out / "plot.png").is_file()
    results["records"][0]["category"] = 5  # hand-edited: it heads a column of the tables
    (out / "results.json").write_text(json.dumps(results))
    code, _, err = cli(capsys, "bench", "report", str(out))
    assert code == 2 and "is not a `bench run` results file (a record's category is 5, not a string)" in err, err


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mismatches_are_counted_when_verification_is_broken(monkeypatch, prompts_file, tiny_dir, tiny_draft_dir,
                                                              temperature):
    """Greedy, and sampled with plain decoding's seed (coupled sampling): each engine configuration's answers
    are checked against plain decoding's, and a broken verifier's differ."""
    loaded = load_model(tiny_dir)
    target = make_target(loaded)
    overrides = {"max_new_tokens": 8, "temperature": temperature, "seed": 3}
    specs = [f"name=draft,drafter={tiny_draft_dir},k=3", "name=other-seed,drafter=ngram,k=2,seed=4"]
    defaults, configs = harness.read_configs(specs, overrides)
    configs = harness.with_baselines(defaults, configs, transformers=False)
    records = harness.run(loaded, target, configs, read_prompts(prompts_file, spec_bench=True), warmup=0, progress=False)
    rows = {r["config"]: r for r in report.summarize(harness.record_dicts(records), [c.name for c in configs])
            if r["category"] == report.OVERALL}
    assert rows["draft"]["checked"] == 4 and rows["draft"]["mismatches"] == 0
    assert rows["other-seed"]["checked"] == (4 if temperature == 0 else 0)  # another seed draws other tokens
    broken = ChainVerifier(greedy=accept_all_greedy, coupled=accept_all_coupled)
    monkeypatch.setattr(SpecSampler, "verifier", broken)  # plain decoding drafts nothing: unaffected
    records = harness.run(loaded, target, configs[:2], read_prompts(prompts_file, spec_bench=True), warmup=0,
                          progress=False)
    rows = {r["config"]: r for r in report.summarize(harness.record_dicts(records), [c.name for c in configs[:2]])
            if r["category"] == report.OVERALL}
    assert rows["plain"]["mismatches"] == 0 and rows["plain"]["checked"] == 4
    assert rows["draft"]["mismatches"] > 0
    assert all(r.mismatch_at is not None for r in records if r.matches_plain is False)


def test_an_engine_configuration_runs_the_k_policy_generate_runs(prompts_file, tiny_dir):
    """`--k auto` in `bench run` is the policy `generate` runs: greedy requests of a lookup drafter look at
    its next token at plain steps (`engine.looks`), which a wrapper around the policy once hid; and each
    step's K is in the records' statistics."""
    loaded = load_model(tiny_dir)
    target = make_target(loaded)
    defaults, configs = harness.read_configs(["name=auto,drafter=suffix,k=auto"], {"max_new_tokens": 12})
    runner = harness.engine_runner(configs[0], harness.Setup(loaded, target))
    assert looks(runner.sampler.drafter, runner.policy, SamplingParams(temperature=0.0))
    records = harness.run(loaded, target, configs, read_prompts(prompts_file, spec_bench=True), warmup=0,
                          progress=False)
    for r in records:
        assert sum(r.stats["chosen_k"].values()) == r.stats["steps"] > 0


def test_an_engine_configuration_measures_the_cost_curve_before_it_is_timed(monkeypatch, tiny_dir):
    """`--k auto` measures the target's cost curve when its configuration is set up, not inside the first
    timed answer (as it did with `--warmup 0`)."""
    measured = []
    monkeypatch.setattr(api, "machine_ratios", lambda target, key: measured.append(key) or {1: 1.0, 2: 1.1})
    loaded = load_model(tiny_dir)
    defaults, configs = harness.read_configs(["name=auto,drafter=suffix,k=auto"], {"max_new_tokens": 4})
    runner = harness.engine_runner(configs[0], harness.Setup(loaded, make_target(loaded)))
    assert len(measured) == 1
    runner.run([{"role": "user", "content": "Hello"}])
    assert len(measured) == 1


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "unknown schema None"), ('{"schema": 1}', "holds no configurations or no records: nothing to report"),
    ('{"schema": 1, "configs": [], "records": [], "meta": {}}', "holds no configurations or no records"),
    ('{"schema": 1, "configs": [{"name": "a"}], "records": [{"config": "a"}]}', "(missing or malformed 'meta')"),
    ("{bad", "is not JSON"), ('{"schema": 1, "configs": [{"name": "a"}], "records": [{"config": "a"}], "meta": {}}',
                              "is not a `bench run` results file"),
])
def test_report_of_a_malformed_results_file_names_it(capsys, tmp_path, text, message):
    (tmp_path / report.RESULTS_FILE).write_text(text)
    code, _, err = cli(capsys, "bench", "report", str(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and report.RESULTS_FILE in err, err


def test_report_of_a_directory_without_results_is_a_clear_error(capsys, tmp_path):
    code, _, err = cli(capsys, "bench", "report", str(tmp_path))
    assert code == 2 and "no results.json" in err


@pytest.mark.parametrize("directory", ["", "  "])
def test_report_of_an_empty_path_is_refused_not_read_as_the_current_directory(capsys, directory):
    code, _, err = cli(capsys, "bench", "report", directory)
    assert code == 2 and "the results directory is empty" in err and "no results.json" not in err


@pytest.mark.parametrize("toml", sorted((Path(__file__).parent.parent / "benchmarks").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_benchmark_configs_parse(toml, tmp_path):
    """Every shipped configuration is read as a bench run reads it. A draft model's GGUF file that a
    configuration names (made by benchmarks/format_copies.py before the run) stands in as an empty file
    under tmp_path, since a drafter path that does not exist is refused as the configuration is read."""
    text = toml.read_text().replace('"/tmp/formats/', f'"{tmp_path}/formats/')
    (tmp_path / "formats").mkdir()
    for name in re.findall(rf'"{re.escape(str(tmp_path))}/formats/([^"]+)"', text):
        (tmp_path / "formats" / name).touch()
    copy = tmp_path / toml.name
    copy.write_text(text)
    defaults, configs = harness.read_configs([str(copy)], {})
    names = [c.name for c in harness.with_baselines(defaults, configs, transformers=False)]
    assert len(configs) >= 1 and names[0] == harness.REFERENCE
    # A+B: both registered; or a draft model's GGUF file (made by a benchmark script before the run)
    assert all(part in REGISTRY or part.endswith(".gguf") for c in configs for part in c.drafter.split("+"))


def answers(config: str, seconds, tokens=None, turns: int = 1) -> list[dict]:
    """Records of `config` answering, `turns` turns a question, questions 0, 1, ... in these times."""
    tokens = tokens if tokens is not None else [128] * len(seconds)
    return [{"config": config, "question_id": i // turns, "turn": i % turns, "category": "qa", "wall_seconds": float(s),
             "generated_tokens": int(n)} for i, (s, n) in enumerate(zip(seconds, tokens))]


def test_a_uniform_speedup_has_a_point_interval():
    records = answers("plain", [1.0, 2.0, 3.0, 1.5]) + answers("fast", [0.5, 1.0, 1.5, 0.75])
    assert report.speedup_interval(records, "fast") == pytest.approx([2.0, 2.0])
    assert report.speedup_interval(records[:1] + records[4:5], "fast") is None  # one paired turn: no interval


def test_a_question_s_turns_are_resampled_together():
    """Four questions of two turns each, two of them 3x faster, two as fast: resampling questions can
    draw only five mixes (pooled ratios 1, 1.29, 1.67, 2.2 and 3), and the expanded interval of four
    questions reaches the outer two; resampling turns would draw mixes in between. Three questions,
    however many turns, give no interval."""
    records = (answers("plain", [3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0], turns=2)
               + answers("fast", [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], turns=2))
    low, high = report.speedup_interval(records, "fast")
    assert low == pytest.approx(1.0) and high == pytest.approx(3.0)
    three = [r for r in records if r["question_id"] != 0]
    assert report.speedup_interval(three, "fast") is None


def test_intervals_of_few_questions_are_expanded():
    """Hesterberg's expanded percentile level: far wider than 95% for 4 questions, near it for 1,000."""
    assert report.expanded_level(4) > 0.999 and 0.95 < report.expanded_level(1000) < 0.951


def test_the_ends_of_an_interval_of_few_questions_do_not_depend_on_the_seed(monkeypatch):
    """Five questions: the expanded level (0.998) leaves 0.1% a tail, which 2,000 resamples put 2 resamples in;
    the ends then moved with the bootstrap's seed. With TAIL_RESAMPLES beyond each end they agree to 1%."""
    rng = np.random.default_rng(3)
    plain = rng.lognormal(0.3, 0.5, 5)
    ours = plain / 1.25 * rng.lognormal(0, 0.3, 5)
    records = answers("plain", plain) + answers("ours", ours)
    seeded = np.random.default_rng
    ends = []
    for seed in range(8):
        monkeypatch.setattr(report.np.random, "default_rng", lambda _=None, seed=seed: seeded(seed))
        ends.append(report.speedup_interval(records, "ours"))
    lows, highs = zip(*ends)
    assert max(lows) / min(lows) < 1.01 and max(highs) / min(highs) < 1.01, ends


def test_speedup_intervals_cover_the_true_ratio():
    """Answers times drawn with a true speedup of 1.25 (same tokens, seconds / 1.25 times shared and own
    noise): the 95% intervals of 300 runs of 40 answers cover 1.25 at least 90% of the time (the
    percentile bootstrap runs a little narrow at this size); pairing is what makes them narrow,
    so intervals of unpaired answers (the reference shuffled) are wider."""
    rng = np.random.default_rng(0)
    covered, widths, unpaired_widths = 0, [], []
    for _ in range(300):
        prompt = rng.lognormal(0.3, 0.5, 40)  # each answer's own cost, shared by both configurations
        plain = prompt * rng.lognormal(0, 0.05, 40)
        ours = prompt / 1.25 * rng.lognormal(0, 0.05, 40)
        low, high = report.speedup_interval(answers("plain", plain) + answers("ours", ours), "ours")
        covered += low <= 1.25 <= high
        widths.append(high - low)
        if len(unpaired_widths) < 20:
            low, high = report.speedup_interval(answers("plain", rng.permutation(plain)) + answers("ours", ours), "ours")
            unpaired_widths.append(high - low)
    assert 0.90 <= covered / 300 <= 0.99, covered
    assert np.median(widths) < 0.5 * np.median(unpaired_widths)


@needs_kernels  # batched decoding runs on the kernels' slots
def test_bench_batch_runs_alone_and_batched(capsys, tmp_path, prompts_file, tiny_dir):
    """`bench batch`: the prompts one at a time and through generate_batch, each greedy completion of
    the batch equal to the prompt's alone, the batched steps split into the pass and the rest."""
    out = tmp_path / "batch.json"
    with prompts_file.open("a") as f:  # a prompt per K spec (a lookup drafter must not see one twice), 2 to warm up
        f.write(json.dumps({"question_id": 4, "category": "qa", "turns": ["w3 w5 w7 w9"]}) + "\n")
    code, stdout, err = cli(capsys, "bench", "batch", "--model", str(tiny_dir), "--backend", "fast", "--drafter", "ngram",
                            "--prompts", str(prompts_file), "--split", "all", "--skip", "0", "--limit", "1",
                            "--k", "2,0", "--max-batch", "2", "--max-new-tokens", "6", "--rounds", "1", "--json", str(out))
    assert code == 0, err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["k"], r["mode"]) for r in rows] == [("2", "alone"), ("2", "batch 2"), ("0", "alone"), ("0", "batch 2")]
    for row in rows[1::2]:
        assert row["differing"] == 0 and row["steps"] >= 1 and row["tokens"] == 6
        assert row["pass_ms"] > 0 and row["other_ms"] >= 0 and row["prefill_seconds"] > 0
    assert rows[3]["rows_per_step"] == 1.0  # K = 0, one request: one row per step
    code, _, err = cli(capsys, "bench", "batch", "--model", str(tiny_dir), "--prompts", str(prompts_file),
                       "--split", "all", "--skip", "0", "--limit", "1", "--rounds", "2")
    assert code == 2 and "4 prompts: --limit 1 x --rounds 2 x 2 K specs" in err


def test_a_drafter_the_backend_cannot_serve_is_skipped_with_its_reason(prompts_file, tiny_dir):
    """`quantized` on the transformers backend (no quantized copies): the run goes on without it and says why;
    the same configuration as the reference is still an error."""
    loaded = load_model(tiny_dir)
    target = make_target(loaded, "transformers")
    defaults, configs = harness.read_configs(["name=q,drafter=quantized,k=2", "drafter=ngram,k=2"], {"max_new_tokens": 4})
    configs = harness.with_baselines(defaults, configs, transformers=False)
    unavailable: dict[str, str] = {}
    records = harness.run(loaded, target, configs, read_prompts(prompts_file, spec_bench=True), warmup=0,
                          progress=False, backend="transformers", unavailable=unavailable)
    assert {r.config for r in records} == {"plain", "ngram-k2"}
    assert list(unavailable) == ["q"] and "makes a quantized copy of itself" in unavailable["q"]
    with pytest.raises(NotOnThisBackend):
        harness.run(loaded, target, [c for c in configs if c.name == "q"], read_prompts(prompts_file, spec_bench=True),
                    warmup=0, progress=False, backend="transformers")


def test_bench_run_times_the_backends_at_its_thread_count(capsys, tmp_path, monkeypatch, tiny_dir):
    """`--backend auto` measures the candidates at `--threads`, the count the choice is remembered under."""
    import torch

    from specsample.models import choice

    before = torch.get_num_threads()
    threads, seen = (1 if before > 1 else 2), []

    def resolve(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise ValueError("measured")

    monkeypatch.setattr(choice, "resolve", resolve)
    try:
        code, _, err = cli(capsys, "bench", "run", "--model", str(tiny_dir), "--threads", str(threads),
                           "--out", str(tmp_path / "out"))
    finally:
        torch.set_num_threads(before)
    assert code == 2 and "measured" in err and seen == [threads]


def test_the_transformers_baseline_times_the_prompt_encoding_as_the_engine_does(monkeypatch, tiny_dir):
    import time

    from specsample.bench import baselines
    from specsample.models import load_model
    from specsample.sampling import SamplingParams

    encode = baselines.encode_prompt

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return encode(*args, **kwargs)

    monkeypatch.setattr(baselines, "encode_prompt", slow)
    runner = baselines.TransformersRunner(load_model(str(tiny_dir)), SamplingParams(temperature=0), max_new_tokens=1)
    assert runner.run([{"role": "user", "content": "w5 w9"}]).wall_seconds >= 0.3


@needs_kernels
def test_bench_batch_alternates_which_way_runs_first(monkeypatch, tiny_dir):
    from specsample.bench import batch as bench_batch

    order = []
    for name in ("alone", "batched"):
        real = getattr(bench_batch, name)
        monkeypatch.setattr(bench_batch, name, lambda *args, real=real, name=name: order.append(name) or real(*args))
    one, many = (SpecSampler.load(str(tiny_dir), "ngram", backend="fast") for _ in range(2))
    rows = bench_batch.run(one, many, ["w3 w4"], [[["w5 w6"]], [["w7 w8"]]], ["2"], max_batch=2, max_new_tokens=3)
    assert order[2:] == ["alone", "batched", "batched", "alone"]  # after the warm-up: round 0, then round 1
    assert [(r.round, r.mode) for r in rows] == [(0, "alone"), (0, "batch 2"), (1, "alone"), (1, "batch 2")]
    assert all(r.differing == 0 for r in rows[1::2])
