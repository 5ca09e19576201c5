"""The training run: data, the head, the optimisation loop with checkpoints, the held-out figures."""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable
from functools import partial
from pathlib import Path
from time import perf_counter

import torch
from torch import Tensor
from tqdm import tqdm

from specsample.drafters.head import DraftHead, HeadConfig, HeadDrafter, save_head
from specsample.models import LoadedModel, backend_of, make_target
from specsample.models.target import recordable
from specsample.text import user_turn_opening
from specsample.training.dataset import Batcher, Sequence, distinct_prompts, frequent_tokens, load_sequences, split
from specsample.training.generate import (Writer, check_extra_data, generate_shards, model_fingerprint,
                                         with_layer_features, write_prompts)
from specsample.training.objective import EVAL_K, Objective
from specsample.training.options import TrainOptions


def train(
    model: LoadedModel,
    prompts: list[str],
    out_dir: Path,
    options: TrainOptions,
    log: Callable[[str], None] = print,
    extra_shards: list[Path] = (),
    writer: Writer | None = None,
) -> dict:
    """Generate data, train the head, save it to `out_dir`; returns the final report.
    `extra_shards`: data of earlier runs to train on as well. `writer`: what writes the prompts
    and answers (`generate.Writer`; None: `model`'s own target, as `make_target` makes it); the
    features always come from `model`'s transformers forward."""
    recordable(options.feature_layers, model.model.config.num_hidden_layers)  # refuses layers before any work
    if options.self_prompts:
        user_turn_opening(model.tokenizer)  # refuses a model without a chat template before any work
    target = model_fingerprint(model)
    check_extra_data(list(extra_shards), target)  # refuses another target's data before any work
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(options.seed)
    start = perf_counter()
    writer = Writer(model, partial(make_target, model), options.generate_batch, backend_of(model, "auto")) if writer is None else writer
    if options.self_prompts:
        prompts = prompts + write_prompts(model, writer, out_dir / "self_prompts.jsonl", options)
    shards = generate_shards(model, writer, prompts, out_dir / "data", options, target)
    if options.feature_layers:
        extra_shards = with_layer_features(model, list(extra_shards), options.feature_layers, out_dir / "data")
    unique = list({shard.resolve(): shard for shard in [*shards, *extra_shards]}.values())  # --extra-data OUT: once
    hf = model.model
    embed = hf.get_input_embeddings().weight.detach()
    lm_head = hf.get_output_embeddings().weight.detach()
    sequences = load_sequences(unique, options.feature_layers, embed.shape[1], lm_head.shape[0])
    data_seconds = perf_counter() - start
    train_set, eval_set = split(sequences, options.holdout, options.seed)
    if not eval_set:
        log(f"no prompt held out ({len(distinct_prompts(sequences))} distinct in the data): the held-out figures "
            f"are not measured")
    token_ids = frequent_tokens(train_set, options.vocab_subset, lm_head.shape[0])
    config = HeadConfig.for_target(model, layers=options.layers, vocab_subset=len(token_ids),
                                   feature_layers=options.feature_layers)
    head = DraftHead(config)
    head.init_from_target(hf)
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(options.seed)
    step, history, trained_ids = resume(out_dir / "checkpoint.pt", head, optimizer, generator)
    token_ids = token_ids if trained_ids is None else trained_ids  # the subset the weights were trained for
    if step >= options.steps:
        log(f"{out_dir / 'checkpoint.pt'} has trained all {options.steps} steps: nothing to train (data written "
            f"by this run is not trained on; give more --steps to train on it)")
    objective = Objective(head, embed, lm_head, token_ids)
    batcher = Batcher(train_set, options.seq_len, options.batch_size, generator)
    trained_tokens = history[-1]["train_tokens"] if history else 0  # positions the loss counted, to the checkpoint
    train_start = perf_counter()
    bar = tqdm(range(step, options.steps), desc="training head", unit="step", initial=step, total=options.steps)
    for step in bar:
        set_lr(optimizer, options, step)
        tokens, features, mask = batcher()
        trained_tokens += int(mask.sum())
        loss, parts = objective.loss(tokens, features, mask, options)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        if (step + 1) % options.eval_every == 0 or step + 1 == options.steps:
            history.append(evaluate(objective, eval_set, step + 1, trained_tokens))
            log(json.dumps(history[-1]))
            save_checkpoint(out_dir / "checkpoint.pt", head, optimizer, generator, step + 1, history, token_ids)
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


def evaluate(objective: Objective, eval_set: list[Sequence], step: int, trained_tokens: int) -> dict:
    """The held-out estimate at `step`, after training on `trained_tokens` positions (those the loss counted:
    answers' positions, not the prompt's or a short window's padding): None where nothing is held out (data of
    one prompt)."""
    estimate = round(objective.accepted_length(eval_set), 3) if eval_set else None
    return {"step": step, "train_tokens": trained_tokens, "heldout_accepted_length_estimate": estimate}


def set_lr(optimizer: torch.optim.Optimizer, options: TrainOptions, step: int) -> None:
    """Linear warmup over 5% of the steps, then cosine decay to 10%."""
    warmup = max(1, options.steps // 20)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, options.steps - warmup)))
    scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    for group in optimizer.param_groups:
        group["lr"] = options.lr * scale


def save_checkpoint(path: Path, head: DraftHead, optimizer, generator: torch.Generator, step: int, history: list,
                    token_ids: Tensor) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                "step": step, "history": history, "token_ids": token_ids}, tmp)
    tmp.rename(path)


def resume(path: Path, head: DraftHead, optimizer, generator: torch.Generator) -> tuple[int, list, Tensor | None]:
    """Restore a checkpoint written by this module: its step, history and the token subset its head was trained
    for (which more data, resumed, would count otherwise: the weights' rows would draft other tokens); (0, [],
    None) when there is none."""
    if not path.is_file():
        return 0, [], None
    try:
        state = torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:  # a file cut short (a kill, a full disk)
        raise ValueError(f"cannot read the checkpoint {path} ({error}): delete it to train from the start, "
                         f"or use another --out") from None
    try:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError):
        raise ValueError(f"{path} holds a head of another shape than these options make (--layers, --vocab-subset, "
                         f"--feature-layers or --model changed?): resume with its options, or use another --out") from None
    generator.set_state(state["generator"])
    return state["step"], state["history"], state.get("token_ids")


def engine_acceptance(model: LoadedModel, head_dir: Path, eval_set: list[Sequence], prompts: int = 8) -> dict:
    """Greedy speculative decoding with the trained head on held-out prompts, K = 4: measured figures."""
    from specsample.engine import decode
    from specsample.policy import FixedK
    from specsample.sampling import GeneratorSource, SamplingParams, make_generator
    from specsample.stats import Stats

    held_out = distinct_prompts(eval_set)[:prompts]
    if not held_out:  # nothing measured, not zeros
        return {"prompts": 0, "k": EVAL_K, "temperature": 0, "mean_accepted_length": None, "acceptance_rate": None}
    target = make_target(model)
    drafter = HeadDrafter.load(model, target, head_dir)
    stats = Stats()
    for prompt in held_out:
        steps = decode(
            target, drafter, FixedK(EVAL_K), prompt, SamplingParams(temperature=0),
            max_new_tokens=64, eos_token_ids=model.eos_token_ids, random=GeneratorSource(make_generator(0)), stats=stats,
        )
        for _ in steps:
            pass
    return {"prompts": len(held_out), "k": EVAL_K, "temperature": 0,
            "mean_accepted_length": round(stats.mean_accepted_length, 3), "acceptance_rate": round(stats.acceptance_rate, 3)}
