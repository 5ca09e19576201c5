"""The prompt reader: Spec-Bench, `prompt` and plain-text files, splits by question_id, the packaged prompts,
and the bench commands reading them from any directory."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from specsample.prompts import in_split, packaged_prompts, read_prompts

from test_cli import cli

SPEC_BENCH_TASKS = {"translation", "summarization", "qa", "math_reasoning", "rag"}  # and MT-bench's eight categories
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def spec_bench_file(tmp_path):
    """Six Spec-Bench rows, question_ids 1..6, alternating between two categories."""
    path = tmp_path / "bench.jsonl"
    write_jsonl(path, [{"question_id": i, "category": "qa" if i % 3 else "rag", "turns": [f"w{i + 1}", "w9"]}
                       for i in range(1, 7)])
    return path


def test_limits_apply_per_category_and_categories_filter(spec_bench_file):
    prompts = read_prompts(spec_bench_file, limit=1)
    assert [(p.question_id, p.category, p.turns) for p in prompts] == [(1, "qa", ("w2", "w9")), (3, "rag", ("w4", "w9"))]
    assert [p.question_id for p in read_prompts(spec_bench_file, categories=["rag"])] == [3, 6]


@pytest.mark.parametrize("split, ids", [("all", [1, 2, 3, 4, 5, 6]), ("odd", [1, 3, 5]), ("even", [2, 4, 6])])
def test_splits_select_question_ids_by_parity(spec_bench_file, split, ids):
    assert [p.question_id for p in read_prompts(spec_bench_file, split=split)] == ids


def test_skip_drops_the_first_prompts_of_each_category_before_the_split(spec_bench_file):
    # qa: 1, 2, 4, 5; rag: 3, 6. Skipping 2 per category leaves qa 4, 5 and rag nothing; then the odd ones.
    assert [p.question_id for p in read_prompts(spec_bench_file, skip=2)] == [4, 5]
    assert [p.question_id for p in read_prompts(spec_bench_file, skip=2, split="odd")] == [5]
    with pytest.raises(ValueError, match="no prompts of split even past the first 2 of each category"):
        read_prompts(spec_bench_file, skip=2, split="even", categories=["rag"])
    with pytest.raises(ValueError, match="skip must be >= 0"):
        read_prompts(spec_bench_file, skip=-1)


def test_the_never_tuned_split_of_the_packaged_prompts_has_no_tuned_prompt():
    tuned = {p.question_id for p in read_prompts(packaged_prompts(), limit=6)}
    untuned = read_prompts(packaged_prompts(), split="odd", skip=6)
    assert untuned and not tuned & {p.question_id for p in untuned}
    assert {p.category for p in untuned} == SPEC_BENCH_TASKS  # MT-bench's 5-prompt sub-categories are all tuned


def test_a_split_keeps_prompts_without_question_ids_and_refuses_other_names(tmp_path, spec_bench_file):
    text = tmp_path / "own.txt"
    text.write_text("first prompt\n\n  second prompt \n")
    mine = tmp_path / "mine.jsonl"
    write_jsonl(mine, [{"prompt": "p"}, {"question_id": 8, "prompt": "q8"}])
    prompts = read_prompts(text, mine, spec_bench_file, split="odd")
    assert [p.turns[0] for p in prompts] == ["first prompt", "second prompt", "p", "w2", "w4", "w6"]
    assert in_split(None, "even") and not in_split(8, "odd") and in_split(8, "even")
    with pytest.raises(ValueError, match="split must be one of all, odd, even, got 'halves'"):
        read_prompts(spec_bench_file, split="halves")
    with pytest.raises(ValueError, match="the odd split needs integer question_ids, got 'q1'"):
        in_split("q1", "odd")
    with pytest.raises(ValueError, match="needs integer question_ids, got True"):
        in_split(True, "odd")


def test_bad_files_are_clear_errors(tmp_path, spec_bench_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n')
    assert read_prompts(bad)[0].category is None  # enough to train on
    with pytest.raises(ValueError, match="bad.jsonl:1: .*no category"):
        read_prompts(bad, spec_bench=True)  # not for a benchmark
    bad.write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*non-empty list"):
        read_prompts(bad)
    plain = tmp_path / "plain.txt"
    plain.write_text("hi\n")
    with pytest.raises(ValueError, match="not a Spec-Bench prompts file"):
        read_prompts(plain, spec_bench=True)
    with pytest.raises(FileNotFoundError, match="prompts file not found"):
        read_prompts(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match=f"prompts file {tmp_path} is a directory"):
        read_prompts(tmp_path)
    plain.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=f"prompts file {plain} is not UTF-8 text"):
        read_prompts(plain)
    with pytest.raises(ValueError, match=r"no category 'math' in .* \(its categories: qa, rag\)"):
        read_prompts(spec_bench_file, split="odd", categories=["math"])  # a misspelled category is not dropped
    with pytest.raises(ValueError, match="no prompts of split odd past the first 2 of each category in category 'rag'"):
        read_prompts(spec_bench_file, split="odd", skip=2, categories=["qa", "rag"])  # nor one left empty
    listed = tmp_path / "listed.jsonl"
    listed.write_text('{"question_id": [1], "category": "qa", "turns": ["a"]}\n')
    with pytest.raises(ValueError, match=r"listed.jsonl:1: .*question_id must be an integer or a string, got \[1\]"):
        read_prompts(listed, spec_bench=True)
    for category in ("null", "5", '""'):  # a category names a table's column: a report of None had failed
        odd = tmp_path / "category.jsonl"
        odd.write_text(f'{{"question_id": 1, "category": {category}, "turns": ["a"]}}\n')
        with pytest.raises(ValueError, match=r"category.jsonl:1: .*category must be a non-empty string"):
            read_prompts(odd, spec_bench=True)
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"question_id": 7, "category": "qa", "turns": ["a"]}\n' * 2)
    assert len(read_prompts(twice)) == 2  # training takes both
    with pytest.raises(ValueError, match="question_id 7 appears twice"):
        read_prompts(twice, spec_bench=True)  # the harness keyed the second's answers over the first's


def test_the_packaged_spec_bench_prompts():
    """240 prompts of Spec-Bench's six tasks (MT-bench's eight categories, five of 40 prompts each), half of
    them in each split, shipped with their license and source."""
    path = packaged_prompts()
    assert (path.parent / "LICENSE").read_text().startswith("Apache License")
    assert "github.com/hemingkx/Spec-Bench" in (path.parent / "README.md").read_text()
    prompts = read_prompts(path, spec_bench=True)
    counts = Counter(p.category for p in prompts)
    assert len(prompts) == 240 and set(counts) == SPEC_BENCH_TASKS | MT_BENCH
    assert all(counts[c] == 40 for c in SPEC_BENCH_TASKS) and all(counts[c] == 5 for c in MT_BENCH)
    odd, even = read_prompts(path, split="odd"), read_prompts(path, split="even")
    assert len(odd) + len(even) == 240 and {p.question_id % 2 for p in odd} == {1} and {p.question_id % 2 for p in even} == {0}


def test_bench_run_and_decode_read_the_split(capsys, tmp_path, spec_bench_file, tiny_dir):
    out = tmp_path / "run"
    code, _, err = cli(capsys, "bench", "run", "--model", str(tiny_dir), "--prompts", str(spec_bench_file),
                       "--split", "odd", "--no-baselines", "--warmup", "0", "--max-new-tokens", "2", "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert {r["question_id"] for r in results["records"]} == {1, 3, 5} and results["meta"]["split"] == "odd"
    assert results["meta"]["categories_left_out"] == []
    out = tmp_path / "skipped"
    code, _, err = cli(capsys, "bench", "run", "--model", str(tiny_dir), "--prompts", str(spec_bench_file), "--skip", "2",
                       "--no-baselines", "--warmup", "0", "--max-new-tokens", "2", "--out", str(out))
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["meta"]["categories_left_out"] == ["rag"]
    assert "past the first 2 of each category), so not in the tables: rag" in (out / "notes.md").read_text()
    decoded = tmp_path / "decode.json"
    code, _, err = cli(capsys, "bench", "decode", "--model", str(tiny_dir), "--prompts", str(spec_bench_file),
                       "--split", "even", "--limit", "2", "--max-new-tokens", "2", "--json", str(decoded))
    assert code == 0, err
    assert {r["question_id"] for r in json.loads(decoded.read_text())["records"]} == {2, 4}


def test_train_draft_question_ids_are_the_same_split(capsys, tmp_path, tiny_dir):
    """train-draft keeps its option name; the rows it trains on are those `--split odd` selects."""
    path = tmp_path / "bench.jsonl"
    write_jsonl(path, [{"question_id": i, "turns": [f"w{i + 1} w{i + 4}", "w9"]} for i in range(1, 6)])  # 3 odd, 2 even
    code, out, err = cli(capsys, "train-draft", "--out", str(tmp_path / "head"), "--model", str(tiny_dir), "--prompts",
                         str(path), "--question-ids", "odd", "--steps", "1", "--eval-every", "1", "--max-new-tokens", "3",
                         "--vocab-subset", "0", "--batch-size", "2", "--seq-len", "8")
    assert code == 0, err
    assert json.loads(out)["sequences"] == 3
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path / "head"), "--prompts", str(path), "--question-ids", "1")
    assert code == 2 and "--question-ids must be one of all, odd, even, got '1'" in err


def test_copy_bound_refuses_a_bad_split(capsys, spec_bench_file):
    code, _, err = cli(capsys, "bench", "copy-bound", "--prompts", str(spec_bench_file), "--split", "thirds")
    assert code == 2 and err.strip() == "specsample: error: split must be one of all, odd, even, got 'thirds'"


@pytest.mark.slow
def test_bench_run_works_from_any_directory(tmp_path):
    """As after `pip install`: started outside the repository, it finds the packaged prompts and the bundled model."""
    done = subprocess.run([sys.executable, "-m", "specsample.cli", "bench", "run", "--limit", "1", "--max-new-tokens", "16",
                           "--no-baselines", "--category", "qa", "--category", "writing"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "bench-results" / "table.md").read_text()
    assert done.stdout == table and "| plain |" in table and "| writing | qa | overall |" in table
