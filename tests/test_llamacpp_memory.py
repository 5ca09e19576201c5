"""Issue 22 item 6 on the llamacpp backend: files llama.cpp cannot load, and peak memory.

Bad input: a file that is not a GGUF, a GGUF cut short in its header or in its tensor data, and
a GGUF of an architecture llama.cpp does not know, each with `--backend llamacpp`: `generate`,
`check` and `serve` end with one line on stderr (llama.cpp's own log included: the capture is
of file descriptor 2) and exit code 2, and `serve` never starts its server.

Memory: a child process decodes with the bundled model on llama.cpp; its peak resident memory
from just before the model is loaded to the end of decoding must stay within 1.3 times the GGUF
file's size plus the KV cache (no float32 copy of the weights: that alone would be 5.7 times
the file). What the child held before (the Python/torch runtime, the tokenizer, llama.cpp's
libraries) is the allowance, measured in the child and reported.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from specsample.models.llamacpp import quantize
from specsample.models.loading import bundled_gguf
from test_cli import cli
from test_llamacpp import tiny_gguf, tiny_model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.llamacpp  # skipped without llama-cpp-python (conftest.py)

MB = 2**20


def unknown_architecture(path: Path) -> Path:
    """A well-formed GGUF file of an architecture llama.cpp does not know."""
    writer = gguf.GGUFWriter(str(path), "nosucharch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cut(source: Path, path: Path, size: int) -> Path:
    """The first `size` bytes of `source`."""
    path.write_bytes(source.read_bytes()[:size])
    return path


@pytest.fixture(scope="module")
def bad_files(tiny_gguf, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each kind of bad file, and what its error names."""
    directory = tmp_path_factory.mktemp("bad")
    (directory / "text.gguf").write_text("not a gguf file at all\n")
    size = tiny_gguf.stat().st_size
    return {
        "not a GGUF": (directory / "text.gguf", "invalid magic"),
        "truncated header": (cut(tiny_gguf, directory / "header.gguf", 100), "llama.cpp cannot load"),
        "truncated data": (cut(tiny_gguf, directory / "data.gguf", size // 2), "not within the file bounds"),
        "unknown architecture": (unknown_architecture(directory / "arch.gguf"), "unknown model architecture: 'nosucharch'"),
    }


COMMANDS = {
    "generate": ("generate", "hello"),
    "check": ("check", "--samples", "10"),
    "serve": ("serve", "--port", "1"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["not a GGUF", "truncated header", "truncated data", "unknown architecture"])
def test_a_file_llama_cpp_cannot_load_gives_one_line_and_exit_2(capfd, monkeypatch, bad_files, command, kind):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started on a model it cannot load"))
    path, message = bad_files[kind]
    code, out, err = cli(capfd, *COMMANDS[command], "--model", str(path), "--backend", "llamacpp", "--threads", "1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("specsample: error: llama.cpp cannot load") and message in lines[0], lines[0]
    assert out == ""


@pytest.mark.parametrize("backend", ["gguf", "fast"])
@pytest.mark.parametrize(("kind", "message"), [("not a GGUF", "is not a GGUF file"),
                                               ("truncated header", "ends inside its GGUF header"),
                                               ("truncated data", "past the end of the file")])
def test_the_project_s_backends_name_what_is_wrong_with_the_file(capfd, bad_files, backend, kind, message):
    """The blocks and the float32 conversion read the file with the project's own header reader
    (`TensorIndex`) before anything else does: one line naming the problem, not a converter's traceback."""
    path, _ = bad_files[kind]
    code, out, err = cli(capfd, "generate", "hello", "--model", str(path), "--backend", backend)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("specsample: error: ") and message in err and str(path) in err, err


def with_value(source: Path, path: Path, key: str, value: int) -> Path:
    """A copy of the GGUF file `source` with the integer metadata value `key` set to `value`."""
    data = bytearray(source.read_bytes())
    at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
    kind = struct.unpack_from("<I", data, at)[0]
    struct.pack_into({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[kind], data, at + 4, value)
    path.write_bytes(data)
    return path


def with_tensor_type(source: Path, path: Path, name: str, kind: int) -> Path:
    """A copy of `source` whose tensor `name` is said to be of GGML type `kind`."""
    data = bytearray(source.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * dims, kind)
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def corrupt_headers(tiny_gguf, tiny_model, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Well-formed GGUF files whose header says something impossible, and what the error names."""
    directory = tmp_path_factory.mktemp("corrupt")
    config = tiny_model.config
    blocks = config.num_hidden_layers
    return {
        "no KV heads": (with_value(tiny_gguf, directory / "kv0.gguf", "llama.attention.head_count_kv", 0),
                        "llama.attention.head_count_kv is 0, not a positive count"),
        "uneven KV heads": (with_value(tiny_gguf, directory / "kv3.gguf", "llama.attention.head_count_kv", 3),
                            f"{config.num_attention_heads} attention heads cannot share 3 KV heads evenly"),
        "a block too many": (with_value(tiny_gguf, directory / "blocks.gguf", "llama.block_count", blocks + 1),
                             f"its header says {blocks + 1} blocks, and the tensors of block {blocks} are missing"),
        "unknown tensor type": (with_tensor_type(tiny_gguf, directory / "type.gguf", "output_norm.weight", 99),
                                "tensor output_norm.weight of"),
        "a token past the vocabulary": (with_value(tiny_gguf, directory / "eos.gguf", "tokenizer.ggml.eos_token_id",
                                                   9_999_999), "transformers cannot convert"),
    }


@pytest.mark.parametrize("backend", ["gguf", "fast", "llamacpp", "transformers"])
@pytest.mark.parametrize("kind", ["no KV heads", "uneven KV heads", "a block too many", "unknown tensor type",
                                  "a token past the vocabulary"])
def test_a_header_that_says_something_impossible_is_one_line(capfd, corrupt_headers, backend, kind):
    """Not a crash in the kernels (0 KV heads divided by zero), a layer of random weights made up for a
    missing block, or a converter's traceback."""
    path, message = corrupt_headers[kind]
    code, out, err = cli(capfd, "generate", "hello", "--model", str(path), "--backend", backend, "--threads", "1",
                         "--max-new-tokens", "2")
    if kind == "a token past the vocabulary" and backend == "llamacpp":  # llama.cpp reads the file itself
        assert code in (0, 2) and "Traceback" not in err, err
        return
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and (message in err or backend == "llamacpp" and "llama.cpp cannot load" in err), err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_refuses_to_start_in_one_line(bad_files):
    """`specsample serve` as a user runs it: the model loads before uvicorn starts, so a bad file ends
    the process with one line and exit code 2 and nothing ever listens."""
    path, message = bad_files["unknown architecture"]
    port = free_port()
    command = [sys.executable, "-m", "specsample.cli", "serve", "--model", str(path), "--backend", "llamacpp",
               "--port", str(port)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"specsample: error: llama.cpp cannot load {path}: error loading model: "
                                                f"{message}"]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


# The child: the runtime first (torch, specsample, the tokenizer by the tokenizer-only path that
# load_target takes for llamacpp, llama.cpp's libraries), then the peak is reset (VmHWM, through
# /proc/self/clear_refs) and the model loaded and decoded by the engine.
CHILD = r"""
import json, sys
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
import torch, specsample
bare = status("VmHWM")  # not ru_maxrss: Linux carries it over from the parent through fork and exec
from specsample.api import SpecSampler
from specsample.models.llamacpp import LlamaCppTarget, init_backend
from specsample.models.loading import bundled_gguf, load_model
loaded = load_model(tokenizer_only=True)
assert loaded.model is None
init_backend()
runtime = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size starts again from here
target = LlamaCppTarget(sys.argv[3] if len(sys.argv) > 3 else bundled_gguf(), n_threads=1)
sampler = SpecSampler.build(loaded, target, "none", backend="llamacpp")
out = sampler.generate(sys.argv[1], max_new_tokens=int(sys.argv[2]), temperature=0)
print(json.dumps({"bare_import": bare, "runtime": runtime, "peak": status("VmHWM"), "file": target.path.stat().st_size,
                  "kv_cache": target.kv_cache_bytes(), "new_tokens": len(out.token_ids)}))
"""


@pytest.fixture(scope="module")
def q4_0_copy(tmp_path_factory) -> Path:
    """A Q4_0 copy of the bundled model: llama.cpp repacks its weights on x86 without AMX (`repack_is_batch_invariant`)."""
    return quantize(bundled_gguf(), tmp_path_factory.mktemp("q4_0") / "Q4_0.gguf", "Q4_0", threads=2)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("file", ["bundled Q4_1", "Q4_0 copy"])
def test_peak_memory_while_decoding_is_within_1_3_times_the_file_plus_the_kv_cache(request, file):
    """The Q4_0 copy is repacked on x86 without AMX: mapped, the file's pages had stayed resident beside the repacked
    copy (`reads_instead_of_mapping`)."""
    prompt = "Summarize in three sentences why the sky is blue, and why sunsets are red. " * 4
    path = [str(request.getfixturevalue("q4_0_copy"))] if file == "Q4_0 copy" else []
    done = subprocess.run([sys.executable, "-c", CHILD, prompt, "48", *path], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.strip().splitlines()[-1])
    budget = 1.3 * m["file"] + m["kv_cache"]
    used = m["peak"] - m["runtime"]
    report = (f"model and decoding {used / MB:.0f} MB against 1.3 x {m['file'] / MB:.0f} MB file + {m['kv_cache'] / MB:.0f} MB "
              f"KV cache = {budget / MB:.0f} MB; allowance: runtime before the load {m['runtime'] / MB:.0f} MB "
              f"(bare import torch, specsample: {m['bare_import'] / MB:.0f} MB); {m['new_tokens']} tokens")
    print(report)
    assert m["new_tokens"] > 0
    assert used <= budget, report
