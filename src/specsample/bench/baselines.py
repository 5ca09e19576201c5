"""Baselines from transformers: plain `generate` and its assisted generation.

Assisted generation is transformers' own speculative decoding: prompt lookup
(`prompt_lookup_num_tokens`, n-gram matches in the prompt) or a draft model
(`assistant_model`). Each call is timed end to end, prefill included, as
Spec-Bench times its methods. transformers samples from the global torch
generator, so sampled (temperature > 0) baselines are not seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

import torch

from specsample.models import LoadedModel
from specsample.sampling import SamplingParams
from specsample.stats import Stats
from specsample.text import Message, encode_prompt


@dataclass
class Output:
    """One generated answer of a benchmark run."""

    token_ids: list[int]  # generated ids only
    text: str
    prompt_tokens: int
    wall_seconds: float  # the whole call: prefill, decoding, text
    stats: Stats | None  # engine statistics (and the llama.cpp baselines'); None for transformers baselines
    generated_tokens: int | None = None  # tokens generated and timed, where more than token_ids (llama-lookup)
    raw: bytes | None = None  # the bytes a text-only baseline printed (llama.cpp's tools), end tokens cut

    @property
    def timed_tokens(self) -> int:
        return len(self.token_ids) if self.generated_tokens is None else self.generated_tokens


class TransformersRunner:
    """`model.generate` on one chat prompt, with extra generate options (assisted generation)."""

    def __init__(self, model: LoadedModel, params: SamplingParams, max_new_tokens: int, **options) -> None:
        self.model = model
        self.options = dict(options, max_new_tokens=max_new_tokens, **sampling_options(params))
        self.options["eos_token_id"] = sorted(model.eos_token_ids) or None
        pad = model.tokenizer.pad_token_id
        self.options["pad_token_id"] = pad if pad is not None else min(model.eos_token_ids, default=0)

    def run(self, messages: Sequence[Message]) -> Output:
        start = perf_counter()  # the prompt's encoding timed too, as in the engine's and llama.cpp's runs
        prompt_ids = torch.tensor([encode_prompt(self.model.tokenizer, messages)])  # [1, n]
        with torch.inference_mode():
            out = self.model.model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **self.options)
        token_ids = out[0, prompt_ids.shape[1] :].tolist()
        text = self.model.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Output(token_ids, text, prompt_ids.shape[1], perf_counter() - start, None)


def sampling_options(params: SamplingParams) -> dict:
    """transformers generate options for our sampling transform (top_k 0 turns its default 50 off)."""
    if params.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_p": params.min_p or None}


def generate_runner(model: LoadedModel, params: SamplingParams, max_new_tokens: int) -> TransformersRunner:
    """Plain transformers decoding."""
    return TransformersRunner(model, params, max_new_tokens)


def prompt_lookup_runner(model: LoadedModel, params: SamplingParams, max_new_tokens: int, k: int) -> TransformersRunner:
    """transformers prompt lookup decoding with k candidate tokens."""
    return TransformersRunner(model, params, max_new_tokens, prompt_lookup_num_tokens=k)


def assisted_runner(
    model: LoadedModel, params: SamplingParams, max_new_tokens: int, k: int, draft: LoadedModel
) -> TransformersRunner:
    """transformers assisted generation with a draft model proposing a constant k tokens."""
    draft.model.generation_config.num_assistant_tokens = k
    draft.model.generation_config.num_assistant_tokens_schedule = "constant"
    return TransformersRunner(model, params, max_new_tokens, assistant_model=draft.model)
