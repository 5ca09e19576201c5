"""The `head` drafter: a small decoder block trained on the target's own hidden states (EAGLE).

The head reads (feature of position i, embedding of token i + 1), where a
feature is the target's final normed hidden state, the input of its LM head,
and predicts the feature of position i + 1. A head with `feature_layers` reads
the outputs of those decoder layers as well, fused by one linear map (EAGLE-3):
the final state is shaped to predict token i + 1 alone, earlier layers keep more
of the context that the token after it depends on. Drafting K tokens runs it K - 1
times on its own predictions; each draft token comes from the target's LM head
restricted to the N tokens the target produces most often (FR-Spec), so a
draft step costs one small block plus an [hidden, N] matmul. Tokens outside
the subset get draft probability 0, which rejection sampling handles exactly.
At temperature > 0 a draft token is drawn over the whole vocabulary (the subset's
probabilities in place, zeros elsewhere), so for a request with a seed each
token id meets the numbers the target's token at that position is drawn with.
Each draft token carries the head's own probability of it as its confidence;
`--k auto` verifies only the prefix of the draft those make worth its cost.

Drafting runs the trained weights on the fast backend's decoder code
(`fast_head`: packed small-row kernels, a preallocated cache rolled back by
length), so a draft step costs a small fraction of a target pass. Where the
C++ kernels run, the head drafts from int8 copies of its weights and of its
LM head rows (as the `quantized` drafter does), a quarter of the bytes per
draft step: on the bundled model that halves the drafting time and moves the
mean accepted length by less than 0.01 (BENCHMARKS.md). The draft
probabilities are the int8 head's, so verification stays exact.

After verification the head recomputes the accepted positions from the
target's true features, so its cache never keeps its own guesses. It does so
in batches: `observe` keeps the target's features of the new positions, and the
head runs over all kept positions in one pass at the next `propose`, or once
`CATCH_UP_BATCH` of them are waiting. One position costs about as much as a
handful (0.44 ms for 1, 1.5 ms for 16 on the bundled model), so steps that do
not draft (K = 0 under `--k auto`, steps `suffix` drafts in `suffix+head`) cost
the head about 0.3 ms each, keeping features included, and a draft after a long plain
stretch pays for at most 15 positions, not for the whole stretch: a K policy
that charged a probe for hundreds of positions would judge drafting far
dearer than it is. `begin` runs the head over the prompt's last PROMPT_WINDOW
positions, with the prefill: it trains on windows of 128 positions, and on
Spec-Bench's long prompts reading all of them cost 8% of the prefill and
accepted less (BENCHMARKS.md).

A head is a directory: `head.safetensors` (float16 weights and the subset's
token ids) and `head.json` (the config, naming the target it was trained for;
loading it for another target is refused: one whose LM head differs, by `target_fingerprint`. A
fine-tune that kept its base's LM head passes; its drafts are verified as any, so only speed is at stake.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specsample.drafters.base import Draft
from specsample.models import LoadedModel, Target, kernels
from specsample.models.llama import Layer, Linear, LlamaTarget
from specsample.models.loading import write_atomically
from specsample.models.ops import rms_norm, rope_tables, rotate
from specsample.models.target import RecordsFeatures, require
from specsample.models.quantize import quantize_layer, quantize_linear
from specsample.sampling import RandomSource, SamplingParams, argmax, draft_confidence, probs_from_logits

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "data" / "heads"
CONFIG_FILE, WEIGHTS_FILE = "head.json", "head.safetensors"
CATCH_UP_BATCH = 16  # positions observed without a draft, after which the head runs over them
PROMPT_WINDOW = 256  # the prompt's last positions the head runs over (it trains on windows of 128)


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
    feature_layers: tuple[int, ...] = ()  # the target's decoder layers (1-based) read besides its final state

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # a list when read from JSON

    @classmethod
    def for_target(
        cls, model: LoadedModel, layers: int = 1, vocab_subset: int = 0, feature_layers: tuple[int, ...] = ()
    ) -> HeadConfig:
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
            feature_layers=tuple(feature_layers), rope_theta=rope_base(config),
        )


def rope_base(config) -> float:
    """The target's rotary base (`rope_parameters` in transformers 5, `rope_theta` before): the head starts
    from the target's last layer, whose queries and keys were trained with it."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def target_fingerprint(model: nn.Module) -> str:
    """A short hash of the target's LM head (shape and every 64th row in float16)."""
    weight = model.get_output_embeddings().weight.detach()
    digest = hashlib.sha256(str(tuple(weight.shape)).encode())
    digest.update(weight[::64].to(torch.float16).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, earlier: list[tuple[Tensor, Tensor]], mask: Tensor | None) -> Tensor:
        """x [b, t, hidden] of one pass; `earlier` and `mask` as for `attention`."""
        x = x + self.attention(rms_norm(x, self.attn_norm, self.c.eps), cos, sin, earlier, mask)
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, self.c.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def attention(
        self, x: Tensor, cos: Tensor, sin: Tensor, earlier: list[tuple[Tensor, Tensor]], mask: Tensor | None
    ) -> Tensor:
        """Attention of x [b, t, hidden] over the keys and values of the earlier passes and its own,
        which it appends to `earlier`; causal when `mask` is None (the first pass), else `mask`
        [t, passes * t] says which of them each position sees."""
        c, (b, t, _) = self.c, x.shape
        q, k, v = self.qkv(x).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = rotate(q.view(b, t, c.heads, c.head_dim), cos, sin).transpose(1, 2)  # [b, heads, t, dim]
        k = rotate(k.view(b, t, c.kv_heads, c.head_dim), cos, sin).transpose(1, 2)  # [b, kv_heads, t, dim]
        v = v.view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        earlier.append((k, v))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys, values = (torch.cat(kv, 2) for kv in zip(*earlier))  # [b, kv_heads, passes * t, dim]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))


class DraftHead(nn.Module):
    """(features [b, t, hidden], token embeddings [b, t, hidden]) -> next features [b, t, hidden]."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        if config.feature_layers:
            self.fuse = nn.Linear((len(config.feature_layers) + 1) * config.hidden_size, config.hidden_size, bias=False)
            with torch.no_grad():  # start by passing the final state through: the head without fusion
                self.fuse.weight.zero_()[:, -config.hidden_size :].copy_(torch.eye(config.hidden_size))
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, features: Tensor, embeds: Tensor, depth: int = 1) -> list[Tensor]:
        """Training and evaluation over whole windows (drafting runs `fast_head` instead): the features
        [b, t, hidden] predicted by `depth` passes, pass d reading pass d - 1's predictions. `features`
        [b, t, (len(feature_layers) + 1) * hidden] are the target's: its layers' outputs, then its final state.

        Position i of pass 1 reads (feature i, embedding i + 1) and predicts feature i + 1. Pass d
        stands for draft step d from anchor i - d + 1: position i reads pass d - 1's prediction at
        i - 1 and sees what drafting sees (EAGLE-3's training-time test, HASS): the keys of pass 1,
        computed from the target's features, up to the anchor, then those of passes 2..d on the
        diagonal, one position each, computed from the head's own predictions.
        """
        t = features.shape[1]
        cos, sin = self.rotary(t)
        earlier: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.blocks]  # per block, (keys, values) per pass
        inputs = self.fuse(features) if self.config.feature_layers else features  # [b, t, hidden]
        outputs = []
        for d in range(1, depth + 1):
            x = self.fc(torch.cat([inputs, embeds], -1))
            mask = draft_step_mask(t, d) if d > 1 else None
            for block, kv in zip(self.blocks, earlier):
                x = block(x, cos, sin, kv, mask)
            outputs.append(rms_norm(x, self.norm, self.config.eps))
            inputs = torch.cat([inputs[:, :1], outputs[-1][:, :-1]], 1)
        return outputs

    def rotary(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, signed sin [length, 1, dim] of positions 0..length - 1 (`rope_tables`)."""
        cos, sin = rope_tables(self.inv_freq, 1.0, length, torch.float32)
        return cos[:, None], sin[:, None]

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


def draft_step_mask(t: int, depth: int) -> Tensor:
    """[t, depth * t] which keys position i of pass `depth` sees: pass 1's up to the anchor i - depth + 1,
    and pass j's (j = 2..depth) at position i - depth + j only."""
    i = torch.arange(t)[:, None]
    key = torch.arange(t)[None, :]
    blocks = [key <= i - depth + 1] + [key == i - depth + j for j in range(2, depth + 1)]
    return torch.cat(blocks, 1)


def save_head(directory: Path, head: DraftHead, token_ids: Tensor) -> None:
    """Write head.safetensors (float16 weights, int64 token ids) and head.json, each whole or not at all
    (a run killed while saving leaves the files it had)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: w.detach().to(torch.float16).contiguous() for name, w in head.state_dict().items()}
    tensors["token_ids"] = token_ids.to(torch.int64).contiguous()
    tmp = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, tmp)
    tmp.replace(directory / WEIGHTS_FILE)
    write_atomically(directory / CONFIG_FILE, json.dumps(asdict(head.config), indent=1) + "\n")


def load_head(directory: Path, model: LoadedModel) -> tuple[DraftHead, Tensor]:
    """The head (float32) and its token ids [n]; refuses a head trained for another target."""
    directory = Path(directory).expanduser()
    if not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"not a draft head directory (no {CONFIG_FILE}): {directory}")
    try:
        config = HeadConfig(**json.loads((directory / CONFIG_FILE).read_text()))
    except (ValueError, TypeError) as error:  # not JSON; keys of another version
        raise ValueError(f"{directory / CONFIG_FILE} is not a head configuration this version reads ({error})") from None
    if config.fingerprint != target_fingerprint(model.model):
        raise ValueError(
            f"the draft head in {directory} was trained for target {config.target!r}, not {model.name!r}: "
            f"train one for this target with `specsample train-draft`"
        )
    try:
        tensors = load_file(directory / WEIGHTS_FILE)
        token_ids = tensors.pop("token_ids")
        head = DraftHead(config)
        head.load_state_dict({name: w.float() for name, w in tensors.items()})
    except (SafetensorError, OSError, KeyError, RuntimeError) as error:  # cut short, missing, or of another shape
        reason = str(error).strip().splitlines()[0]
        raise ValueError(f"cannot read the head's weights in {directory / WEIGHTS_FILE} as {CONFIG_FILE} describes "
                         f"them ({reason}): train the head again") from None
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


def fast_head(
    head: DraftHead, lm_head_rows: Tensor, max_length: int, int8: bool = True
) -> tuple[Linear | None, Linear, LlamaTarget]:
    """The trained head in the fast backend's layout, for drafting one or a few rows at a time;
    with `int8`, the decoder's linear maps and LM head rows in int8 where the C++ kernels run.

    Returns the fusion of the target's layers (None without `feature_layers`), the
    input projection and a `LlamaTarget` made of the head's blocks whose
    LM head is the target's restricted to the subset (`lm_head_rows` [n, hidden]):
    `forward_embeddings(fc(feature ++ embedding))` then gives the subset logits
    [t, n] and leaves the predicted features in `last_hidden`, with the head's
    cache preallocated and rolled back by length, as the target's is.
    """
    c, dtype = head.config, torch.float32
    packed = c.head_dim <= kernels.MAX_HEAD_DIM and kernels.available()

    def linear(layer: nn.Linear | Tensor) -> Linear:
        return Linear.from_weight(layer.weight if isinstance(layer, nn.Linear) else layer, None, dtype, packed)

    layers = [
        Layer(block.attn_norm.detach().clone(), linear(block.qkv), linear(block.o), block.mlp_norm.detach().clone(),
              linear(block.gate_up), linear(block.down))
        for block in head.blocks
    ]
    lm_head = linear(lm_head_rows.detach())
    if int8 and packed:
        layers, lm_head = [quantize_layer(layer) for layer in layers], quantize_linear(lm_head)
    cos, sin = rope_tables(head.inv_freq, 1.0, max_length, dtype)
    decoder = LlamaTarget(
        layers, None, head.norm.detach().clone(), lm_head, cos, sin,
        heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, eps=c.eps,
    )
    return (linear(head.fuse) if c.feature_layers else None), linear(head.fc), decoder


class HeadDrafter:
    """Drafts K tokens by running the head on its own predicted features."""

    is_lookup = False  # it draws its draft

    def __init__(
        self, target: Target, head: DraftHead, embed: Tensor, lm_head: Tensor, token_ids: Tensor, int8: bool = True
    ) -> None:
        self.target = require(target, RecordsFeatures, "the head drafter")
        self.fuse, self.fc, self.decoder = fast_head(head, lm_head[token_ids], target.max_length, int8)
        self.feature_layers = head.config.feature_layers
        self.target.record_features(self.feature_layers)
        self.read = 0  # the target's positions whose features the head has taken
        self.embed = embed  # [vocab, hidden], the target's input embeddings
        self.token_ids = token_ids  # [n]
        self.vocab_size = target.vocab_size
        self.params = SamplingParams()
        self.feature: Tensor | None = None  # [1, hidden] predicted feature of the pending token
        self.logits: Tensor | None = None  # [n] subset logits of the token after the pending one
        # (the target's features [t, (layers + 1) * hidden], next tokens [t]) not yet run through the head
        self.unread: list[tuple[Tensor, Tensor]] = []

    @classmethod
    def load(cls, model: LoadedModel, target: Target, directory: Path | str) -> HeadDrafter:
        head, token_ids = load_head(Path(directory), model)
        embed = model.model.get_input_embeddings().weight.detach()
        return cls(target, head, embed, model.model.get_output_embeddings().weight.detach(), token_ids)

    @torch.inference_mode()
    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        """Run the head over the last `PROMPT_WINDOW` positions the target's prefill left (prefill
        work, timed as such). The head trains on windows of 128 positions, so an earlier position
        adds work, not acceptance; its rotary positions count from the window's start, which changes
        no attention score (they depend on distances only)."""
        self.params, self.feature, self.logits, self.unread = params, None, None, []
        self.decoder.rollback(0)
        start = self.read = max(0, prompt_ids.shape[0] - 1 - PROMPT_WINDOW)
        if prompt_ids.shape[0] > 1:
            self.advance(self.take_features(prompt_ids.shape[0] - 1 - start), prompt_ids[1 + start :])

    @torch.inference_mode()
    def propose(self, k: int, random: RandomSource) -> Draft:
        self.catch_up()
        if self.feature is None:
            return Draft.empty()
        feature, logits, tokens, probs, confidence = self.feature, self.logits, [], [], []
        for i in range(k):
            subset_probs = probs_from_logits(logits, self.params)  # [n], a point mass when greedy
            confidence.append(draft_confidence(logits, subset_probs, self.params))
            if self.params.greedy:
                token = int(self.token_ids[argmax(subset_probs)])
            else:
                probs.append(torch.zeros(self.vocab_size).index_copy_(0, self.token_ids, subset_probs))  # [vocab]
                token = random.draw(probs[-1], i)
            tokens.append(token)
            if i + 1 < k:
                logits = self.step(feature, torch.tensor([token]))[0]
                feature = self.decoder.last_hidden
        self.decoder.rollback(self.decoder.length - (k - 1))  # drop the positions computed from predicted features
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None, torch.tensor(confidence))

    @torch.inference_mode()
    def observe(self, tokens: list[int]) -> None:
        """Keep the target's true features of the pending and accepted tokens, for the next draft;
        run the head over the kept positions once there are `CATCH_UP_BATCH` of them."""
        self.unread.append((self.take_features(len(tokens)), torch.tensor(tokens)))
        if sum(len(next_tokens) for _, next_tokens in self.unread) >= CATCH_UP_BATCH:
            self.catch_up()

    def take_features(self, n: int) -> Tensor:
        """The target's features [n, (layers + 1) * hidden] of the next n positions the head has not read."""
        self.read += n
        return self.target.features(self.read - n, self.read, self.feature_layers)

    def catch_up(self) -> None:
        """Run the head over every position observed since it last ran, in one pass."""
        if self.unread:
            features, next_tokens = (torch.cat(parts) for parts in zip(*self.unread))
            self.unread = []
            self.advance(features, next_tokens)

    def advance(self, features: Tensor, next_tokens: Tensor) -> None:
        """Append positions (the target's features [t, (layers + 1) * hidden], next_tokens [t]); keep the
        last predicted feature and its logits."""
        self.step(self.fuse(features) if self.fuse else features, next_tokens, logits=False)
        self.feature = self.decoder.last_hidden[-1:]  # [1, hidden]
        self.logits = self.decoder.lm_head(self.feature)[0]  # [n]

    def step(self, features: Tensor, next_tokens: Tensor, logits: bool = True) -> Tensor | None:
        """One head pass over t positions (features [t, hidden], next_tokens [t]): subset logits [t, n] or None."""
        x = self.fc(torch.cat([features.float(), self.embed[next_tokens]], -1))  # [t, hidden]
        return self.decoder.forward_embeddings(x, logits=logits)
