"""Write a Llama-shaped model of about 1B parameters with random weights as a GGUF F32 file, and
quantize it to Q4_0 and Q8_0 with llama.cpp's own quantizer (issue 22: the larger model for
timing the llamacpp backend; timing needs no trained weights).

    python benchmarks/make_random_llama_gguf.py --out /tmp/specsample-1b            # write F32, Q4_0, Q8_0
    python benchmarks/make_random_llama_gguf.py --out /tmp/specsample-1b --measure Q4_0 --tokens 64
    python benchmarks/make_random_llama_gguf.py --shape qwen3-0.6b --out /tmp/specsample-qwen3

`--shape qwen3-0.6b` writes Qwen3-0.6B's shape instead (architecture qwen3: hidden 1024, 28 layers,
intermediate 3072, 16 query heads and 8 KV heads of 128, a norm of each query and key head, tied
output) with the bundled vocabulary of 49152 tokens against Qwen3's 151,936: 0.49B parameters
against 0.60B, the tied head a third of its size. Files are named random-<shape>-<type>.gguf.

The shape (defaults) is TinyLlama's width with 16 layers: hidden 2048, intermediate 5632, 32
query heads and 4 KV heads of 64, vocabulary 49152, untied output: 0.91B parameters, 3.6 GB in
F32 (Q4_0 0.54 GB, Q8_0 0.96 GB). The tokenizer metadata (vocabulary, merges, special tokens, chat template) is copied from
the bundled SmolLM2 GGUF, so llama.cpp and the tokenizer-only loading both load the file.
Tensors are written one at a time (the writer's streaming API), so writing needs about one
tensor's memory, not the model's.

`--measure TYPE` loads that file with the llamacpp backend in a child process and reports
plain greedy decoding's tokens per second and the child's peak resident memory from the model's
load on (over the runtime it held before) against the file size and the KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    name: str = "1b"
    arch: str = "llama"
    hidden: int = 2048
    layers: int = 16
    intermediate: int = 5632
    heads: int = 32
    kv_heads: int = 4
    head_size: int | None = None  # None: hidden / heads
    tied: bool = False  # the output is the token embedding (no output.weight)
    vocab: int = 49152
    context: int = 2048

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """GGUF tensor names and numpy shapes ([rows, columns] = [out, in]), in file order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            out += [
                (f"blk.{i}.attn_norm.weight", (self.hidden,)),
                (f"blk.{i}.attn_q.weight", (q, self.hidden)),
                (f"blk.{i}.attn_k.weight", (kv, self.hidden)),
                (f"blk.{i}.attn_v.weight", (kv, self.hidden)),
                (f"blk.{i}.attn_output.weight", (self.hidden, q)),
            ]
            if self.arch == "qwen3":
                out += [(f"blk.{i}.attn_q_norm.weight", (self.head_dim,)), (f"blk.{i}.attn_k_norm.weight", (self.head_dim,))]
            out += [
                (f"blk.{i}.ffn_norm.weight", (self.hidden,)),
                (f"blk.{i}.ffn_gate.weight", (self.intermediate, self.hidden)),
                (f"blk.{i}.ffn_up.weight", (self.intermediate, self.hidden)),
                (f"blk.{i}.ffn_down.weight", (self.hidden, self.intermediate)),
            ]
        return out + [("output_norm.weight", (self.hidden,))] + ([] if self.tied else [("output.weight", (self.vocab, self.hidden))])

    def parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())


SHAPES = {
    "1b": Shape(),
    "qwen3-0.6b": Shape(
        name="qwen3-0.6b", arch="qwen3", hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8,
        head_size=128, tied=True, context=4096,
    ),
}


def add_hyperparameters(writer, shape: Shape) -> None:
    """The architecture's keys for `shape`, F32 file type."""
    import gguf

    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(10000.0 if shape.arch == "llama" else 1000000.0)
    writer.add_layer_norm_rms_eps(1e-5 if shape.arch == "llama" else 1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(shape.vocab)


def copy_tokenizer(writer, source: Path) -> int:
    """Every `tokenizer.*` key of the GGUF file `source`, as it is there; returns its vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub_type=sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Norm weights 1, matrices N(0, 0.02^2), float32."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))


def write_f32(path: Path, shape: Shape, tokenizer_source: Path, seed: int) -> Path:
    """The random model as an F32 GGUF file, tensors streamed one at a time."""
    import gguf

    writer = gguf.GGUFWriter(str(path), shape.arch)
    add_hyperparameters(writer, shape)
    vocab = copy_tokenizer(writer, tokenizer_source)
    if vocab != shape.vocab:
        raise SystemExit(f"the tokenizer of {tokenizer_source} has {vocab} tokens, the shape {shape.vocab}")
    tensors = shape.tensors()
    for name, dims in tensors:
        writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:
        writer.write_tensor_data(random_tensor(rng, dims))
    writer.close()
    return path


def make(out: Path, shape: Shape, seed: int, types: list[str], threads: int | None) -> dict[str, Path]:
    """F32 and the quantized files under `out` (existing ones kept), with the seconds each took."""
    from specsample.models.llamacpp import default_threads, quantize
    from specsample.models.loading import bundled_gguf

    out.mkdir(parents=True, exist_ok=True)
    f32 = out / f"random-{shape.name}-F32.gguf"
    files = {"F32": f32}
    if not f32.is_file():
        start = time.perf_counter()
        write_f32(f32, shape, bundled_gguf(), seed)
        print(f"wrote {f32}: {shape.parameters() / 1e9:.2f}B parameters, {f32.stat().st_size / 1e9:.2f} GB, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    for name in types:
        path = files[name] = out / f"random-{shape.name}-{name}.gguf"
        if not path.is_file():
            start = time.perf_counter()
            quantize(f32, path, name, threads or default_threads())
            print(f"quantized to {path}: {path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - start:.0f} s", flush=True)
    return files


def decode_in_this_process(path: Path, tokens: int, threads: int | None) -> dict:
    """Plain greedy decoding of `tokens` tokens on the llamacpp backend after a short chat prompt:
    tokens per second of decoding, file and KV cache sizes, and resident memory: the runtime held
    before the model loads (Python, torch, the tokenizer by the tokenizer-only path, llama.cpp's
    libraries), and the peak from there on (VmHWM, reset through /proc/self/clear_refs)."""
    from specsample.api import SpecSampler
    from specsample.models.llamacpp import LlamaCppTarget, init_backend
    from specsample.models.loading import load_model

    loaded = load_model(path, tokenizer_only=True)
    init_backend()
    runtime, runtime_peak = proc_status("VmRSS"), proc_status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")
    target = LlamaCppTarget(path, n_threads=threads)
    sampler = SpecSampler.build(loaded, target, "none", backend="llamacpp")
    sampler.generate("Warm up.", max_new_tokens=2, temperature=0)
    out = sampler.generate("Write a story about the sea.", max_new_tokens=tokens, temperature=0, k=0)
    return {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "kv_cache_bytes": target.kv_cache_bytes(),
        "context": target.max_length,
        "threads": target.n_threads,
        "new_tokens": len(out.token_ids),
        "tokens_per_second": out.stats.tokens_per_second,
        "runtime_rss_bytes": runtime,
        "runtime_peak_rss_bytes": runtime_peak,
        "peak_rss_bytes": proc_status("VmHWM"),  # from the model's load on (not ru_maxrss: Linux keeps the parent's)
    }


def proc_status(key: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def measure(path: Path, tokens: int, threads: int | None) -> dict:
    """`decode_in_this_process` in a child process (its peak memory is its own)."""
    command = [sys.executable, __file__, "--child", str(path), "--tokens", str(tokens)]
    if threads:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    used = result["peak_rss_bytes"] - result["runtime_rss_bytes"]  # the model and decoding
    result["model_and_decoding_over_file"] = used / result["file_bytes"]
    result["model_and_decoding_over_1.3_file_plus_kv"] = used / (1.3 * result["file_bytes"] + result["kv_cache_bytes"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/specsample-1b"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--types", default="Q4_0,Q8_0", help="comma-separated llama.cpp file types to quantize to")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--measure", default=None, help="after making the files, decode with this one (e.g. Q4_0)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(decode_in_this_process(args.child, args.tokens, args.threads)))
        return
    shape = SHAPES[args.shape] if args.layers is None else replace(SHAPES[args.shape], layers=args.layers)
    files = make(args.out, shape, args.seed, [t for t in args.types.split(",") if t], args.threads)
    if args.measure:
        print(json.dumps(measure(files[args.measure], args.tokens, args.threads), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
