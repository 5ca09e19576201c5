"""The training data: prompts the target writes itself, its answers, and their features in shards.

The target writes on its batched slots where its backend has them (continuous batching on the C++
kernels or llama.cpp: several times transformers' `generate` on a CPU), else greedy text with `generate`
and sampled text by plain decoding, a prompt at a time. Sampled text has a seed per prompt drawn from
the run's seed and the shard's name, so a run and its resumption write the same data. Shards are
written whole or not at all and named by batch and round, so an interrupted run resumes with the
shards it lacks.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from time import perf_counter

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specsample.batch import Batch, Request, drain
from specsample.drafters.none import NoDrafter
from specsample.engine import decode
from specsample.models import LoadedModel, Target, backend_of
from specsample.models.target import SlottedTarget, normalized
from specsample.policy import FixedK
from specsample.sampling import SamplingParams, request_source
from specsample.stats import Stats
from specsample.text import encode_prompt, user_turn_opening
from specsample.training.options import TrainOptions


@torch.inference_mode()
def write_prompts(model: LoadedModel, writer: Writer, path: Path, options: TrainOptions) -> list[str]:
    """`options.self_prompts` distinct prompts written by the target, sampled at temperature 1 after
    its chat template's opening of a user turn; only those it ends (EOS) within `self_prompt_tokens`.
    Kept in `path` (one JSON line each) as they come, so a resumed run writes only the rest, and the rest
    it would have written uninterrupted: each batch's seeds follow from the prompts kept and the batches
    since the last one that added any (a batch that adds none, replayed, adds none again)."""
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()] if path.is_file() else []
    opening = user_turn_opening(model.tokenizer)
    bar = tqdm(desc="writing prompts", unit="prompt", initial=len(prompts), total=options.self_prompts)
    tries = attempt = 0  # attempt: batches since the last new prompt, so that seeds follow from the file alone
    while len(prompts) < options.self_prompts:
        tries, attempt = tries + 1, attempt + 1
        if tries > 4 * options.self_prompts / options.generate_batch + 4:
            raise ValueError(f"the model ended only {len(prompts)} of {options.self_prompts} prompts within "
                             f"{options.self_prompt_tokens} tokens: give it prompts with --prompts instead")
        seeds = seeds_for(f"prompts-{len(prompts)}-{attempt}", options)
        rows = writer([opening] * options.generate_batch, options.self_prompt_tokens, seeds)
        new = []
        for row in rows:
            end = next((i for i, t in enumerate(row) if t in model.eos_token_ids), None)
            text = model.tokenizer.decode(row[:end], skip_special_tokens=True).strip() if end is not None else ""
            if text and text not in prompts and text not in new:
                new.append(text)
        new = new[: options.self_prompts - len(prompts)]
        with path.open("a") as f:
            f.writelines(json.dumps({"prompt": text}) + "\n" for text in new)
        prompts += new
        attempt = 0 if new else attempt
        bar.update(len(new))
    bar.close()
    return prompts


MANIFEST = "manifest.json"


def generate_shards(model: LoadedModel, writer: Writer, prompts: list[str], data_dir: Path,
                    options: TrainOptions, target: str) -> list[Path]:
    """Answer the prompts in batches with `writer` and store tokens + features, one shard per batch (resumable).
    `target`: `model`'s `model_fingerprint`, recorded in the directory's manifest (`check_manifest`).

    Every batch is answered greedily first; then, `sampled_answers` times over, by
    sampling at temperature 1, so the head also sees the continuations it will draft for at temperature > 0.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = model.tokenizer
    encoded = sorted((encode_prompt(tokenizer, p, True)[-options.max_prompt_tokens :] for p in prompts), key=len)
    check_manifest(data_dir / MANIFEST, encoded, options, target, writer.backend, backend_of(model, "auto"))
    batches = [encoded[i : i + options.generate_batch] for i in range(0, len(encoded), options.generate_batch)]
    random.Random(options.seed).shuffle(batches)  # similar lengths in a batch, all lengths among the first shards
    jobs = [(batch, round_, data_dir / (f"shard-{i:05d}" + (f"-s{round_}" if round_ else "") + ".safetensors"))
            for round_ in range(options.sampled_answers + 1) for i, batch in enumerate(batches)]
    todo = [job for job in jobs if not job[2].exists()]
    start = perf_counter()
    for batch, round_, shard in tqdm(todo, desc="generating answers", unit="batch", initial=len(jobs) - len(todo), total=len(jobs)):
        if options.data_minutes and perf_counter() - start > 60 * options.data_minutes:
            break  # out of time: train on the shards made so far (a later run resumes generating)
        seeds = seeds_for(shard.name, options) if round_ else None
        answers = writer(batch, options.max_new_tokens, seeds)
        sequences = [prompt + answer for prompt, answer in zip(batch, answers)]
        prompt_lengths = torch.tensor([len(p) for p in batch])
        write_shard(model, shard, sequences, prompt_lengths, options.feature_layers)
    return [shard for _, _, shard in jobs if shard.exists()]


def check_manifest(path: Path, encoded: list[list[int]], options: TrainOptions, target: str, writer: str,
                   auto: str) -> None:
    """Record what a data directory's shards are made from (the target's `model_fingerprint`, the backend that
    wrote the answers, the prompts and the options that shape the answers), or refuse to resume one made from
    something else: its shards, named by batch, would be taken as they are (another model's features, or the
    new prompts never answered). `auto`: the backend a recorded writer "auto" stood for (`models.backend_of`:
    a version that recorded --backend as given)."""
    digest = hashlib.sha256(json.dumps(encoded).encode()).hexdigest()
    manifest = {"target": target, "writer": writer, "prompts": len(encoded), "prompts_sha256": digest,
                "max_new_tokens": options.max_new_tokens, "generate_batch": options.generate_batch,
                "sampled_answers": options.sampled_answers, "seed": options.seed,
                "max_prompt_tokens": options.max_prompt_tokens}
    if path.is_file() and any(path.parent.glob("shard-*.safetensors")):  # no shard: nothing made from it yet
        earlier = read_manifest(path)
        if earlier.get("writer") == "auto":  # as a version that recorded --backend as given wrote it
            earlier["writer"] = auto
        # a key an earlier version did not record is taken as agreeing, and recorded from now on
        changed = [key for key in manifest if key in earlier and earlier[key] != manifest[key]]
        if changed:
            raise ValueError(f"{path.parent} holds answers made from other data ({', '.join(changed)} differ): "
                             f"resume with the same prompts and options, or give another --out")
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(path: Path) -> dict:
    """A data directory's manifest; one that is not a JSON object is named, with what to do."""
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict):
        raise ValueError(f"cannot read the data manifest {path}: delete its directory's data (or give another "
                         "--out) to write it again")
    return manifest


def model_fingerprint(model: LoadedModel) -> str:
    """A short hash of every weight of the target (names, shapes and a sample of each in float16): what the
    features of its data shards depend on (`check_manifest`, `check_extra_data`)."""
    digest = hashlib.sha256()
    for name, weight in model.model.state_dict().items():
        digest.update(f"{name}{tuple(weight.shape)}".encode())
        digest.update(weight.detach().flatten()[::4099].to(torch.float16).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_extra_data(shards: list[Path], target: str) -> None:
    """ValueError for data shards of another target: their manifest (`check_manifest`) names another
    `model_fingerprint` (shards of the same shapes would be trained on silently)."""
    for directory in dict.fromkeys(shard.parent for shard in shards):
        path = directory / MANIFEST
        earlier = read_manifest(path).get("target") if path.is_file() else None
        if earlier is not None and earlier != target:
            raise ValueError(f"{directory} holds data of another target (its answers and features are that model's): "
                             f"train on data this target wrote")


def write_shard(model: LoadedModel, shard: Path, sequences: list[list[int]], prompt_lengths: Tensor,
                layers: tuple[int, ...]) -> None:
    """Store the sequences' tokens and teacher-forced features in `shard` (written whole or not at all)."""
    tokens, features, layer_features = teacher_forced_features(model, sequences, layers)
    data = {"tokens": tokens, "features": features, "lengths": torch.tensor([len(s) for s in sequences]),
            "prompt_lengths": prompt_lengths}
    if layers:
        data |= {"layer_features": layer_features, "layers": torch.tensor(layers)}
    tmp = shard.with_suffix(".tmp")
    save_file(data, tmp)
    tmp.rename(shard)


def with_layer_features(model: LoadedModel, shards: list[Path], layers: tuple[int, ...], data_dir: Path) -> list[Path]:
    """The shards of an earlier run, each replaced by a copy in `data_dir` with the outputs of `layers`
    added (one teacher-forced pass, resumable) where it lacks them."""
    out = []
    for shard in tqdm(shards, desc="adding layer features", unit="shard"):
        if set(layers) <= set(stored_layers(shard)):
            out.append(shard)
            continue
        origin = hashlib.blake2b(str(shard.resolve()).encode(), digest_size=6).hexdigest()
        copy = data_dir / f"{origin}-{shard.name}"  # by the source's full path: two runs' shards share names
        if not copy.exists():
            data = load_file(shard)
            sequences = [t.tolist() for t in data["tokens"].split(data["lengths"].tolist())]
            write_shard(model, copy, sequences, data["prompt_lengths"], layers)
        out.append(copy)
    return out


def stored_layers(shard: Path) -> list[int]:
    """The decoder layers whose outputs a shard holds."""
    with safe_open(shard, "pt") as f:
        return f.get_tensor("layers").tolist() if "layers" in f.keys() else []


def seeds_for(name: str, options: TrainOptions) -> list[int]:
    """`generate_batch` seeds for the sampled text named `name`, the same in every run with `options.seed`."""
    draw = random.Random(f"{options.seed}-{name}")
    return [draw.getrandbits(64) for _ in range(options.generate_batch)]


class Writer:
    """Writes the target's continuations of prompts (`__call__`). The target is made at the first call, so
    a run that writes nothing (its data given with --extra-data, or all made by the run it resumes) never
    holds a second copy of the weights; on a target with slots, one batch of `width` slots serves the run."""

    def __init__(self, model: LoadedModel, make: Callable[[], Target], width: int, backend: str) -> None:
        # backend: the one `make` makes its target on, as `models.backend_of` names it
        self.model, self.make, self.width, self.backend = model, make, width, backend
        self.target: Target | None = None
        self.batch: Batch | None = None

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None) -> list[list[int]]:
        """The continuations of `prompts` (greedy without `seeds`, else sampled at temperature 1 with seed i
        for prompt i), each cut after its first EOS: on the target's slots where it has them. Always in
        inference mode: the slots' caches, made at the first call, are written at every later one."""
        if self.target is None:
            self.target = self.make()
        if not isinstance(self.target, SlottedTarget):
            if seeds is None:
                return generate_batch(self.model, prompts, max_new_tokens)
            return [self.sampled(prompt, max_new_tokens, seed) for prompt, seed in zip(prompts, seeds)]
        if self.batch is None:
            self.batch = Batch(self.target.slots(self.width), NoDrafter(), lambda: FixedK(0),
                               eos_token_ids=self.model.eos_token_ids)
        return slotted_write(self.batch, prompts, max_new_tokens, seeds)

    def sampled(self, prompt: list[int], max_new_tokens: int, seed: int) -> list[int]:
        """Plain decoding of `prompt` at temperature 1 with `seed`, one prompt at a time on a target without
        slots: `SpecSampler.generate`'s text with that seed, as on slots (transformers' `generate` draws from
        the global generator, so a resumed run would write other text)."""
        steps = decode(self.target, NoDrafter(), FixedK(0), torch.tensor(prompt), SamplingParams(temperature=1.0),
                       max_new_tokens=max_new_tokens, eos_token_ids=self.model.eos_token_ids,
                       random=request_source(seed), stats=Stats())
        return [token for new in steps for token in new]


def slotted_write(batch: Batch, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None) -> list[list[int]]:
    """`Writer`'s text by continuous batching on `batch`'s slots: plain decoding, a seeded request's text
    that of `SpecSampler.generate` with its seed."""
    params = SamplingParams(temperature=0.0 if seeds is None else 1.0)
    requests = [Request(torch.tensor(prompt), params, max_new_tokens, request_source(None if seeds is None else seeds[i]))
                for i, prompt in enumerate(prompts)]
    text: dict[Request, list[int]] = {request: [] for request in requests}

    def feed(request: Request, new: list[int]) -> bool:
        text[request] += new
        return False  # ends by EOS or max_new_tokens only

    drain(batch, requests, feed)
    return [text[request] for request in requests]


@torch.inference_mode()
def generate_batch(model: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers to a batch of prompts (left-padded) by transformers' `generate`, each cut after its first EOS."""
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        pad_token_id=pad, eos_token_id=sorted(model.eos_token_ids) or None, do_sample=False,
    )
    answers = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in model.eos_token_ids), len(row))
        answers.append(row[:end])
    return answers


@torch.inference_mode()
def teacher_forced_features(
    model: LoadedModel, sequences: list[list[int]], layers: tuple[int, ...] = ()
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Concatenated tokens [total], final normed hidden states [total, hidden] and the RMS-normalised
    outputs of decoder `layers` [total, len(layers) * hidden] (None without layers), all float16.

    Right padding, so no position of a sequence sees a pad token.
    """
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    out = model.model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers))

    def packed(states: Tensor) -> Tensor:  # [b, width, h] -> [total, h] float16
        return torch.cat([states[i, : len(s)] for i, s in enumerate(sequences)]).half()

    tapped = [normalized(out.hidden_states[i]) for i in layers]  # hidden_states[i]: the output of layer i
    layer_features = packed(torch.cat(tapped, -1)) if layers else None
    return torch.tensor([t for s in sequences for t in s]), packed(out.last_hidden_state), layer_features
