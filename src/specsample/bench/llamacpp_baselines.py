"""llama.cpp's own decoding, as baselines of a benchmark run on the llamacpp backend.

Three baselines, each answering the same prompts as the engine (the chat template applied
by the same tokenizer) on the same GGUF file at the same thread count:

- `llamacpp-plain`: llama.cpp's plain decoding, a loop over llama-cpp-python's low-level API
  in this process (`llama_decode` of one token, then llama.cpp's own sampler,
  `llama_sampler_init_greedy` at temperature 0), with llama.cpp's default model and context
  settings (flash attention as llama.cpp decides; its extra weight buffer types, repacked and
  AMX layouts, unless a probe in a child process finds that they crash a batched pass here),
  except the context window, which is the engine's, and the threads.
- `llamacpp-lookup`: `llama-lookup`, llama.cpp's prompt-lookup decoding (n-gram drafts from
  the prompt and the output), K draft tokens at most (`--spec-draft-n-max`).
- `llamacpp-lookup-invariant`: `llama-lookup` again, built with the project's batch-invariant
  patch and run with the backend's settings (flash attention, 256-token ubatches, repacking where
  the backend repacks): llama.cpp's stock build verifies drafts with other kernels than it decodes
  one token with, so at temperature 0 `llama-lookup` leaves plain decoding's text at a near tie
  (27 of 30 Spec-Bench answers on the bundled model, often into a repetition that its lookup then
  drafts well) and its speed is measured on other, often longer, text. This one decodes plain
  decoding's text, so its rate compares with the engine's answer for answer.
- `llamacpp-speculative`: `llama-speculative-simple`, llama.cpp's draft-model speculative
  decoding, with a draft GGUF file (the configuration's `drafter`) and K draft tokens at most.

The tools are built by `scripts/build_llamacpp_tools.sh` into `tools_dir()` (with `PATCHED=1`, the
batch-invariant ones into `tools_dir(invariant=True)`); where they are not, the run reports those
baselines as not available. Each tool call loads the model anew
(a process per answer), which is not timed: the rates are the tools' own timings of their
prompt processing ("encoded ... in S seconds") and decoding ("decoded N tokens in S seconds").
The tools get the chat prompt as text (`-bf`, no escape processing) and tokenize it themselves;
their token count of it is the record's prompt_tokens.

Timing, as the engine's: the engine's prefill is the prompt but its last token, and its
decoding starts with the pass over the last prompt token, so decode tokens/s = generated
tokens / decode seconds counts a pass per output token. `llamacpp-plain` is timed the same way.
`llama-speculative-simple` splits the prompt the same way. `llama-lookup` decodes the whole
prompt before its timer and samples its first token from that pass, so its decode rate counts
the tokens after the first (generated - 1) over its decode time. End-to-end time (the
`speedup` column) is prefill plus decoding for every baseline, without model loading.

Output tokens: `llamacpp-plain` keeps the token ids it sampled. The tools print text only,
so their tokens are llama.cpp's tokenization of the bytes they printed (special tokens included; an
end-of-generation token that `llama-speculative-simple` does not print is appended), cut after
the first end token (`llama-lookup` goes on past it while its draft matches) and at the run's
max_new_tokens (`llama-lookup` may run past it by one accepted draft; the tokens past it count
in its rates, which they cost). Where those tokens differ from plain decoding's, the harness
compares the printed bytes with the text of plain decoding's tokens (`same_text`), so a
re-tokenization artifact is not counted as a mismatch.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import numpy as np

from specsample.bench.baselines import Output
from specsample.models import LoadedModel
from specsample.models.llamacpp import (PREFILL_ROWS, VARIANT_PREFIX, VARIANT_VARIABLE, repack_is_batch_invariant,
                                        requested_variant, variant_library)
from specsample.sampling import SamplingParams
from specsample.stats import Stats
from specsample.text import Message, encode_prompt

TOOLS_ENV = "SPECSAMPLE_LLAMACPP_TOOLS"
INVARIANT_TOOLS_ENV = "SPECSAMPLE_LLAMACPP_INVARIANT_TOOLS"
BUILD_COMMAND = "bash scripts/build_llamacpp_tools.sh"
INVARIANT_BUILD_COMMAND = "PATCHED=1 bash scripts/build_llamacpp_tools.sh"
LOOKUP_TOOL = "llama-lookup"
SPECULATIVE_TOOL = "llama-speculative-simple"
KINDS = ("llamacpp-plain", "llamacpp-lookup", "llamacpp-lookup-invariant", "llamacpp-speculative")
TOOL_TIMEOUT = 1800  # seconds per answer
CRASH_CODES = (132, 134, 139, -4, -6, -11)  # SIGILL, SIGABRT, SIGSEGV as an exit status or a signal


class Unavailable(ValueError):
    """A baseline that cannot run here (a tool not built, no GGUF file, no draft GGUF): the run
    reports it as not available and goes on."""


def tools_dir(invariant: bool = False) -> Path:
    """Where scripts/build_llamacpp_tools.sh puts the tools (`$SPECSAMPLE_LLAMACPP_TOOLS`, else
    ~/.cache/specsample/llamacpp-tools), or its batch-invariant build (`PATCHED=1`:
    `$SPECSAMPLE_LLAMACPP_INVARIANT_TOOLS`, else ~/.cache/specsample/llamacpp-tools-batch-invariant)."""
    env = os.environ.get(INVARIANT_TOOLS_ENV if invariant else TOOLS_ENV)
    default = "llamacpp-tools-batch-invariant" if invariant else "llamacpp-tools"
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specsample" / default


def tool_path(name: str, invariant: bool = False) -> Path:
    """The executable of a llama.cpp tool, or Unavailable naming the build command; under
    SPECSAMPLE_LLAMACPP_VARIANT, a copy that loads that CPU variant (`variant_bin`), as the
    backend and `llamacpp-plain` in this process do."""
    path = tools_dir(invariant) / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        command = INVARIANT_BUILD_COMMAND if invariant else BUILD_COMMAND
        raise Unavailable(f"{name} is not built (no {path}): run {command}")
    variant = requested_variant()
    return variant_bin(path.parent, variant) / name if variant else path


def variant_label() -> str:
    """What a baseline's label adds under SPECSAMPLE_LLAMACPP_VARIANT: the CPU variant it ran."""
    variant = requested_variant()
    return f", CPU variant {variant}" if variant else ""


@functools.cache
def variant_bin(bin_dir: Path, variant: str) -> Path:
    """A directory, for this process, that holds copies of the tools of `bin_dir` and links to its
    libraries but of its CPU variants only `variant`. ggml loads the best CPU variant it finds in the
    directory of the running executable, which it reads from /proc/self/exe: a symbolic link to a
    tool would name `bin_dir` itself, so the tools (tens of kB each) are copied, and their libraries,
    found through their rpath ($ORIGIN), linked."""
    chosen = variant_library(variant)
    if not (bin_dir / chosen).is_file():
        raise Unavailable(f"{VARIANT_VARIABLE}={variant!r}: the llama.cpp tools have no such CPU variant")
    out = Path(tempfile.mkdtemp(prefix=f"specsample-tools-{variant}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    for entry in bin_dir.iterdir():
        if entry.name.startswith(VARIANT_PREFIX) and entry.name != chosen:
            continue
        if entry.name.startswith("lib"):
            (out / entry.name).symlink_to(entry)
        else:
            shutil.copy2(entry, out / entry.name)
    return out


def prompt_text(tokenizer, messages: Sequence[Message]) -> str:
    """The text whose tokens `encode_prompt` gives: the chat template applied, or the messages joined."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def check_greedy_or_sampling(params: SamplingParams) -> None:
    if params.min_p:
        raise Unavailable("the llama.cpp baselines take temperature, top-k and top-p, not min-p")


# ---------------------------------------------------------------------------------------------
# llama.cpp's plain decoding, in this process


_extra_bufts_ok: dict[str, bool] = {}

PROBE = """
import sys
import numpy as np
import llama_cpp
from specsample.models.llamacpp import init_backend
init_backend()
params = llama_cpp.llama_model_default_params()
params.n_gpu_layers = 0
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
ctx_params = llama_cpp.llama_context_default_params()
ctx_params.n_threads = ctx_params.n_threads_batch = int(sys.argv[2])
ctx = llama_cpp.llama_init_from_model(model, ctx_params)
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
ids = (llama_cpp.llama_token * 16)(*[int(i) % n_vocab for i in range(1000, 1016)])
sys.exit(llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, 16)))
"""


def extra_buffer_types_work(path: Path, threads: int) -> bool:
    """Whether llama.cpp's default extra weight buffer types (repacked, AMX) survive a batched pass
    of 16 tokens on this CPU: tried once per file in a child process, since on the project's AMX
    machine they die with an illegal instruction (docs/llamacpp-backend.md)."""
    key = str(Path(path).resolve())
    if key not in _extra_bufts_ok:
        probe = subprocess.run([sys.executable, "-c", PROBE, key, str(threads)], capture_output=True, timeout=600)
        _extra_bufts_ok[key] = probe.returncode == 0
    return _extra_bufts_ok[key]


def sampler_chain(lib, params: SamplingParams, seed: int):
    """llama.cpp's sampler for `params` (the binding `lib`): greedy, or the temperature, top-k and top-p in
    the engine's order (`sampling.probs_from_logits`: top-p cuts the tempered distribution), then a draw."""
    if params.greedy:
        return lib.llama_sampler_init_greedy()
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
    if params.top_k:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
    return chain


class LlamaCppPlainRunner:
    """Plain decoding by llama.cpp itself: one `llama_decode` per token and llama.cpp's sampler."""

    def __init__(self, model: LoadedModel, path: Path, threads: int, n_ctx: int, params: SamplingParams,
                 max_new_tokens: int, seed: int = 0) -> None:
        from specsample.models.llamacpp import _bindings, init_backend, last_error

        check_greedy_or_sampling(params)
        init_backend()
        self.lib = lib = _bindings()
        self.model, self.max_new_tokens = model, max_new_tokens
        self.extra_bufts = extra_buffer_types_work(path, threads)
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = self.extra_bufts
        self.llama = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.llama:
            raise ValueError(f"llama.cpp cannot load {path}: {last_error() or 'unknown error'}")
        ctx_params = lib.llama_context_default_params()  # flash attention, batch sizes: llama.cpp's defaults
        ctx_params.n_ctx = n_ctx
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.llama, ctx_params)
        if not self.ctx:
            raise ValueError(f"llama.cpp cannot make a context for {path}: {last_error() or 'unknown error'}")
        self.n_batch = int(lib.llama_n_batch(self.ctx))
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.llama)
        self.sampler = sampler_chain(lib, params, seed)
        self.label = ("llama.cpp plain, " + ("extra buffer types (repacked/AMX weights) on" if self.extra_bufts
                      else "extra buffer types off (they crash a batched pass here)") + variant_label())

    def _decode(self, ids: np.ndarray) -> None:
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            array = (self.lib.llama_token * len(chunk))(*chunk.tolist())
            status = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(array, len(chunk)))
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")

    def run(self, messages: Sequence[Message]) -> Output:
        lib = self.lib
        start = perf_counter()
        prompt = np.array(encode_prompt(self.model.tokenizer, messages), dtype=np.int32)
        lib.llama_memory_clear(self.memory, True)
        lib.llama_sampler_reset(self.sampler)
        t_prefill = perf_counter()
        self._decode(prompt[:-1])
        t_decode = perf_counter()
        tokens, last = [], int(prompt[-1])
        one = (lib.llama_token * 1)()
        while len(tokens) < self.max_new_tokens:
            one[0] = last
            status = lib.llama_decode(self.ctx, lib.llama_batch_get_one(one, 1))
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")
            last = int(lib.llama_sampler_sample(self.sampler, self.ctx, -1))
            tokens.append(last)
            if lib.llama_vocab_is_eog(self.vocab, last):
                break
        t_end = perf_counter()
        text = self.model.tokenizer.decode(tokens, skip_special_tokens=True)
        stats = Stats(drafter=self.label, prompt_tokens=len(prompt), prefill_seconds=t_decode - t_prefill,
                      decode_seconds=t_end - t_decode, verify_seconds=t_end - t_decode, steps=len(tokens),
                      generated_tokens=len(tokens))
        return Output(tokens, text, len(prompt), perf_counter() - start, stats)

    def close(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "sampler", None):
            lib.llama_sampler_free(self.sampler)
            self.sampler = None
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "llama", None):
            lib.llama_model_free(self.llama)
            self.llama = None

    def __del__(self) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# llama.cpp's tools, one process per answer


@dataclass
class ToolRun:
    """What a llama.cpp tool reported about one answer."""

    prompt_tokens: int  # "encoded N tokens"
    encode_seconds: float
    generated: int  # "decoded N tokens": n_predict, every sampled token
    decode_seconds: float
    drafted: int
    accepted: int
    text: bytes  # the generated text as printed (special tokens as text; raw bytes, maybe not UTF-8)


ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")
STDOUT_END = b"\n\n\n\n"  # the tools' last two LOG("\n\n"): one after the text, one at exit


class IncompleteOutput(RuntimeError):
    """The tool exited before its log thread wrote everything (llama.cpp leaks its logger, so queued
    lines can be lost at exit: ggml-org/llama.cpp#22142)."""


def parse_tool_output(stdout: bytes, stderr: str, prompt: bytes) -> ToolRun:
    """The figures of `llama-lookup`/`llama-speculative-simple` (their log, on stderr) and the text
    they generated: stdout is "\\n\\n", the prompt's tokens printed back, the generated tokens,
    then "\\n\\n" twice."""
    encoded, decoded = ENCODED.search(stderr), DECODED.search(stderr)
    drafted, accepted = DRAFTED.search(stderr), ACCEPTED.search(stderr)
    if not (encoded and decoded and drafted and accepted) or not stdout.endswith(STDOUT_END):
        tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-3:])
        raise IncompleteOutput(f"no timings or no end in the llama.cpp tool's output: {tail or 'nothing on stderr'}")
    start = stdout.find(prompt)
    if start < 0:
        raise RuntimeError("the llama.cpp tool printed its prompt back differently: the prompt's tokens differ")
    text = stdout[start + len(prompt) : -len(STDOUT_END)]
    return ToolRun(int(encoded.group(1)), float(encoded.group(2)), int(decoded.group(1)), float(decoded.group(2)),
                   int(drafted.group(1)), int(accepted.group(1)), text)


class LlamaCppTokenizer:
    """llama.cpp's tokenizer of a GGUF file (its vocabulary only): the tokens of raw bytes, as the
    tools would read them back."""

    def __init__(self, path: Path) -> None:
        from specsample.models.llamacpp import _bindings, init_backend

        init_backend()
        self.lib = lib = _bindings()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp cannot read the vocabulary of {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)

    def piece(self, token: int) -> bytes:
        """The bytes llama.cpp prints for a token (special tokens as their text), as the tools do."""
        buffer = ctypes.create_string_buffer(64)
        n = self.lib.llama_token_to_piece(self.vocab, token, buffer, 64, 0, True)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buffer, -n, 0, True)
        return buffer.raw[:n]

    def __call__(self, text: bytes) -> list[int]:
        capacity = len(text) + 16
        ids = (self.lib.llama_token * capacity)()
        n = self.lib.llama_tokenize(self.vocab, text, len(text), ids, capacity, False, True)  # specials parsed
        if n < 0:  # more tokens than the guess (the tests' tiny vocabulary): -n is the count needed
            capacity = -n
            ids = (self.lib.llama_token * capacity)()
            n = self.lib.llama_tokenize(self.vocab, text, len(text), ids, capacity, False, True)
        return list(ids[:n])

    def __del__(self) -> None:
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None


def tool_stats(run: ToolRun, answered: int, first_from_prompt: bool, label: str) -> Stats:
    """A tool's decoding as it timed it: every token it decoded, past an end token included (and the drafts
    it accepted there), so that its decoding rate and mean accepted length are its own; `answered` counts
    the answer's tokens (one more than the tool printed where it stopped at an end token it does not print).
    llama-lookup samples its first token from the prompt pass, before its decoding timer
    (`first_from_prompt`)."""
    decoded = max(run.generated, answered) - first_from_prompt
    return Stats(drafter=label, prompt_tokens=run.prompt_tokens, prefill_seconds=run.encode_seconds,
                 decode_seconds=run.decode_seconds, verify_seconds=run.decode_seconds,
                 steps=max(decoded - run.accepted, 0), drafted_tokens=run.drafted, accepted_tokens=run.accepted,
                 generated_tokens=decoded)


class LlamaCppToolRunner:
    """`llama-lookup` or `llama-speculative-simple` on one chat prompt, in a process of its own.

    At temperature 0 the tools sample greedily (`--temp 0`). llama.cpp's extra weight buffer
    types are tried first; if the tool crashes with them (the AMX layouts on the project's
    machine), it runs with `--no-repack` from then on, and the statistics say which. A run whose
    log lost its last lines at exit is run again (at most `ATTEMPTS` times).

    `invariant`: the batch-invariant build (`tools_dir(invariant=True)`) with the llamacpp backend's
    settings: flash attention, ubatches of PREFILL_ROWS tokens, and repacked weights only
    where the backend repacks them (`repack_is_batch_invariant`)."""

    ATTEMPTS = 4

    def __init__(self, model: LoadedModel, tool: str, path: Path, threads: int, n_ctx: int,
                 params: SamplingParams, max_new_tokens: int, k: int, seed: int = 0,
                 draft: Path | None = None, invariant: bool = False) -> None:
        check_greedy_or_sampling(params)
        self.executable = tool_path(tool, invariant)
        self.invariant = invariant
        self.tool, self.model, self.max_new_tokens = tool, model, max_new_tokens
        if tool == SPECULATIVE_TOOL and draft is None:
            raise Unavailable(f"{tool} needs a draft GGUF file")
        sampling = ["--temp", "0"] if params.greedy else [
            "--temp", f"{params.temperature}", "--top-k", str(params.top_k), "--top-p", f"{params.top_p}",
            "--min-p", "0", "--samplers", "temperature;top_k;top_p"]  # the engine's order
        # -n N - 1: both tools stop once they have more than -n tokens (and -n 0 is no limit: 1 at least)
        self.args = [str(self.executable), "-m", str(path), "-c", str(n_ctx), "-n", str(max(max_new_tokens - 1, 1)),
                     "-t", str(threads), "-tb", str(threads), "--seed", str(seed), "--no-escape",
                     "--spec-draft-n-max", str(k), *sampling]
        if draft is not None:
            self.args += ["--spec-type", "draft-simple", "-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        self.no_repack = False
        if invariant:
            # the prompt as one batch (the tool decodes it in one call) in ubatches of the backend's blocks
            self.args += ["-fa", "on", "-b", str(n_ctx), "-ub", str(PREFILL_ROWS)]
            self.no_repack = not repack_is_batch_invariant(path)
        self.tokenize = LlamaCppTokenizer(path)
        self.eos = model.tokenizer.eos_token_id
        self.end_pieces = [self.tokenize.piece(token) for token in sorted(model.eos_token_ids)]

    @property
    def label(self) -> str:
        if self.invariant:
            return (f"{self.tool}, batch-invariant build, -fa on, -ub {PREFILL_ROWS}"
                    + (", --no-repack" if self.no_repack else ", repacked weights") + variant_label())
        return f"{self.tool}, " + ("--no-repack (repacked weights crashed here)" if self.no_repack
                                   else "extra buffer types (repacked/AMX weights) on") + variant_label()

    def call(self, prompt: bytes) -> subprocess.CompletedProcess:
        with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
            f.write(prompt)
            f.flush()
            args = [*self.args, "-bf", f.name, *(["--no-repack"] if self.no_repack else [])]
            return subprocess.run(args, capture_output=True, timeout=TOOL_TIMEOUT)

    def complete_run(self, prompt: bytes) -> ToolRun:
        """The tool's run on `prompt`, again without repacking if it crashed, again if its log lost lines."""
        for attempt in range(self.ATTEMPTS):
            done = self.call(prompt)
            if done.returncode in CRASH_CODES and not self.no_repack:
                self.no_repack = True
                done = self.call(prompt)
            stderr = done.stderr.decode("utf-8", "replace")
            if done.returncode != 0:
                tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-3:])
                raise RuntimeError(f"{self.tool} failed with exit status {done.returncode}: {tail}")
            try:
                return parse_tool_output(done.stdout, stderr, prompt)
            except IncompleteOutput:
                if attempt == self.ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def run(self, messages: Sequence[Message]) -> Output:
        tokenizer = self.model.tokenizer
        prompt = prompt_text(tokenizer, messages).encode()
        tool_run = self.complete_run(prompt)
        tokens = self.tokenize(tool_run.text)  # exact for UTF-8 text; bytes of a split character become U+FFFD
        ends = [i for i, token in enumerate(tokens) if token in self.model.eos_token_ids]
        generated = tool_run.generated  # every token the tool sampled and timed
        if ends:  # llama-lookup prints its end token, and goes on where the draft went on past it
            tokens = tokens[: ends[0] + 1]
            generated = len(tokens)
        elif tool_run.generated < self.max_new_tokens and self.eos is not None:
            tokens.append(self.eos)  # it stopped early, at an end token that speculative-simple does not print
            generated = len(tokens)
        tokens = tokens[: self.max_new_tokens]
        stats = tool_stats(tool_run, generated, self.tool == LOOKUP_TOOL, self.label)
        raw = self.cut_at_end(tool_run.text)
        if len(tokens) == self.max_new_tokens and generated > self.max_new_tokens:  # llama-lookup went on past it
            raw = raw[: len(b"".join(self.tokenize.piece(t) for t in tokens))]
        # the text as a tokenizer decodes bytes (a split character as one U+FFFD), for the next turn's prompt
        return Output(tokens, raw.decode("utf-8", "replace"), tool_run.prompt_tokens,
                      tool_run.encode_seconds + tool_run.decode_seconds, stats, generated_tokens=generated, raw=raw)

    def cut_at_end(self, text: bytes) -> bytes:
        """The printed bytes before the first end token's text."""
        cuts = [i for piece in self.end_pieces if piece and (i := text.find(piece)) >= 0]
        return text[: min(cuts)] if cuts else text

    def same_text(self, reference: list[int], raw: bytes, max_new_tokens: int) -> bool:
        """Whether the printed bytes are the text of the reference's tokens (end tokens left out):
        equal where the reference ended at an end token, starting with it where it reached
        max_new_tokens (the tool may have gone on). Exact where re-tokenizing the text is not (bytes
        of a split character, a text the tokenizer would split otherwise)."""
        expected = b"".join(self.tokenize.piece(t) for t in reference if t not in self.model.eos_token_ids)
        return raw.startswith(expected) if len(reference) >= max_new_tokens else raw == expected
