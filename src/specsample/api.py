"""The Python API: load a target and a drafter once, then generate or stream.

    from specsample import SpecSampler
    sampler = SpecSampler.load()                      # the bundled SmolLM2-135M-Instruct, default drafter
    out = sampler.generate("Name three rivers.", max_new_tokens=64, temperature=0)
    print(out.text, out.stats.mean_accepted_length)

With no drafter named, `load` takes the default configuration for the target's backend on this
machine (`specsample.defaults`); `sampler.configuration` says which, and why.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from specsample.batch import Batch, Request, drain
from specsample.cost_curve import machine_ratios, remembered_ratios
from specsample.defaults import Configuration, default_configuration, given
from specsample.drafters import Drafter, check_spec, make_drafter
from specsample.drafters.base import draft_cost
from specsample.drafters.prediction import with_prediction
from specsample.engine import check_max_new_tokens, decode
from specsample.models import LoadedModel, Target, load_target
from specsample.models.choice import llamacpp_build, resolve
from specsample.models.loading import conversion_dir
from specsample.models.target import SlottedTarget, require
from specsample.openmp import use_threads
from specsample.policy import KPolicy, SeesCostCurve, SeesDraftCost, parse_batch_k, parse_k
from specsample.sampling import SamplingParams, check_seed, integer, request_source
from specsample.stats import Stats
from specsample.text import IncrementalDecoder, Message, StopMatcher, check_text, encode_prompt, stop_strings
from specsample.verify import ChainVerifier

Prompt = str | Sequence[Message]


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: Stats


@dataclass
class Chunk:
    text: str
    token_ids: list[int]


class Interrupted(RuntimeError):
    """A generation resumed after another one on the same target took a step (`Generation`), or one
    asked for the completion it never reached."""


class Generation:
    """A running generation: iterate for text chunks; `completion` is set when it ends.

    A sampler's target holds one sequence, so its generations run one at a time: one that another
    generation of the same sampler stepped after it cannot go on, and its next chunk raises
    `Interrupted` rather than continue from the other's cache. Steps are taken under the sampler's lock,
    so generations started from several threads fail that way too, never mixing their texts. To run
    several requests at once, use `SpecSampler.generate_batch` (or `batch`).
    """

    def __init__(self, sampler: SpecSampler, drafter: Drafter, prompt_ids: torch.Tensor, params: SamplingParams,
                 policy: KPolicy, max_new_tokens: int, seed: int | None, stop: Sequence[str],
                 cancelled: Callable[[], bool] | None = None) -> None:
        self.completion: Completion | None = None
        self.started = False
        self.chunks = self._chunks(sampler, drafter, prompt_ids, params, policy, max_new_tokens, seed, stop, cancelled)

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        return next(self.chunks)

    def result(self) -> Completion:
        """The completion, decoding what is left first; `Interrupted` for a generation that ended without
        one (interrupted, cancelled, or its chunks closed before the end)."""
        for _ in self.chunks:
            pass
        if self.completion is None:
            raise Interrupted("this generation ended before its completion: it was interrupted, cancelled, closed, "
                              "or stopped by an error")
        return self.completion

    def _chunks(
        self,
        sampler: SpecSampler,
        drafter: Drafter,
        prompt_ids: torch.Tensor,
        params: SamplingParams,
        policy: KPolicy,
        max_new_tokens: int,
        seed: int | None,
        stop: Sequence[str],
        cancelled: Callable[[], bool] | None,
    ) -> Iterator[Chunk]:
        model = sampler.model
        stats = Stats(load_seconds=model.load_seconds, drafter=sampler.configuration.drafter)
        steps = decode(
            sampler.target, drafter, policy, prompt_ids, params,
            max_new_tokens=max_new_tokens, eos_token_ids=model.eos_token_ids,
            random=request_source(seed), stats=stats, verifier=sampler.verifier, cancelled=cancelled,
        )
        output = TextOutput(model.tokenizer, stop, model.eos_token_ids)
        try:
            for new in self._turns(sampler, steps):
                yield output.feed(new)
                if output.stopped:
                    break
            tail = output.finish()
            if tail.text:
                yield tail
        finally:
            steps.close()
        if cancelled is None or not cancelled():  # a cancelled generation has no completion (`result` says so)
            self.completion = output.completion(stats)

    def _turns(self, sampler: SpecSampler, steps: Iterator[list[int]]) -> Iterator[list[int]]:
        """`steps`, each taken under the target's lock, as long as no other generation took a step since."""
        turns = sampler.turns
        while True:
            with turns.lock:
                if self.started and turns.running is not self:
                    raise Interrupted("this generation cannot go on: another generation on the same target "
                                      "ran after it, and the target holds one sequence at a time; finish or close "
                                      "one before starting the next, or run several with generate_batch")
                turns.running, self.started = self, True
                try:
                    new = next(steps)
                except StopIteration:
                    return
            yield new


class Turns:
    """Whose turn a target's one sequence is: the lock held for each step of a `Generation` and of a `batch`,
    and the generation whose step ran last. Kept per target (`TURNS`), not per sampler: two samplers built
    over one target (`SpecSampler.build`) had each gone on from the other's cache, with no error."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.running: Generation | None = None


TURNS: "weakref.WeakKeyDictionary[Target, Turns]" = weakref.WeakKeyDictionary()


class TextOutput:
    """A request's tokens as chunks of text that never split a character or a stop string; `stopped`
    once a stop string is complete (the text is cut before it)."""

    def __init__(self, tokenizer, stop: Sequence[str], eos_token_ids: frozenset[int]) -> None:
        self.decoder, self.matcher = IncrementalDecoder(tokenizer), StopMatcher(stop)
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = []
        self.stopped = False  # by a stop string
        self.kept = 0  # of the last step's tokens, those in the answer

    def feed(self, new: list[int]) -> Chunk:
        """The chunk of a step's new tokens, up to the token that completes a stop string."""
        chunk = Chunk("", [])
        for token in new:
            chunk.token_ids.append(token)
            delta, self.stopped = self.matcher.feed(self.decoder.push(token))
            chunk.text += delta
            if self.stopped:
                break
        self.token_ids += chunk.token_ids
        self.kept = len(chunk.token_ids)
        return chunk

    def finish(self) -> Chunk:
        """The text held back until the end (a possible start of a stop string, a split character)."""
        if self.stopped:
            return Chunk("", [])
        delta, self.stopped = self.matcher.feed(self.decoder.flush())
        return Chunk(delta if self.stopped else delta + self.matcher.finish(), [])

    def completion(self, stats: Stats) -> Completion:
        """The completion, with `stats` counting the tokens of its answer only (`Stats.answer_ends`)."""
        if self.stopped:
            stats.answer_ends(self.kept)
        ended = self.stopped or (self.token_ids and self.token_ids[-1] in self.eos_token_ids)
        text = self.matcher.text[: self.matcher.emitted]
        return Completion(text, self.token_ids, "stop" if ended else "length", stats)


def tell_draft_cost(policy: KPolicy, drafter: Drafter) -> None:
    """Tell a K policy that sees a drafter's cost (`SeesDraftCost`) the cost the drafter declares, if any."""
    cost = draft_cost(drafter)
    if cost is not None and isinstance(policy, SeesDraftCost):
        policy.see_draft_cost(cost)


class SpecSampler:
    """A target model with its tokenizer and a drafter, ready to generate.

    `configuration` names the drafter, the K policy used when a call gives none, and why they
    were chosen; `backend` and `backend_reason` the target's backend as `load` resolved it
    (`models.choice`), or as the caller names it (`backend`; else the target's type, and its cost curve
    is measured anew rather than remembered: the fast and gguf backends' targets are of one type);
    `threads` as given to `load`; `verifier` verifies every draft (a check passes one broken on purpose).
    """

    verifier: ChainVerifier = ChainVerifier()

    def __init__(
        self,
        model: LoadedModel,
        target: Target,
        drafter: Drafter,
        configuration: Configuration | None = None,
        *,
        backend: str | None = None,
        threads: int | None = None,
    ) -> None:
        self.model = model
        self.target = target
        self.drafter = drafter
        self.configuration = configuration or given(type(drafter).__name__)
        self.named_backend = backend  # keys the remembered cost curve (`cost_ratios`)
        self.backend = backend or type(target).__name__
        self.backend_reason = "a target given directly"
        self.policies: dict[str, KPolicy] = {}
        self.threads = threads
        self._cost_ratios: dict[int, float] | None = None
        self.turns = TURNS.setdefault(target, Turns())  # shared by every sampler over this target

    @classmethod
    def load(
        cls,
        model: str | None = None,
        drafter: str | None = None,
        *,
        backend: str = "auto",
        trust_remote_code: bool = False,
        threads: int | None = None,
        wrap: Callable[[Target], Target] | None = None,
    ) -> "SpecSampler":
        """Load a target (None: the bundled model) and a drafter (a name or a draft model path; None:
        the default configuration for the target's backend on this machine, `specsample.defaults`).
        `backend` "auto" runs a GGUF file where it measures faster on this machine (`models.choice`).
        `wrap`, if given, wraps the target before the drafter is made, so both see the wrapper (a check's
        `PrefixCache`). `threads`: CPU threads of a pass on every backend (`openmp.use_threads`: with torch
        loaded, those of the calling thread's passes). A drafter of no known name is refused before anything loads."""
        if drafter is not None:
            check_spec(drafter)
        use_threads(threads)
        backend, reason = resolve(model, backend, threads=threads, trust_remote_code=trust_remote_code)
        loaded, target = load_target(model, backend, trust_remote_code=trust_remote_code, threads=threads)
        target = target if wrap is None else wrap(target)
        sampler = cls.build(loaded, target, drafter, backend=backend, trust_remote_code=trust_remote_code, threads=threads)
        sampler.backend_reason = reason
        return sampler

    @classmethod
    def build(
        cls,
        loaded: LoadedModel,
        target: Target,
        drafter: str | None = None,
        *,
        backend: str = "auto",
        trust_remote_code: bool = False,
        threads: int | None = None,
    ) -> "SpecSampler":
        """A sampler over a loaded model and its target (on `backend`, with `threads`), with a drafter as for
        `load`: a draft model runs with the target's threads."""
        configuration = default_configuration(target) if drafter is None else given(drafter)
        made = make_drafter(configuration.drafter, loaded, target, backend=backend, trust_remote_code=trust_remote_code,
                            threads=threads)
        return cls(loaded, target, made, configuration, backend=backend, threads=threads)

    def policy(self, k: int | str) -> KPolicy:
        """The K policy of a spec (`parse_k`), one per spec for the sampler's life, so that `auto`
        keeps what it measured (the cost curve, the drafter's cost, acceptance) across requests."""
        key = str(k).strip().lower()
        if key not in self.policies:
            self.policies[key] = parse_k(k)
        return self.policies[key]

    def cost_ratios(self) -> dict[int, float]:
        """The target's f(n)/f(1) on this machine (`cost_curve.machine_ratios`), measured at the first
        request under the cost model: remembered for a GGUF file on a named backend, else measured once
        per sampler. Measuring fills the target's cache, so it takes the sampler's lock as a step does, and a
        paused generation then raises `Interrupted` rather than go on from the measurement's cache; ratios
        remembered on this machine leave a paused generation be."""
        if self._cost_ratios is None:
            gguf, backend = self.model.gguf, self.named_backend
            key = None if gguf is None or backend is None else "|".join(  # llama.cpp's build: its speed, if it runs
                [conversion_dir(gguf).name, backend, type(self.target).__name__, str(self.threads), str(torch.get_num_threads()),
                 llamacpp_build()])
            self._cost_ratios = remembered_ratios(key)
            if self._cost_ratios is None:
                with self.turns.lock:
                    self._cost_ratios = machine_ratios(self.target, key)
                    self.turns.running = None
        return self._cost_ratios

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """The prompt's token ids (`in_vocabulary`); `chat` a bool (a string such as "no" would read as True)."""
        if not isinstance(chat, bool):
            raise ValueError(f"chat must be True or False, got {chat!r:.40}")
        return self.in_vocabulary(encode_prompt(self.model.tokenizer, prompt, chat), "the prompt")

    def in_vocabulary(self, ids: list[int], what: str) -> list[int]:
        """`ids`, or a ValueError naming `what` if one of them has no row in the model (a token added to the
        tokenizer and not to the model), which a backend would read as padding or fail on mid-batch."""
        beyond = [i for i in ids if not 0 <= i < self.target.vocab_size]
        if beyond:
            raise ValueError(f"{what} encodes to token id {beyond[0]}, past the model's vocabulary of "
                             f"{self.target.vocab_size}: the tokenizer has tokens the model does not")
        return ids

    def encode_text(self, text: str) -> list[int]:
        """The token ids of `text` as a part of an answer: no special tokens added."""
        return self.model.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_prediction(self, prediction: str) -> list[int]:
        """The token ids of a predicted answer (`stream`'s `prediction`); a ValueError for one that is not
        text, or longer than any answer can be (the context window): its index would cost memory and time
        for nothing."""
        if not isinstance(prediction, str):
            raise ValueError(f"a prediction must be a string, got {type(prediction).__name__}")
        check_text(prediction, "the prediction")
        ids = self.in_vocabulary(self.encode_text(prediction), "the prediction")
        if len(ids) > self.target.max_length:
            raise ValueError(f"the prediction is {len(ids)} tokens, longer than any answer can be "
                             f"(the context window holds {self.target.max_length})")
        return ids

    def generate(self, prompt: Prompt, **options) -> Completion:
        """Generate a whole completion; options as for `stream`."""
        return self.stream(prompt, **options).result()

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        k: int | str | KPolicy | None = None,  # K, "auto" (cost model), "auto:heuristic", a KPolicy; None: the configuration's
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        chat: bool = True,
        prediction: str | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Generation:
        """Start a generation; its chunks carry text that never splits a character or a stop string.

        With a `seed`, the text is the one plain decoding gives with that seed, whatever the drafter,
        K or K policy, on the same backend (`sampling.CoupledSource`); without one, tokens are drawn
        from OS entropy and verified by modified rejection sampling (`sampling.request_source`).
        `prediction`: text the answer is expected to be close to (OpenAI's Predicted Outputs), drafted
        from beside the sampler's drafter (`drafters.prediction.with_prediction`); it changes the speed,
        never the text. `cancelled`: asked while a long prompt prefills (`engine.prefill`, every 256
        positions); once it says True the generation ends with no chunk, before its first step (a server's
        client that has gone; between steps, stop iterating).
        """
        params = SamplingParams(temperature, top_k, top_p, min_p)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        seed = None if seed is None else check_seed(seed)
        k = self.configuration.k if k is None else k
        policy = self.informed(k if isinstance(k, KPolicy) else self.policy(k))  # else a spec: 4, "auto"
        prompt_ids = torch.tensor(self.encode(prompt, chat), dtype=torch.long)
        drafter = self.drafter if prediction is None else with_prediction(self.drafter, self.encode_prediction(prediction))
        return Generation(self, drafter, prompt_ids, params, policy, max_new_tokens, seed, stop_strings(stop), cancelled)

    def batch(self, max_batch: int, k: int | str | None = None, prefill_chunk: int | None = None) -> Batch:
        """A batch of `max_batch` slots over this sampler's target (`batch.Batch`), drafting with forks
        of its drafter, each slot with a K policy of the spec `k` (None: the configuration's); its pass
        cost starts from the target's cost curve on this machine (`cost_ratios`). `prefill_chunk`: a
        prompt prefills that many positions before each step (None: all at once, as it joins)."""
        slots = require(self.target, SlottedTarget, "batched decoding").slots(max_batch)
        spec = self.configuration.k if k is None else k
        return Batch(slots, self.drafter, lambda: self.informed(parse_batch_k(spec)), eos_token_ids=self.model.eos_token_ids,
                     verifier=self.verifier, cost_prior=self.cost_ratios(), prefill_chunk=prefill_chunk, lock=self.turns.lock)

    def informed(self, policy: KPolicy) -> KPolicy:
        """`policy`, told what this sampler knows before its first step: the target's cost curve on this
        machine (`SeesCostCurve`) and the drafter's declared cost (`SeesDraftCost`); a request alone in a
        batch then chooses K as one decoded by `stream` does."""
        if isinstance(policy, SeesCostCurve):
            policy.see_cost_curve(self.cost_ratios())
        tell_draft_cost(policy, self.drafter)
        return policy

    def request(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        chat: bool = True,
        prediction: str | None = None,
    ) -> Request:
        """A request for a `batch`, options as for `stream`."""
        params = SamplingParams(temperature, top_k, top_p, min_p)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        prompt_ids = torch.tensor(self.encode(prompt, chat), dtype=torch.long)
        stats = Stats(load_seconds=self.model.load_seconds, drafter=self.configuration.drafter)
        predicted = None if prediction is None else self.encode_prediction(prediction)
        return Request(prompt_ids, params, max_new_tokens, request_source(seed), stats, prediction=predicted)

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        *,
        max_batch: int = 8,
        k: int | str | None = None,
        stop: str | Sequence[str] = (),
        seeds: Sequence[int | None] | None = None,
        batch: Batch | None = None,
        **options,
    ) -> list[Completion]:
        """Complete `prompts` together, at most `max_batch` at once in one target pass per step, each
        joining as soon as one ends (continuous batching); options as for `stream`, `seeds` one per
        prompt. Each completion is the one `generate` gives its prompt alone (greedy, or with a seed).
        With `batch` (an empty one from `batch`, which `max_batch` and `k` then do not change) the
        prompts run in it, and its `totals` and policies stay to be read or reused."""
        if integer(max_batch, "max_batch") < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if "seed" in options:
            raise ValueError("generate_batch takes seeds=[...], one per prompt, not seed=")
        if isinstance(prompts, (str, bytes, dict)):  # a string is one prompt, not prompts of its characters
            raise ValueError(f"generate_batch takes a list of prompts, got one: {prompts!r:.60}")
        try:
            prompts = list(prompts)  # a generator of prompts too
        except TypeError:
            raise ValueError(f"generate_batch takes a list of prompts, got {type(prompts).__name__}") from None
        stop = stop_strings(stop)
        seeds = [None] * len(prompts) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        requests = [self.request(prompt, seed=seed, **options) for prompt, seed in zip(prompts, seeds)]
        outputs = {request: TextOutput(self.model.tokenizer, stop, self.model.eos_token_ids) for request in requests}
        batch = batch or self.batch(max(1, min(max_batch, len(prompts))), k)

        def feed(request: Request, new: list[int]) -> bool:
            outputs[request].feed(new)
            return outputs[request].stopped

        drain(batch, requests, feed)
        for output in outputs.values():
            output.finish()
        return [outputs[request].completion(request.stats) for request in requests]
