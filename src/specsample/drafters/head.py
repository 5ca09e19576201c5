"""The `head` drafter: a small decoder block trained on the target's own hidden states (EAGLE).

The head reads (feature of position i, embedding of token i + 1), where a
feature is the target's final normed hidden state, the input of its LM head,
and predicts the feature of position i + 1. Drafting K tokens runs it K - 1
times on its own predictions; each draft token comes from the target's LM head
restricted to the N tokens the target produces most often (FR-Spec), so a
draft step costs one small block plus an [hidden, N] matmul. Tokens outside
the subset get draft probability 0, which rejection sampling handles exactly.

After verification the head recomputes the accepted positions from the
target's true features, so its cache never keeps its own guesses.

A head is a directory: `head.safetensors` (float16 weights and the subset's
token ids) and `head.json` (the config, naming the target it was trained for;
loading it for another target is refused).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specsample.drafters.base import Draft
from specsample.models import LoadedModel, Target
from specsample.sampling import SamplingParams, probs_from_logits, sample

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "data" / "heads"
CONFIG_FILE, WEIGHTS_FILE = "head.json", "head.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    target: str  # name of the target model it was trained for
    fingerprint: str  # hash of the target's LM head: the check that it is that target
    hidden_size: int
    vocab_size: int  # the target's logits width
    vocab_subset: int  # N, the number of tokens the head can propose
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @classmethod
    def for_target(cls, model: LoadedModel, layers: int = 1, vocab_subset: int = 0) -> HeadConfig:
        """A head shaped like one of the target's decoder layers."""
        config = model.model.config
        heads = config.num_attention_heads
        vocab_size = model.model.get_output_embeddings().weight.shape[0]
        return cls(
            target=model.name, fingerprint=target_fingerprint(model.model), hidden_size=config.hidden_size,
            vocab_size=vocab_size, vocab_subset=vocab_subset or vocab_size, layers=layers, heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size, eps=getattr(config, "rms_norm_eps", 1e-5),
        )


def target_fingerprint(model: nn.Module) -> str:
    """A short hash of the target's LM head (shape and every 64th row in float16)."""
    weight = model.get_output_embeddings().weight.detach()
    digest = hashlib.sha256(str(tuple(weight.shape)).encode())
    digest.update(weight[::64].to(torch.float16).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [b, t, heads, dim], rotate-half layout; cos, sin [t, 1, dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class HeadCache:
    """Keys and values of every head layer, preallocated; `length` positions are valid."""

    def __init__(self, config: HeadConfig, max_length: int) -> None:
        shape = (config.layers, 1, config.kv_heads, max_length, config.head_dim)
        self.k, self.v = torch.empty(shape), torch.empty(shape)  # [layers, 1, kv_heads, max_length, dim]
        self.length = 0

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [1, kv_heads, t, dim] after the valid positions; return all keys and values so far."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end], self.v[layer, :, :, self.length : end] = k, v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Block(nn.Module):
    """A Llama decoder layer: RMSNorm, rotary grouped-query attention, SwiGLU MLP."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv = nn.Linear(c.hidden_size, (c.heads + 2 * c.kv_heads) * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: HeadCache | None, layer: int) -> Tensor:
        x = x + self.attention(rms_norm(x, self.attn_norm, self.c.eps), cos, sin, cache, layer)
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, self.c.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, cache: HeadCache | None, layer: int) -> Tensor:
        """Causal attention of x [b, t, hidden]; with a cache (b = 1), over the cached positions too."""
        c, (b, t, _) = self.c, x.shape
        q, k, v = self.qkv(x).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = rotate(q.view(b, t, c.heads, c.head_dim), cos, sin).transpose(1, 2)  # [b, heads, t, dim]
        k = rotate(k.view(b, t, c.kv_heads, c.head_dim), cos, sin).transpose(1, 2)  # [b, kv_heads, t, dim]
        v = v.view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            start = cache.length
            k, v = cache.write(layer, k, v)
            mask = None if t == 1 else torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))


class DraftHead(nn.Module):
    """(features [b, t, hidden], token embeddings [b, t, hidden]) -> next features [b, t, hidden]."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cos = self.sin = torch.empty(0, 1, config.head_dim)

    def forward(self, features: Tensor, embeds: Tensor, cache: HeadCache | None = None) -> Tensor:
        start, t = (cache.length if cache is not None else 0), features.shape[1]
        cos, sin = self.rotary(start + t)
        cos, sin = cos[start:], sin[start:]  # [t, 1, dim]
        x = self.fc(torch.cat([features, embeds], -1))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, i)
        if cache is not None:
            cache.length = start + t
        return rms_norm(x, self.norm, self.config.eps)

    def rotary(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin [length, 1, dim] of positions 0..length - 1, from a table grown by doubling."""
        if self.cos.shape[0] < length:
            positions = torch.arange(max(2 * self.cos.shape[0], length, 256), dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq  # [n, dim / 2]
            angles = torch.cat((freqs, freqs), -1)[:, None]  # [n, 1, dim]
            self.cos, self.sin = angles.cos(), angles.sin()
        return self.cos[:length], self.sin[:length]

    @torch.no_grad()
    def init_from_target(self, model: nn.Module) -> None:
        """Start every block from the target's last decoder layer and the output norm from its final norm."""
        layer = model.model.layers[-1]
        attn, mlp = layer.self_attn, layer.mlp
        for block in self.blocks:
            block.attn_norm.copy_(layer.input_layernorm.weight)
            block.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            block.o.weight.copy_(attn.o_proj.weight)
            block.mlp_norm.copy_(layer.post_attention_layernorm.weight)
            block.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            block.down.weight.copy_(mlp.down_proj.weight)
        self.norm.copy_(model.model.norm.weight)


def save_head(directory: Path, head: DraftHead, token_ids: Tensor) -> None:
    """Write head.safetensors (float16 weights, int64 token ids) and head.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: w.detach().to(torch.float16).contiguous() for name, w in head.state_dict().items()}
    tensors["token_ids"] = token_ids.to(torch.int64).contiguous()
    save_file(tensors, directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(head.config), indent=1) + "\n")


def load_head(directory: Path, model: LoadedModel) -> tuple[DraftHead, Tensor]:
    """The head (float32) and its token ids [n]; refuses a head trained for another target."""
    directory = Path(directory).expanduser()
    if not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"not a draft head directory (no {CONFIG_FILE}): {directory}")
    config = HeadConfig(**json.loads((directory / CONFIG_FILE).read_text()))
    if config.fingerprint != target_fingerprint(model.model):
        raise ValueError(
            f"the draft head in {directory} was trained for target {config.target!r}, not {model.name!r}: "
            f"train one for this target with `specsample train-draft`"
        )
    tensors = load_file(directory / WEIGHTS_FILE)
    token_ids = tensors.pop("token_ids")
    head = DraftHead(config)
    head.load_state_dict({name: w.float() for name, w in tensors.items()})
    return head.eval(), token_ids


def shipped_head_dir(model: LoadedModel) -> Path:
    """The head shipped in the package for this target, found by its fingerprint."""
    fingerprint = target_fingerprint(model.model)
    for config in sorted(SHIPPED_HEADS.glob(f"*/{CONFIG_FILE}")):
        if json.loads(config.read_text())["fingerprint"] == fingerprint:
            return config.parent
    raise ValueError(
        f"no draft head is shipped for target {model.name!r}: train one with "
        f"`specsample train-draft --model ... --out DIR` and use --drafter head:DIR"
    )


class HeadDrafter:
    """Drafts K tokens by running the head on its own predicted features."""

    def __init__(self, target: Target, head: DraftHead, embed: Tensor, lm_head: Tensor, token_ids: Tensor) -> None:
        self.target = target
        self.head = head
        self.embed = embed  # [vocab, hidden], the target's input embeddings
        self.lm_head_t = lm_head[token_ids].t().contiguous()  # [hidden, n]: few-row matmuls are fast this way
        self.token_ids = token_ids  # [n]
        self.vocab_size = target.vocab_size
        self.cache = HeadCache(head.config, target.max_length)
        self.params = SamplingParams()
        self.feature: Tensor | None = None  # [1, 1, hidden] predicted feature of the pending token
        self.draft: list[int] = []

    @classmethod
    def load(cls, model: LoadedModel, target: Target, directory: Path | str) -> HeadDrafter:
        head, token_ids = load_head(Path(directory), model)
        embed = model.model.get_input_embeddings().weight.detach()
        return cls(target, head, embed, model.model.get_output_embeddings().weight.detach(), token_ids)

    @torch.inference_mode()
    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        """Run the head over the prompt, reading the features the target's prefill left."""
        self.params, self.draft, self.cache.length, self.feature = params, [], 0, None
        features = self.target.hidden_states()  # [n - 1, hidden] of prompt_ids[:-1]
        if features is not None and features.shape[0] == prompt_ids.shape[0] - 1 > 0:
            self.advance(features, prompt_ids[1:])

    @torch.inference_mode()
    def propose(self, k: int, generator: torch.Generator) -> Draft:
        if self.feature is None:
            return Draft.empty()
        feature, tokens, probs = self.feature, [], []
        for i in range(k):
            logits = (feature[0, 0] @ self.lm_head_t).float()  # [n]
            if self.params.greedy:
                token = int(self.token_ids[logits.argmax()])
            else:
                subset_probs = probs_from_logits(logits, self.params)  # [n]
                token = int(self.token_ids[sample(subset_probs, generator)])
                probs.append(torch.zeros(self.vocab_size).index_copy_(0, self.token_ids, subset_probs))
            tokens.append(token)
            if i + 1 < k:
                feature = self.head(feature, self.embed[token].view(1, 1, -1), self.cache)
        self.cache.length -= k - 1  # drop the positions computed from predicted features
        self.draft = tokens
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    @torch.inference_mode()
    def observe(self, accepted: int, next_token: int) -> None:
        """Recompute the accepted positions from the target's true features."""
        features = self.target.hidden_states()[: accepted + 1]  # pending token and accepted draft tokens
        self.advance(features, torch.tensor(self.draft[:accepted] + [next_token]))
        self.draft = []

    def advance(self, features: Tensor, next_tokens: Tensor) -> None:
        """Append positions (features [t, hidden], next_tokens [t]); keep the last predicted feature."""
        embeds = self.embed[next_tokens]  # [t, hidden]
        self.feature = self.head(features[None].float(), embeds[None], self.cache)[:, -1:]  # [1, 1, hidden]
