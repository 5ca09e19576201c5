"""Self-distillation of a draft head on the CPU: generate, extract features, train, evaluate.

0. Optionally the target writes prompts of its own (Magpie): sampled from where
   a user's message begins in its chat template. They add the variety of
   requests that more answers to the same prompts do not.
1. The target answers the training prompts with batched greedy `generate`
   (much faster per token than one sequence at a time).
2. One teacher-forced forward pass over each prompt + answer gives the target's
   final normed hidden states (the features), and with `feature_layers` the
   outputs of those decoder layers too (EAGLE-3 fuses low, middle and high
   layers: the final state is shaped for the next token only, earlier layers
   say more about the context); they are stored in float16 shards, so an
   interrupted run resumes where it stopped.
3. The head learns to predict the next feature from (feature, next token), as
   EAGLE does: a regression loss on the feature plus a distillation loss between
   the target's and the head's distributions over the head's token subset. With
   `unroll` > 1 it also trains on its own predicted features, each pass attending
   to exactly what drafting step d attends to (the target's features up to the
   anchor, its own predictions after it: HASS, EAGLE-3's training-time test).
4. A held-out split of the sequences estimates the greedy mean accepted length at
   K = 4 during training; at the end the head drafts for the real engine on
   held-out prompts and the measured figures are reported.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specsample.drafters.head import DraftHead, HeadConfig, HeadDrafter, save_head
from specsample.models import LoadedModel, make_target
from specsample.models.target import normalized, recordable
from specsample.text import encode_prompt, user_turn_opening

EVAL_K = 4


@dataclass(frozen=True)
class TrainOptions:
    generate_batch: int = 16  # prompts per generate call
    sampled_answers: int = 0  # answers per prompt sampled at temperature 1, after the greedy one
    self_prompts: int = 0  # prompts the target writes itself, added to the given ones
    self_prompt_tokens: int = 48  # longest self-written prompt; longer ones are dropped
    batch_size: int = 16  # windows per training step
    max_new_tokens: int = 160
    max_prompt_tokens: int = 384  # longer prompts keep their last tokens
    data_minutes: float = 0.0  # stop generating after this long and train on what there is (0: no limit)
    vocab_subset: int = 8192  # 0: the full LM head
    layers: int = 1
    feature_layers: tuple[int, ...] = ()  # decoder layers (1-based) whose outputs the head reads as well
    steps: int = 2000
    seq_len: int = 256  # positions per training window
    lr: float = 1e-3
    feature_weight: float = 1.0
    distill_weight: float = 1.0
    unroll: int = 2
    holdout: float = 0.05
    eval_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("generate_batch", "batch_size", "max_new_tokens", "max_prompt_tokens", "layers", "steps",
                     "seq_len", "unroll", "eval_every", "self_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.self_prompts < 0:
            raise ValueError(f"self_prompts must be >= 0, got {self.self_prompts}")
        if self.sampled_answers < 0:
            raise ValueError(f"sampled_answers must be >= 0, got {self.sampled_answers}")
        if self.data_minutes < 0:
            raise ValueError(f"data_minutes must be >= 0 (0: no limit), got {self.data_minutes}")
        if self.vocab_subset < 0:
            raise ValueError(f"vocab_subset must be >= 0 (0: the full LM head), got {self.vocab_subset}")
        if len(set(self.feature_layers)) != len(self.feature_layers) or any(i < 1 for i in self.feature_layers):
            raise ValueError(f"feature_layers must be distinct layer numbers >= 1, got {list(self.feature_layers)}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")


def read_prompts(paths: list[Path], question_ids: str = "all") -> list[str]:
    """Prompts from .jsonl files (field `prompt`, or the first of `turns`) or text files (one a line).

    `question_ids` "even" or "odd" keeps the jsonl rows whose question_id has that
    parity: Spec-Bench's dev set is split in halves this way (train on one, evaluate on the other).
    """
    if question_ids not in ("all", "even", "odd"):
        raise ValueError(f"question_ids must be all, even or odd, got {question_ids!r}")
    prompts = []
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"prompts file not found: {path}")
        if path.suffix != ".jsonl":
            prompts += [line.strip() for line in path.read_text().splitlines() if line.strip()]
            continue
        for row in map(json.loads, filter(str.strip, path.read_text().splitlines())):
            if question_ids != "all" and "question_id" in row and row["question_id"] % 2 != (question_ids == "odd"):
                continue
            prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
    if not prompts:
        raise ValueError("no training prompts found")
    return prompts


@torch.inference_mode()
def write_prompts(model: LoadedModel, path: Path, options: TrainOptions) -> list[str]:
    """`options.self_prompts` distinct prompts written by the target, sampled at temperature 1 after
    its chat template's opening of a user turn; only those it ends (EOS) within `self_prompt_tokens`.
    Kept in `path` (one JSON line each) as they come, so a resumed run writes only the rest."""
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()] if path.is_file() else []
    opening = torch.tensor([user_turn_opening(model.tokenizer)] * options.generate_batch)
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    bar = tqdm(desc="writing prompts", unit="prompt", initial=len(prompts), total=options.self_prompts)
    tries = 0
    while len(prompts) < options.self_prompts:
        tries += 1
        if tries > 4 * options.self_prompts / options.generate_batch + 4:
            raise ValueError(f"the model ended only {len(prompts)} of {options.self_prompts} prompts within "
                             f"{options.self_prompt_tokens} tokens: give it prompts with --prompts instead")
        out = model.model.generate(
            input_ids=opening, attention_mask=torch.ones_like(opening), max_new_tokens=options.self_prompt_tokens,
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=sorted(model.eos_token_ids) or None,
        )
        new = []
        for row in out[:, opening.shape[1] :].tolist():
            end = next((i for i, t in enumerate(row) if t in model.eos_token_ids), None)
            text = model.tokenizer.decode(row[:end], skip_special_tokens=True).strip() if end is not None else ""
            if text and text not in prompts and text not in new:
                new.append(text)
        new = new[: options.self_prompts - len(prompts)]
        with path.open("a") as f:
            f.writelines(json.dumps({"prompt": text}) + "\n" for text in new)
        prompts += new
        bar.update(len(new))
    bar.close()
    return prompts


def generate_shards(model: LoadedModel, prompts: list[str], data_dir: Path, options: TrainOptions) -> list[Path]:
    """Answer the prompts in batches and store tokens + features, one shard per batch (resumable).

    Every batch is answered greedily first; then, `sampled_answers` times over, by
    sampling at temperature 1 (from torch's global generator, seeded once by `train`),
    so the head also sees the continuations it will draft for at temperature > 0.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = model.tokenizer
    encoded = sorted((encode_prompt(tokenizer, p, True)[-options.max_prompt_tokens :] for p in prompts), key=len)
    batches = [encoded[i : i + options.generate_batch] for i in range(0, len(encoded), options.generate_batch)]
    random.Random(options.seed).shuffle(batches)  # similar lengths in a batch, all lengths among the first shards
    jobs = [(batch, round_, data_dir / (f"shard-{i:05d}" + (f"-s{round_}" if round_ else "") + ".safetensors"))
            for round_ in range(options.sampled_answers + 1) for i, batch in enumerate(batches)]
    todo = [job for job in jobs if not job[2].exists()]
    start = perf_counter()
    for batch, round_, shard in tqdm(todo, desc="generating answers", unit="batch", initial=len(jobs) - len(todo), total=len(jobs)):
        if options.data_minutes and perf_counter() - start > 60 * options.data_minutes:
            break  # out of time: train on the shards made so far (a later run resumes generating)
        answers = generate_batch(model, batch, options.max_new_tokens, sampled=round_ > 0)
        sequences = [prompt + answer for prompt, answer in zip(batch, answers)]
        prompt_lengths = torch.tensor([len(p) for p in batch])
        write_shard(model, shard, sequences, prompt_lengths, options.feature_layers)
    return [shard for _, _, shard in jobs if shard.exists()]


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
        copy = data_dir / f"{shard.parent.parent.name}-{shard.name}"
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


@torch.inference_mode()
def generate_batch(model: LoadedModel, prompts: list[list[int]], max_new_tokens: int, sampled: bool = False) -> list[list[int]]:
    """Answers to a batch of prompts (left-padded), greedy or sampled at temperature 1, each cut after its first EOS."""
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampled else {"do_sample": False}
    out = model.model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        pad_token_id=pad, eos_token_id=sorted(model.eos_token_ids) or None, **sampling,
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


def load_sequences(shards: list[Path], layers: tuple[int, ...] = ()) -> list[Sequence]:
    """The sequences of these shards, with the outputs of `layers` (which every shard must hold)."""
    out = []
    for shard in shards:
        data = load_file(shard)
        lengths = data["lengths"].tolist()
        features = data["features"]
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
    sampled ones) falls on the same side, or the held-out figures would reward memorising answers."""
    by_prompt: dict[tuple[int, ...], list[Sequence]] = {}
    for s in sequences:
        by_prompt.setdefault(tuple(s.tokens[: s.prompt_length].tolist()), []).append(s)
    groups = list(by_prompt.values())
    random.Random(seed).shuffle(groups)
    n_eval = max(1, round(holdout * len(groups))) if len(groups) > 1 else 0
    return [s for g in groups[n_eval:] for s in g], [s for g in groups[:n_eval] for s in g]


def distinct_prompts(sequences: list[Sequence]) -> list[Tensor]:
    """The prompts of these sequences, each once, in order of first appearance."""
    seen: dict[tuple[int, ...], Tensor] = {}
    for s in sequences:
        seen.setdefault(tuple(s.tokens[: s.prompt_length].tolist()), s.tokens[: s.prompt_length])
    return list(seen.values())


class Batcher:
    """Random windows of `seq_len` + 1 positions from the training sequences, padded, with a mask."""

    def __init__(self, sequences: list[Sequence], seq_len: int, batch_size: int, generator: torch.Generator) -> None:
        self.sequences = [s for s in sequences if len(s.tokens) >= 2]
        self.seq_len, self.batch_size, self.generator = seq_len, batch_size, generator
        weights = torch.tensor([float(len(s.tokens)) for s in self.sequences])
        self.weights = weights / weights.sum()

    def __call__(self) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [b, t + 1], features [b, t + 1, hidden] float32, mask [b, t] of real positions."""
        picks = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=self.generator)
        windows = [self.window(self.sequences[int(i)]) for i in picks]
        width = max(len(t) for t, _ in windows)
        tokens = torch.zeros(self.batch_size, width, dtype=torch.long)
        features = torch.zeros(self.batch_size, width, windows[0][1].shape[-1])
        mask = torch.zeros(self.batch_size, width - 1, dtype=torch.bool)
        for b, (t, f) in enumerate(windows):
            tokens[b, : len(t)], features[b, : len(t)], mask[b, : len(t) - 1] = t, f.float(), True
        return tokens, features, mask

    def window(self, s: Sequence) -> tuple[Tensor, Tensor]:
        """A window inside the answer where it can be: position prompt_length - 2 predicts the first
        answer token's feature, and only answers are drafted (the fixed chat template is not)."""
        span = min(self.seq_len + 1, len(s.tokens))
        first = min(max(0, s.prompt_length - 2), len(s.tokens) - span)
        start = first + int(torch.randint(len(s.tokens) - span - first + 1, (1,), generator=self.generator))
        return s.tokens[start : start + span], s.features[start : start + span]


class Objective:
    """Losses and the greedy acceptance estimate of a head against stored target features."""

    def __init__(self, head: DraftHead, embed: Tensor, lm_head_rows: Tensor) -> None:
        self.head = head
        self.embed = embed  # [vocab, hidden], the target's input embeddings (frozen)
        self.lm_head_rows = lm_head_rows  # [n, hidden], the target's LM head restricted to the subset

    def passes(self, tokens: Tensor, features: Tensor, depth: int) -> list[Tensor]:
        """Predicted features [b, t, hidden] of `depth` passes (`DraftHead.forward`): pass d at
        position i is draft step d from anchor i - d + 1, predicting feature i + 1."""
        return self.head(features[:, :-1], self.embed[tokens[:, 1:]], depth)

    def loss(self, tokens: Tensor, features: Tensor, mask: Tensor, options: TrainOptions) -> tuple[Tensor, dict]:
        truth = features[:, 1:, -self.head.config.hidden_size :]  # [b, t, hidden], the final states
        target_logp = (truth @ self.lm_head_rows.t()).log_softmax(-1)  # [b, t, n]
        total, parts = torch.zeros(()), {}
        for j, predicted in enumerate(self.passes(tokens, features, options.unroll)):
            regression = F.smooth_l1_loss(predicted[mask], truth[mask])
            logp = (predicted @ self.lm_head_rows.t()).log_softmax(-1)
            distill = -(target_logp.exp() * logp).sum(-1)[mask].mean()
            total = total + (options.feature_weight * regression + options.distill_weight * distill) / (j + 1)
            parts[f"regression{j + 1}"], parts[f"distill{j + 1}"] = float(regression.detach()), float(distill.detach())
        return total, parts

    @torch.no_grad()
    def accepted_length(self, sequences: list[Sequence], k: int = EVAL_K) -> float:
        """Estimated greedy mean accepted length at K = k (bonus token included) on `sequences`.

        Anchors are the answer's positions. Drafting step j from a context ending at position m is right when the
        predictions of passes 1..j at positions m..m + j - 1 all match the
        target's argmax token.
        """
        counted, total = 0, 0.0
        for s in sequences:
            if len(s.tokens) < k + 2:
                continue
            features, tokens = s.features.float()[None], s.tokens[None]
            target_tokens = (features[0, 1:, -self.head.config.hidden_size :] @ self.lm_head_rows.t()).argmax(-1)  # [t]
            right = torch.stack([
                (p[0] @ self.lm_head_rows.t()).argmax(-1) == target_tokens for p in self.passes(tokens, features, k)
            ])  # [k, t]
            anchors = right.shape[1] - k + 1
            chain = torch.ones(anchors, dtype=torch.bool)
            length = torch.ones(anchors)
            for j in range(k):
                chain &= right[j, j : j + anchors]
                length += chain.float()
            answer = length[max(0, s.prompt_length - 2) :]  # drafting happens in the answer only
            counted, total = counted + answer.numel(), total + float(answer.sum())
        return total / max(counted, 1)


def train(
    model: LoadedModel,
    prompts: list[str],
    out_dir: Path,
    options: TrainOptions,
    log: Callable[[str], None] = print,
    extra_shards: list[Path] = (),
) -> dict:
    """Generate data, train the head, save it to `out_dir`; returns the final report.
    `extra_shards`: data of earlier runs to train on as well."""
    recordable(options.feature_layers, model.model.config.num_hidden_layers)  # refuses layers before any work
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(options.seed)
    start = perf_counter()
    if options.self_prompts:
        prompts = prompts + write_prompts(model, out_dir / "self_prompts.jsonl", options)
    shards = generate_shards(model, prompts, out_dir / "data", options)
    if options.feature_layers:
        extra_shards = with_layer_features(model, list(extra_shards), options.feature_layers, out_dir / "data")
    sequences = load_sequences(shards + list(extra_shards), options.feature_layers)
    data_seconds = perf_counter() - start
    train_set, eval_set = split(sequences, options.holdout, options.seed)
    hf = model.model
    embed = hf.get_input_embeddings().weight.detach()
    lm_head = hf.get_output_embeddings().weight.detach()
    token_ids = frequent_tokens(train_set, options.vocab_subset, lm_head.shape[0])
    config = HeadConfig.for_target(model, layers=options.layers, vocab_subset=len(token_ids),
                                   feature_layers=options.feature_layers)
    head = DraftHead(config)
    head.init_from_target(hf)
    objective = Objective(head, embed, lm_head[token_ids])
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(options.seed)
    step, history = resume(out_dir / "checkpoint.pt", head, optimizer, generator)
    batcher = Batcher(train_set, options.seq_len, options.batch_size, generator)
    train_start = perf_counter()
    bar = tqdm(range(step, options.steps), desc="training head", unit="step", initial=step, total=options.steps)
    for step in bar:
        set_lr(optimizer, options, step)
        tokens, features, mask = batcher()
        loss, parts = objective.loss(tokens, features, mask, options)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        if (step + 1) % options.eval_every == 0 or step + 1 == options.steps:
            history.append(evaluate(objective, eval_set, step + 1, options))
            log(json.dumps(history[-1]))
            save_checkpoint(out_dir / "checkpoint.pt", head, optimizer, generator, step + 1, history)
            save_head(out_dir, head, token_ids)
    train_seconds = perf_counter() - train_start
    save_head(out_dir, head, token_ids)
    report = {
        "target": model.name, "sequences": len(sequences), "train_sequences": len(train_set),
        "heldout_sequences": len(eval_set), "data_tokens": sum(len(s.tokens) for s in sequences),
        "data_seconds": round(data_seconds, 1), "train_seconds": round(train_seconds, 1), "history": history,
        "engine": engine_acceptance(model, out_dir, eval_set),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def evaluate(objective: Objective, eval_set: list[Sequence], step: int, options: TrainOptions) -> dict:
    return {
        "step": step,
        "train_tokens": step * options.batch_size * options.seq_len,
        "heldout_accepted_length_estimate": round(objective.accepted_length(eval_set), 3),
    }


def set_lr(optimizer: torch.optim.Optimizer, options: TrainOptions, step: int) -> None:
    """Linear warmup over 5% of the steps, then cosine decay to 10%."""
    warmup = max(1, options.steps // 20)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, options.steps - warmup)))
    scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    for group in optimizer.param_groups:
        group["lr"] = options.lr * scale


def save_checkpoint(path: Path, head: DraftHead, optimizer, generator: torch.Generator, step: int, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                "step": step, "history": history}, tmp)
    tmp.rename(path)


def resume(path: Path, head: DraftHead, optimizer, generator: torch.Generator) -> tuple[int, list]:
    """Restore a checkpoint written by this module; (0, []) when there is none."""
    if not path.is_file():
        return 0, []
    state = torch.load(path, weights_only=True)
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    return state["step"], state["history"]


def engine_acceptance(model: LoadedModel, head_dir: Path, eval_set: list[Sequence], prompts: int = 8) -> dict:
    """Greedy speculative decoding with the trained head on held-out prompts, K = 4: measured figures."""
    from specsample.engine import decode
    from specsample.policy import FixedK
    from specsample.sampling import SamplingParams, make_generator
    from specsample.stats import Stats

    target = make_target(model)
    drafter = HeadDrafter.load(model, target, head_dir)
    stats = Stats()
    held_out = distinct_prompts(eval_set)[:prompts]
    for prompt in held_out:
        steps = decode(
            target, drafter, FixedK(EVAL_K), prompt, SamplingParams(temperature=0),
            max_new_tokens=64, eos_token_ids=model.eos_token_ids, generator=make_generator(0), stats=stats,
        )
        for _ in steps:
            pass
    return {"prompts": len(held_out), "k": EVAL_K, "temperature": 0,
            "mean_accepted_length": round(stats.mean_accepted_length, 3), "acceptance_rate": round(stats.acceptance_rate, 3)}
