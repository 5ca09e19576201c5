"""The stored data read back: sequences with their features, the train/held-out split, training windows."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor


@dataclass
class Sequence:
    tokens: Tensor  # [n]
    features: Tensor  # [n, (len(feature_layers) + 1) * hidden] float16: the layers' outputs, then the final state
    prompt_length: int


def data_shards(run_dir: Path) -> list[Path]:
    """The data shards an earlier `train` run left in `run_dir`."""
    shards = sorted((run_dir / "data").glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no data shards in {run_dir / 'data'}")
    return shards


def load_sequences(shards: list[Path], layers: tuple[int, ...] = (), hidden: int | None = None,
                   vocab: int | None = None) -> list[Sequence]:
    """The sequences of these shards, with the outputs of `layers` (which every shard must hold); a ValueError
    for a shard whose features are not `hidden` wide or whose tokens are not below `vocab` (another model's)."""
    out = []
    for shard in shards:
        try:
            data = load_file(shard)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"cannot read the data shard {shard} ({error}): delete it (a resumed run makes it "
                             f"again) or leave its directory out") from None
        lengths = data["lengths"].tolist()
        features = data["features"]
        if hidden is not None and features.shape[-1] != hidden or vocab is not None and int(data["tokens"].max()) >= vocab:
            raise ValueError(f"{shard} holds data of another model (features {features.shape[-1]} wide, token ids up to "
                             f"{int(data['tokens'].max())}; this target's are {hidden} wide, below {vocab})")
        if layers:
            stored, hidden = data["layers"].tolist() if "layers" in data else [], features.shape[-1]
            if missing := sorted(set(layers) - set(stored)):
                raise ValueError(f"{shard} holds no outputs of layers {missing}: train on its run directory "
                                 f"with --extra-data, which adds them, into a new --out directory")
            columns = [data["layer_features"][:, stored.index(i) * hidden : (stored.index(i) + 1) * hidden] for i in layers]
            features = torch.cat(columns + [features], -1)
        out += [Sequence(t, f, int(p)) for t, f, p in zip(data["tokens"].split(lengths), features.split(lengths), data["prompt_lengths"])]
    return out


def frequent_tokens(sequences: list[Sequence], n: int, vocab_size: int) -> Tensor:
    """The n token ids the target produces most often (answers only), ties by id; all ids when n is 0."""
    if n <= 0 or n >= vocab_size:
        return torch.arange(vocab_size)
    counts = Counter()
    for s in sequences:
        counts.update(s.tokens[s.prompt_length :].tolist())
    ranked = sorted(range(vocab_size), key=lambda t: (-counts[t], t))
    return torch.tensor(sorted(ranked[:n]))


def split(sequences: list[Sequence], holdout: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """Train and held-out sequences, split by prompt: every answer to a prompt (the greedy one and the
    sampled ones) falls on the same side, or the held-out figures would reward memorising answers.
    A prompt is held out when its own hash (with `seed`) falls below `holdout`, so its side does not
    depend on the other prompts: a run resumed on grown data never holds out a prompt it trained on
    (so none is held out where none falls below, not even from data of few prompts). ValueError where
    every prompt falls below: nothing would be left to train on."""
    by_prompt: dict[tuple[int, ...], list[Sequence]] = {}
    for s in sequences:
        by_prompt.setdefault(tuple(s.tokens[: s.prompt_length].tolist()), []).append(s)
    place = {prompt: prompt_hash(prompt, seed) for prompt in by_prompt}
    held = {prompt for prompt, at in place.items() if at < holdout}
    if held and len(held) == len(by_prompt):
        raise ValueError(f"every prompt of the data ({len(held)}) falls in the held-out share (holdout {holdout}): "
                         f"give more prompts, or --holdout 0 to hold out none")
    return ([s for prompt, g in by_prompt.items() if prompt not in held for s in g],
            [s for prompt, g in by_prompt.items() if prompt in held for s in g])


def prompt_hash(prompt: tuple[int, ...], seed: int) -> float:
    """A prompt's place in [0, 1), uniform over prompts, fixed by its tokens and `seed`."""
    digest = hashlib.blake2b(repr((seed, prompt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def distinct_prompts(sequences: list[Sequence]) -> list[Tensor]:
    """The prompts of these sequences, each once, in order of first appearance."""
    seen: dict[tuple[int, ...], Tensor] = {}
    for s in sequences:
        seen.setdefault(tuple(s.tokens[: s.prompt_length].tolist()), s.tokens[: s.prompt_length])
    return list(seen.values())


def drafted_from(s: Sequence) -> int:
    """The first position whose prediction is drafted: position prompt_length - 2 predicts the first answer
    token's feature (the last prompt token's), and only answers are drafted (the chat template is not)."""
    return max(0, s.prompt_length - 2)


class Batcher:
    """Random windows of `seq_len` + 1 positions from the training sequences, padded, with a mask of the
    positions the loss counts: those of the answer, whose context reaches back into the prompt as it
    does when the head drafts (it reads the prompt's last positions first, drafters/head.py)."""

    def __init__(self, sequences: list[Sequence], seq_len: int, batch_size: int, generator: torch.Generator) -> None:
        self.sequences = [s for s in sequences if len(s.tokens) - 1 > drafted_from(s)]
        self.seq_len, self.batch_size, self.generator = seq_len, batch_size, generator
        weights = torch.tensor([float(len(s.tokens) - 1 - drafted_from(s)) for s in self.sequences])
        self.weights = weights / weights.sum()

    def __call__(self) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [b, t + 1], features [b, t + 1, hidden] float32, mask [b, t] of the answer's positions."""
        picks = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=self.generator)
        windows = [self.window(self.sequences[int(i)]) for i in picks]
        width = max(len(t) for t, _, _ in windows)
        tokens = torch.zeros(self.batch_size, width, dtype=torch.long)
        features = torch.zeros(self.batch_size, width, windows[0][1].shape[-1])
        mask = torch.zeros(self.batch_size, width - 1, dtype=torch.bool)
        for b, (t, f, counted) in enumerate(windows):
            tokens[b, : len(t)], features[b, : len(t)], mask[b, counted : len(t) - 1] = t, f.float(), True
        return tokens, features, mask

    def window(self, s: Sequence) -> tuple[Tensor, Tensor, int]:
        """A window holding some of the answer's positions (`drafted_from`), from any start that keeps one,
        so that the positions near its end see up to `seq_len` earlier ones, the prompt's among them;
        and the window's first position the loss counts."""
        span = min(self.seq_len + 1, len(s.tokens))
        first = drafted_from(s)
        lowest, highest = max(0, first + 2 - span), len(s.tokens) - span
        start = lowest + int(torch.randint(highest - lowest + 1, (1,), generator=self.generator))
        return s.tokens[start : start + span], s.features[start : start + span], max(0, first - start)
