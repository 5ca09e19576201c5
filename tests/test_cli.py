"""The command line: end to end on a tiny model directory, and every bad argument."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specsample.cli import main, read_stdin


def cli(capsys, *args) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as done:
        code = done.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_line_module_loads_without_torch():
    """torch loads when a command needs it, inside `main`, where Ctrl-C is an exit code, not a traceback."""
    code = "import sys, specsample.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_ctrl_c_while_the_commands_load_is_exit_code_130(capsys, monkeypatch):
    import specsample.cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(specsample.cli, "mount_subcommands", interrupted)
    code, out, err = cli(capsys, "generate", "hi")
    assert code == 130 and out == err == ""


def test_generate_json_greedy_matches_transformers(capsys, tiny_dir):
    code, out, err = cli(capsys, "generate", "w5 w9 w7 w3", "--model", str(tiny_dir), "--no-chat",
                         "--temperature", "0", "--max-new-tokens", "12", "--json")
    assert code == 0, err
    result = json.loads(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = AutoTokenizer.from_pretrained(tiny_dir)("w5 w9 w7 w3", return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert result["token_ids"] == expected
    for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_second", "drafted_tokens", "accepted_tokens"):
        assert key in result["stats"]
    assert result["text"]


def test_generate_freezes_what_loading_left_for_the_collector(capsys, tiny_dir):
    """Once the model is loaded, a full collection no longer walks the objects of the imports and the
    model (`specsample.gcfreeze`): they are in the permanent generation."""
    gc.unfreeze()
    loaded_before = ["alive before the load"]  # a container: tracked by the collector
    code, _, err = cli(capsys, "generate", "w5 w9", "--model", str(tiny_dir), "--no-chat", "--max-new-tokens", "3")
    assert code == 0, err
    assert gc.get_freeze_count() > 10_000
    assert not any(o is loaded_before for o in gc.get_objects())  # frozen objects are not among the collected


def test_generate_with_a_draft_model_streams_the_same_text(capsys, tiny_dir, tiny_draft_dir):
    args = ["generate", "w5 w9 w7 w3", "--model", str(tiny_dir), "--no-chat", "--temperature", "0",
            "--max-new-tokens", "15"]
    code, plain, _ = cli(capsys, *args, "--json")
    code2, streamed, _ = cli(capsys, *args, "--drafter", str(tiny_draft_dir), "--k", "3", "--stream")
    assert code == code2 == 0
    plain = json.loads(plain)
    assert streamed.rstrip("\n") == plain["text"]


def test_prompt_from_stdin(capsys, monkeypatch, tiny_dir):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w9\n"))  # as `echo` writes it
    code, out, err = cli(capsys, "generate", "--model", str(tiny_dir), "--no-chat", "--max-new-tokens", "3",
                         "--seed", "1", "--json")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) <= 3
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w9\n\n"))
    assert read_stdin() == "w5 w9\n"  # the one newline `echo` adds is not part of the prompt


BAD = [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--k", "-1"], "k must be"),
    (["--k", "many"], "k must be"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--drafter", "no-such-drafter"], "unknown drafter"),
    (["--drafter", "suffix+no-such-drafter"], "unknown drafter 'no-such-drafter'"),
    (["--drafter", "quantized+suffix", "--max-new-tokens", "8"], "must be a lookup drafter (ngram, suffix, recycle, ...: a draft that is a function of the context), got 'quantized'"),
    (["--max-new-tokens", "lots"], "max-new-tokens"),
    (["--seed", "-1"], "seed must be an integer from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "seed must be an integer from 0 to 2**64 - 1"),
    (["--drafter", "none+suffix"], "an A+B drafter names two drafters"),
    (["--threads", "0"], "--threads must be from 1 to 512, got 0"),
    (["--threads", "-5", "--backend", "fast"], "--threads must be from 1 to 512, got -5"),
    (["--threads", "100000", "--backend", "llamacpp"], "--threads must be from 1 to 512, got 100000"),  # ggml segfaulted
    (["--drafter", "suffix+suffix+ngram"], "an A+B drafter names two drafters"),
]


def test_a_prompt_that_is_not_utf8_gives_one_line_and_exit_2(capsys, tiny_dir):
    """Bytes that are not UTF-8 in argv reach Python as lone surrogates, which the tokenizer cannot take."""
    code, out, err = cli(capsys, "generate", "w1 \udcff w2", "--model", str(tiny_dir), "--no-chat")
    assert code == 2 and err.strip() == "specsample: error: the prompt is not valid UTF-8 text: '\\udcff' at character 3"


def test_a_token_the_model_has_no_row_for_is_refused_in_one_line(capsys, tiny_dir, tmp_path):
    """A tokenizer with tokens the model does not have (w70 of an 80-word tokenizer over a 64-row model): in a
    prompt, exit code 2; in a prediction, a ValueError before the request joins a batch (it failed the batch)."""
    from conftest import tiny_tokenizer

    shutil.copytree(tiny_dir, tmp_path / "model")
    tiny_tokenizer(80).save_pretrained(tmp_path / "model")
    code, out, err = cli(capsys, "generate", "w2 w70", "--model", str(tmp_path / "model"), "--no-chat")
    assert code == 2 and err.strip() == ("specsample: error: the prompt encodes to token id 70, past the model's "
                                         "vocabulary of 64: the tokenizer has tokens the model does not")
    from specsample.api import SpecSampler

    sampler = SpecSampler.load(str(tmp_path / "model"), "none")
    with pytest.raises(ValueError, match="the prediction encodes to token id 70, past the model's vocabulary of 64"):
        sampler.generate_batch(["w2 w3"], chat=False, max_new_tokens=2, prediction="w2 w70")  # not a batch's failure


@pytest.mark.parametrize("args, message", BAD)
def test_bad_arguments_give_one_line_and_exit_2(capsys, tiny_dir, args, message):
    code, out, err = cli(capsys, "generate", "w1 w2", "--model", str(tiny_dir), "--no-chat", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--identity", "--seed", "-1"], "seed must be an integer from 0 to 2**64 - 1, got -1"),
    (["--identity", "--seed", str(2**64 - 2), "--seeds", "3"], "the last seed, --seed + --seeds - 1, must be an integer"),
    (["--seed", str(10**23)], "seed must be an integer from 0 to 2**64 - 1"),
])
def test_check_refuses_seeds_outside_64_bits_before_loading(capsys, args, message):
    code, out, err = cli(capsys, "check", "--model", "/nonexistent/model", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_train_draft_needs_prompts_of_some_kind(capsys, tiny_dir, tmp_path):
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path), "--model", str(tiny_dir))
    assert code == 2 and err.strip() == "specsample: error: give --prompts, --self-prompts, --extra-data or several of them"
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path), "--self-prompts", "2", "--extra-data", str(tmp_path))
    assert code == 2 and "no data shards in" in err and len(err.strip().splitlines()) == 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w2 w3\n")
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path / "o"), "--prompts", str(prompts), "--question-ids", "weird")
    assert code == 2 and err.strip() == "specsample: error: --question-ids must be one of all, odd, even, got 'weird'"


def test_train_draft_names_a_backend_it_cannot_write_on(capsys, tiny_dir, tmp_path):
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path), "--model", str(tiny_dir), "--self-prompts", "2",
                       "--backend", "nosuch")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nosuch" in err, err
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path), "--model", str(tiny_dir), "--self-prompts", "2",
                       "--backend", "gguf")
    assert code == 2 and err.strip() == f"specsample: error: the gguf backend runs GGUF files, and {tiny_dir} is not one"


@pytest.mark.parametrize("command", [("generate", "hi"), ("check", "--samples", "10"),
                                     ("train-draft", "--self-prompts", "2", "--out", "never-made")])
def test_llamacpp_without_llama_cpp_python_is_one_line_before_loading(capsys, monkeypatch, tmp_path, command):
    """llama-cpp-python is an optional extra: without it, --backend llamacpp is refused before the model loads
    (train-draft had loaded it, then left a manifest behind that refused the next run)."""
    import specsample.models
    from specsample.models import choice, loading

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(choice, "llamacpp_installed", lambda: False)
    for module in (loading, specsample.models):  # the commands call the name bound in specsample.models
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = cli(capsys, *command, "--backend", "llamacpp")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "needs llama-cpp-python" in err, err
    assert not (tmp_path / "never-made").exists()


def test_train_draft_refuses_an_output_it_cannot_write_before_loading(capsys, tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for out, message in [("", "--out is empty: name a path"), (str(a_file), f"--out {a_file} is a file, not a directory"),
                         (str(a_file / "head"), f"--out {a_file / 'head'}: {a_file} is a file")]:
        code, _, err = cli(capsys, "train-draft", "--out", out, "--model", "/nonexistent/model", "--self-prompts", "2")
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(("value", "message"), [("2,x", "--feature-layers must be comma-separated"),
                                                ("1,1", "feature_layers must be distinct layer numbers")])
def test_train_draft_refuses_bad_feature_layers(capsys, tiny_dir, tmp_path, value, message):
    code, _, err = cli(capsys, "train-draft", "--out", str(tmp_path), "--extra-data", str(tmp_path), "--feature-layers", value)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_draft_with_another_vocabulary_drafts_the_same_text(capsys, tiny_dir, other_vocab_dir):
    args = ["generate", "w5 w9 w7 w3", "--model", str(tiny_dir), "--no-chat", "--temperature", "0",
            "--max-new-tokens", "12", "--json"]
    code, plain, _ = cli(capsys, *args)
    code2, drafted, err = cli(capsys, *args, "--drafter", str(other_vocab_dir), "--k", "3")
    assert code == code2 == 0, err
    assert json.loads(drafted)["token_ids"] == json.loads(plain)["token_ids"]
    assert json.loads(drafted)["stats"]["drafted_tokens"] > 0


def test_directory_without_safetensors_is_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    code, _, err = cli(capsys, "generate", "hi", "--model", str(tmp_path))
    assert code == 2 and "safetensors" in err


def copy_of(directory: Path, into: Path, *, without: str | None = None) -> Path:
    shutil.copytree(directory, into)
    if without:
        for path in into.glob(without):
            path.unlink()
    return into


@pytest.mark.parametrize("role", ["--model", "--drafter"])
def test_corrupt_weights_are_named_in_one_line(capsys, tiny_dir, tmp_path, role):
    """A safetensors file cut short: safetensors' own error, which is neither ValueError nor OSError."""
    broken = copy_of(tiny_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    args = ["--model", str(tiny_dir), "--drafter", str(broken)] if role == "--drafter" else ["--model", str(broken)]
    code, out, err = cli(capsys, "generate", "w2 w3", "--no-chat", *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"cannot read the weights in {broken}" in err


@pytest.mark.parametrize("spec, message", [
    ("nosuch", "unknown drafter 'nosuch'"), ("suffix+nosuch", "unknown drafter 'nosuch'"),
    ("nosuch:/tmp", "unknown drafter 'nosuch:/tmp'"), ("none+suffix", "an A+B drafter names two drafters"),
    ("suffix+ngram+head", "an A+B drafter names two drafters"), ("", "the drafter '' names no draft model"),
    ("text:", "the drafter 'text:' names no draft model"), ("head: ", "the drafter 'head: ' names no draft model"),
    ("suffix+draft-tree:", "the drafter 'draft-tree:' names no draft model"),
    ("/nope/x.gguf", "draft model path does not exist: /nope/x.gguf"), ("text:small.gguf", "draft model path does not exist"),
])
def test_a_drafter_spec_naming_no_drafter_is_refused_before_loading(capsys, monkeypatch, spec, message):
    """`check_spec` parses as `make_drafter` does (one `parse_spec`), so what the text alone rules out
    never waits for a model to load."""
    import specsample.api

    monkeypatch.setattr(specsample.api, "resolve", lambda *a, **k: pytest.fail("resolved the model"))
    code, out, err = cli(capsys, "generate", "hi", "--drafter", spec)
    assert code == 2 and out == "" and f"specsample: error: {message}" in err


def test_an_empty_stop_string_is_refused_before_loading(capsys, monkeypatch):
    from specsample.api import SpecSampler

    monkeypatch.setattr(SpecSampler, "load", lambda *a, **k: pytest.fail("loaded"))
    code, out, err = cli(capsys, "generate", "hi", "--stop", "")
    assert code == 2 and out == "" and err.strip() == "specsample: error: a stop string must not be empty"


def test_a_directory_without_tokenizer_says_so(capsys, tiny_dir, tmp_path):
    bare = copy_of(tiny_dir, tmp_path / "bare", without="tokenizer*")
    code, _, err = cli(capsys, "generate", "w2 w3", "--no-chat", "--model", str(bare))
    assert code == 2 and err.strip() == f"specsample: error: no tokenizer in {bare} (none of tokenizer.json, " \
        "tokenizer.model, vocab.json, tokenizer_config.json)"


@pytest.mark.slow
def test_console_script_on_the_bundled_model():
    done = subprocess.run(
        [sys.executable, "-m", "specsample.cli", "generate", "What is 2+2?", "--temperature", "0",
         "--max-new-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert len(result["token_ids"]) <= 8 and result["text"]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [[], ["bench"]])
def test_a_command_group_alone_prints_its_help(capsys, args):
    """`specsample` and `specsample bench` alone: the usage and the commands, exit code 0 (not one error line)."""
    code, out, err = cli(capsys, *args)
    usage = out.splitlines()[0] if out else ""
    assert code == 0 and usage.startswith("Usage: ") and usage.endswith(" ".join([*args, "[OPTIONS] COMMAND [ARGS]..."]))
    assert "Commands:" in out and not err


@pytest.mark.parametrize("threads", [1, None])
def test_threads_hold_for_every_backend(tiny_dir, threads):
    """`--threads` on the fast backend (it held for llamacpp alone): set before torch loads, every OpenMP
    team of the process (torch's and the kernels') starts from it, a server's decoding thread too."""
    given = [] if threads is None else ["--threads", str(threads)]
    script = (f"from specsample.cli import main; main({['generate', 'w5 w6', '--model', str(tiny_dir), '--no-chat', '--backend', 'fast', '--max-new-tokens', '2', *given]!r}); "
              "import torch, threading; seen = []; t = threading.Thread(target=lambda: seen.append(torch.get_num_threads())); "
              "t.start(); t.join(); print(torch.get_num_threads(), seen[0])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"})
    assert done.returncode == 0, done.stderr
    main_thread, other_thread = done.stdout.split()[-2:]
    assert main_thread == other_thread == str(threads or main_thread), done.stdout


def test_train_draft_with_every_prompt_held_out_is_one_line_and_exit_2(capsys, tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w2 w6\n")
    common = ["train-draft", "--model", str(tiny_dir), "--prompts", str(prompts), "--steps", "1", "--seq-len", "8",
              "--batch-size", "2", "--generate-batch", "1", "--max-new-tokens", "4", "--vocab-subset", "0"]
    code, _, err = cli(capsys, *common, "--out", str(tmp_path / "a"), "--holdout", "0.999")
    last = err.strip().splitlines()[-1]  # after the data's progress bars
    assert code == 2 and "Traceback" not in err and last.startswith("specsample: error: every prompt of the data (1) falls")
    assert "--holdout 0" in last
    code, _, err = cli(capsys, *common, "--out", str(tmp_path / "b"), "--holdout", "1.5")
    assert code == 2 and "holdout must be in [0, 1), got 1.5" in err
