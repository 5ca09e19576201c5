"""The benchmark harness: configurations, an interleaved runner, per-answer records.

Prompts are Spec-Bench's (`specsample.prompts`); a multi-turn prompt is fed
turn by turn, each turn after the configuration's own earlier answers. A
configuration is the engine with a drafter and K, a transformers baseline
(`generate`, prompt lookup, assisted generation), or, on the llamacpp backend,
a llama.cpp baseline (its plain decoding, `llama-lookup`,
`llama-speculative-simple`: `llamacpp_baselines`). Every engine configuration
shares the one loaded target (its KV cache is per-request state, reset by
prefill). A baseline that cannot run here (a llama.cpp tool not built) is left
out of the run and reported as not available.
After a warm-up on a prompt of its own (a measured prompt would let drafters
that remember earlier requests, such as `suffix`, learn its answer), all
configurations run prompt by prompt, in an order that
rotates from one prompt to the next, so drift of the machine's speed hits
them alike. The reference is the first configuration (for `bench run`, plain
decoding through the engine, "plain"); at temperature 0 every configuration's
tokens are compared with its tokens. Every answer is timed the same way, by
its runner, end to end (prefill included); the engine's statistics add its
decoding time alone (the llama.cpp baselines' statistics too, from their own
timings, model loading excluded).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from time import perf_counter
from typing import Protocol, get_type_hints

from tqdm import tqdm

from specsample.api import SpecSampler
from specsample.bench import baselines
from specsample.bench import llamacpp_baselines as llamacpp
from specsample.bench.baselines import Output
from specsample.defaults import given
from specsample.drafters import REGISTRY, DraftModelDrafter, check_spec, make_drafter
from specsample.models import LoadedModel, Target, load_model, make_target
from specsample.models.target import NotOnThisBackend
from specsample.openmp import default_threads
from specsample.policy import parse_k
from specsample.prompts import Prompt
from specsample.sampling import SamplingParams, check_seed
from specsample.text import Message

REFERENCE = "plain"
WARMUP_PROMPT = "Explain in a few sentences why the sky is blue."
# The target as its own draft model, with a cache of its own: every draft token is accepted, so its
# speed against plain decoding is what drafting and verifying cost.
SELF_DRAFTER = "self"


DRAFT_MODEL_KINDS = ("hf-assisted", "llamacpp-speculative")  # baselines that take drafter=PATH of a draft model


@dataclass(frozen=True)
class Config:
    """One way of decoding: the engine with a drafter and K, or a transformers baseline."""

    name: str
    kind: str = "engine"  # engine, hf-generate, hf-lookup, hf-assisted, or one of llamacpp_baselines.KINDS
    # engine: a registered drafter, "self" or a draft model path; hf-assisted, llamacpp-speculative: a draft model path
    drafter: str = "none"
    k: str = "4"  # engine: an integer or a K policy; hf-lookup / hf-assisted / llamacpp-lookup(-invariant) / -speculative: an integer
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        """Bad sampling options, seeds, K specs and drafter names are refused as the configuration is read,
        before a model loads."""
        SamplingParams(self.temperature, self.top_k, self.top_p)  # raises on a bad option
        check_seed(self.seed)
        if self.kind == "engine":
            parse_k(self.k)
            if self.drafter != SELF_DRAFTER:
                check_spec(self.drafter)
        elif self.kind in DRAFT_MODEL_KINDS and not Path(self.drafter).expanduser().exists():
            raise ValueError(f"configuration {self.name}: kind {self.kind} needs drafter=PATH of a draft model, "
                             f"got {self.drafter!r}")
        elif self.kind not in DRAFT_MODEL_KINDS and self.drafter != "none":
            raise ValueError(f"configuration {self.name}: kind {self.kind} takes no drafter, got {self.drafter!r}")

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class Record:
    """The figures of one answer (one turn of one prompt) under one configuration."""

    config: str
    question_id: int | str
    category: str
    turn: int
    prompt_tokens: int
    generated_tokens: int
    wall_seconds: float
    stats: dict | None  # Stats.to_dict() for engine configurations
    matches_plain: bool | None = None  # at temperature 0: same tokens as the reference (in `bench run`, plain decoding)
    mismatch_at: int | None = None  # index of the first differing token


class Runner(Protocol):
    def run(self, messages: Sequence[Message]) -> Output: ...


@dataclass(frozen=True)
class Setup:
    """What every configuration of a run shares: the target model, its Target backend (and the
    backend's name, for a second target of the same kind), whether models may run their own code,
    and the threads of a llamacpp target (None: all cores)."""

    model: LoadedModel
    target: Target
    backend: str = "auto"
    trust_remote_code: bool = False
    threads: int | None = None


FIELD_TYPES: dict[str, type] = get_type_hints(Config)  # str, int or float
DEFAULTS = {f.name: f.default for f in fields(Config) if f.name not in ("name", "kind", "drafter")}


def read_configs(specs: Sequence[str], overrides: dict) -> tuple[dict, list[Config]]:
    """Run defaults and configurations from TOML files and `key=value,...` strings.

    Precedence, lowest first: built-in defaults, a TOML file's [defaults] table,
    `overrides` (command-line options; None means not given), each configuration's own values.
    The files' [defaults] are the run's (its baselines run with them), so two files that set a key
    to different values there are refused rather than one silently applied to the other's entries.
    """
    defaults, entries, set_by = dict(DEFAULTS), [], {}
    for spec in specs:
        if spec.endswith(".toml"):
            data = read_toml(spec)
            unknown = sorted(set(data) - {"defaults", "config"})
            if unknown or not data.get("config"):
                found = "keys " + ", ".join(map(repr, unknown)) if unknown else "no [[config]]"
                raise ValueError(f"{spec}: a configuration file has a [defaults] table and [[config]] tables, at least "
                                 f"one; found {found}")
            tables = data["config"] if isinstance(data["config"], list) else [data["config"]]
            if not isinstance(data.get("defaults", {}), dict) or not all(isinstance(t, dict) for t in tables):
                raise ValueError(f"{spec}: [defaults] and each [[config]] must be tables of key = value")
            for key, value in data.get("defaults", {}).items():
                if key in set_by and defaults[key] != value:
                    raise ValueError(f"{set_by[key]} and {spec} set {key} to {defaults[key]!r} and {value!r} in [defaults]: "
                                     "run them apart, or set it in each [[config]]")
                defaults[key], set_by[key] = value, spec
            entries += tables
        else:
            entries.append(parse_pairs(spec))
    defaults.update({key: value for key, value in overrides.items() if value is not None})
    defaults = coerce(defaults)
    return defaults, [make_config({**defaults, **coerce(entry)}) for entry in entries]


def read_toml(path: str) -> dict:
    """A configuration file's tables; a file that cannot be read or parsed is named in the error."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"--config {path} is not valid TOML: {error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path} is not UTF-8 text") from None


def parse_pairs(spec: str) -> dict[str, str]:
    """`drafter=ngram,k=4,temperature=0` -> a dict of strings."""
    pairs = [item.partition("=") for item in spec.split(",") if item.strip()]
    if not pairs or any(not sep for _, sep, _ in pairs):
        raise ValueError(f"configuration {spec!r}: expected key=value pairs separated by commas, or a .toml file")
    keys = [key.strip() for key, _, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"configuration {spec!r} gives {', '.join(twice)} twice")
    return {key: value.strip() for key, (_, _, value) in zip(keys, pairs)}


def coerce(entry: dict) -> dict:
    """Values converted to the Config field types: a TOML value of the field's type (an integer for a
    float too), or a string (`key=value` pairs) that reads as one; never a boolean, nor 2.9 for an
    integer. Unknown keys are an error."""
    unknown = set(entry) - set(FIELD_TYPES)
    if unknown:
        raise ValueError(f"unknown configuration keys {sorted(unknown)}: expected some of {sorted(FIELD_TYPES)}")
    out = {}
    for key, value in entry.items():
        kind = FIELD_TYPES[key]
        try:
            if not reads_as(value, kind):
                raise TypeError
            out[key] = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"configuration key {key}: {value!r} is not a {kind.__name__}") from None
    return out


def reads_as(value: object, kind: type) -> bool:
    """Whether `value` converts to `kind` without loss: a string (it is parsed), or a number that is not a
    boolean, an integer where `kind` is int."""
    if isinstance(value, str):
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return kind is not int or isinstance(value, int)


def make_config(values: dict) -> Config:
    """A checked configuration; without a name, one made of its drafter, K and temperature."""
    config = Config(**{"name": default_name(values), **values})
    if not config.name.strip() or "|" in config.name or "\n" in config.name:
        raise ValueError(f"configuration name {config.name!r}: it heads a row of the Markdown tables, so it must be "
                         "non-empty, without '|' or line breaks")
    if config.kind not in RUNNERS:
        raise ValueError(f"configuration {config.name}: unknown kind {config.kind!r}: expected one of {', '.join(RUNNERS)}")
    if config.max_new_tokens < 1:
        raise ValueError(f"configuration {config.name}: max_new_tokens must be >= 1")
    config.params  # validates temperature, top-p, top-k
    return config


def default_name(values: dict) -> str:
    """`<drafter>-k<K>` (or `<kind>-k<K>`), with `-t<temperature>` when sampling."""
    kind = values.get("kind", "engine")
    label = Path(values.get("drafter", "none")).name if kind == "engine" else kind
    return f"{label}-k{values['k']}" + (f"-t{values['temperature']:g}" if values["temperature"] else "")


def with_baselines(defaults: dict, configs: Sequence[Config], transformers: bool = True,
                   llamacpp: bool = False) -> list[Config]:
    """Plain decoding first, the configurations, then transformers generate, prompt lookup and,
    for each draft model among the configurations, assisted generation with it; with `llamacpp`,
    then llama.cpp's plain decoding, its prompt lookup and, for each draft GGUF file among the
    configurations, its speculative decoding with it."""
    reference = make_config({**defaults, "name": REFERENCE, "drafter": "none", "k": "0"})
    extra = []
    if llamacpp:
        k = fixed_k(defaults["k"])
        extra += [make_config({**defaults, "name": "llamacpp-plain", "kind": "llamacpp-plain", "k": "0"}),
                  make_config({**defaults, "name": f"llamacpp-lookup-k{k}", "kind": "llamacpp-lookup", "k": k}),
                  make_config({**defaults, "name": f"llamacpp-lookup-invariant-k{k}", "kind": "llamacpp-lookup-invariant",
                               "k": k})]
        drafts = {c.drafter: c for c in configs
                  if c.kind == "engine" and is_draft_model(c.drafter) and c.drafter.endswith(".gguf")}
        extra += [replace(c, name=f"llamacpp-speculative-{Path(path).name}-k{fixed_k(c.k)}", kind="llamacpp-speculative",
                          k=fixed_k(c.k)) for path, c in drafts.items()]
    if transformers:
        k = fixed_k(defaults["k"])
        extra += [make_config({**defaults, "name": "hf-generate", "kind": "hf-generate"}),
                  make_config({**defaults, "name": "hf-lookup", "kind": "hf-lookup", "k": k})]
        drafts = {c.drafter: c for c in configs if c.kind == "engine" and is_draft_model(c.drafter)}
        extra += [replace(c, name=f"hf-assisted-{Path(path).name}-k{fixed_k(c.k)}", kind="hf-assisted", k=fixed_k(c.k))
                  for path, c in drafts.items()]
    out = [reference, *configs, *extra]
    names = [c.name for c in out]
    if len(set(names)) < len(names):
        raise ValueError(f"configuration names must be unique, got {names}")
    return out


def fixed_k(k: str) -> str:
    """K for a transformers baseline: the configuration's K where it is an integer, else the built-in default."""
    return k if k.isdigit() else DEFAULTS["k"]


def is_draft_model(drafter: str) -> bool:
    return drafter not in REGISTRY and Path(drafter).expanduser().exists()


def engine_runner(config: Config, setup: Setup) -> Runner:
    """The engine with the configuration's drafter ("self": the target again, on the same backend)."""
    if config.drafter == SELF_DRAFTER:
        drafter = DraftModelDrafter(make_target(setup.model, setup.backend, threads=setup.threads))
    else:
        drafter = make_drafter(config.drafter, setup.model, setup.target, backend=setup.backend,
                               trust_remote_code=setup.trust_remote_code, threads=setup.threads)
    sampler = SpecSampler(setup.model, setup.target, drafter, given(config.drafter, config.k), backend=setup.backend,
                          threads=setup.threads)
    return EngineRunner(sampler, config)


class EngineRunner:
    """A SpecSampler (sharing the target with the other configurations) with a configuration's settings."""

    def __init__(self, sampler: SpecSampler, config: Config) -> None:
        self.sampler = sampler
        self.config = config
        # The policy `generate` runs (each step's K is in Stats.chosen_k), told the cost curve now: measured
        # inside the first timed answer, it would be timed as that answer's decoding (with `--warmup 0`).
        self.policy = sampler.informed(parse_k(config.k))

    def run(self, messages: Sequence[Message]) -> Output:
        c = self.config
        start = perf_counter()
        out = self.sampler.generate(
            messages, max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
            top_k=c.top_k, k=self.policy, seed=c.seed,
        )
        return Output(out.token_ids, out.text, out.stats.prompt_tokens, perf_counter() - start, out.stats)


def hf_k(config: Config) -> int:
    try:
        return int(config.k)
    except ValueError:
        raise ValueError(f"configuration {config.name}: transformers needs an integer k, got {config.k!r}") from None


def llamacpp_runner(config: Config, setup: Setup) -> Runner:
    """A llama.cpp baseline on the target's GGUF file, with the target's threads and context window."""
    if setup.model.gguf is None:
        raise llamacpp.Unavailable(f"the llama.cpp baselines run GGUF files, and {setup.model.name} is not one")
    from specsample.models.choice import llamacpp_installed

    if not llamacpp_installed():  # the engine's configurations still run
        raise llamacpp.Unavailable("the llama.cpp baselines need llama-cpp-python, which is not installed")
    threads = getattr(setup.target, "n_threads", None) or setup.threads or default_threads()
    common = dict(model=setup.model, path=setup.model.gguf, threads=threads, n_ctx=setup.target.max_length,
                  params=config.params, max_new_tokens=config.max_new_tokens, seed=config.seed)
    if config.kind == "llamacpp-plain":
        return llamacpp.LlamaCppPlainRunner(**common)
    if config.kind in ("llamacpp-lookup", "llamacpp-lookup-invariant"):
        return llamacpp.LlamaCppToolRunner(tool=llamacpp.LOOKUP_TOOL, k=hf_k(config),
                                           invariant=config.kind == "llamacpp-lookup-invariant", **common)
    draft = Path(config.drafter).expanduser()
    if draft.suffix != ".gguf" or not draft.is_file():
        raise llamacpp.Unavailable(f"configuration {config.name}: llama.cpp's speculative decoding needs a draft "
                                   f"GGUF file as its drafter, got {config.drafter!r}")
    return llamacpp.LlamaCppToolRunner(tool=llamacpp.SPECULATIVE_TOOL, k=hf_k(config), draft=draft, **common)


RunnerFactory = Callable[[Config, Setup], Runner]

RUNNERS: dict[str, RunnerFactory] = {
    "engine": engine_runner,
    "hf-generate": lambda c, setup: baselines.generate_runner(setup.model, c.params, c.max_new_tokens),
    "hf-lookup": lambda c, setup: baselines.prompt_lookup_runner(setup.model, c.params, c.max_new_tokens, hf_k(c)),
    "hf-assisted": lambda c, setup: baselines.assisted_runner(
        setup.model, c.params, c.max_new_tokens, hf_k(c), load_model(c.drafter, trust_remote_code=setup.trust_remote_code)),
    **{kind: llamacpp_runner for kind in llamacpp.KINDS},
}


def converse(runner: Runner, prompt: Prompt, templated: bool = True) -> list[Output]:
    """Answer each turn after the earlier turns and the runner's own earlier answers. A model without a
    chat template (`templated` False) cannot be given the roles: it reads the conversation so far as
    one user message, the turns' and answers' texts on lines of their own."""
    messages: list[Message] = []
    outputs = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        out = runner.run(messages if templated else [{"role": "user", "content": "\n".join(m["content"] for m in messages)}])
        messages.append({"role": "assistant", "content": out.text})
        outputs.append(out)
    return outputs


def run(
    model: LoadedModel,
    target: Target,
    configs: Sequence[Config],
    prompts: Sequence[Prompt],
    *,
    warmup: int = 1,
    progress: bool = True,
    trust_remote_code: bool = False,
    backend: str = "auto",
    threads: int | None = None,
    unavailable: dict[str, str] | None = None,
) -> list[Record]:
    """Run every configuration on every prompt, interleaved; the first configuration is the reference.
    `backend` names `target`'s backend, for drafters that need a second target of the same kind;
    `threads`, a llamacpp target's threads. A configuration that cannot run here (`Unavailable`, or a
    drafter the backend cannot serve: `NotOnThisBackend`) gets no records, and its reason goes to
    `unavailable` (by name)."""
    setup = Setup(model, target, backend, trust_remote_code, threads)
    runners = {}
    for c in configs:
        try:
            runners[c.name] = RUNNERS[c.kind](c, setup)
        except (llamacpp.Unavailable, NotOnThisBackend) as e:
            if c is configs[0]:
                raise
            if unavailable is not None:
                unavailable[c.name] = str(e)
    configs = [c for c in configs if c.name in runners]
    for _ in range(warmup):
        for c in configs:
            runners[c.name].run([{"role": "user", "content": WARMUP_PROMPT}])
    records, tokens, raws = [], {}, {}
    bar = tqdm(total=len(prompts) * len(configs), desc="bench", unit="run", disable=not progress)
    for i, prompt in enumerate(prompts):
        for c in rotated(configs, i):
            bar.set_postfix_str(f"{prompt.category} {c.name}", refresh=False)
            for turn, out in enumerate(converse(runners[c.name], prompt, bool(model.tokenizer.chat_template))):
                stats = out.stats.to_dict() if out.stats is not None else None
                records.append(Record(c.name, prompt.question_id, prompt.category, turn, out.prompt_tokens,
                                      out.timed_tokens, out.wall_seconds, stats))
                tokens[c.name, prompt.question_id, turn] = out.token_ids
                raws[c.name, prompt.question_id, turn] = out.raw
            bar.update(1)
    bar.close()
    same_text = {name: runner.same_text for name, runner in runners.items() if hasattr(runner, "same_text")}
    mark_mismatches(records, tokens, {c.name: c for c in configs}, configs[0], raws, same_text)
    return records


def rotated(items: Sequence, shift: int) -> list:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def mark_mismatches(records: list[Record], tokens: dict, configs: dict[str, Config], reference: Config,
                    raws: dict | None = None, same_text: dict | None = None) -> None:
    """Compare each answer with the reference's, at its max_new_tokens: at temperature 0, and for the
    engine's configurations sampled with the reference's options and seed (coupled sampling gives plain
    decoding's tokens whatever the drafter and K); its tokens, or for a baseline that printed text only
    (`same_text` by configuration, `raws` its printed bytes), that text with the text of the reference's tokens."""
    for r in records:
        c = configs[r.config]
        seeded = c.kind == reference.kind == "engine" and (c.params, c.seed) == (reference.params, reference.seed)
        if not (c.max_new_tokens == reference.max_new_tokens and (c.temperature == reference.temperature == 0 or seeded)):
            continue
        ours, theirs = tokens[r.config, r.question_id, r.turn], tokens[reference.name, r.question_id, r.turn]
        r.matches_plain = ours == theirs
        raw = (raws or {}).get((r.config, r.question_id, r.turn))
        if not r.matches_plain and raw is not None and r.config in (same_text or {}):
            r.matches_plain = same_text[r.config](theirs, raw, c.max_new_tokens)
        if not r.matches_plain:
            r.mismatch_at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def config_dicts(configs: Sequence[Config]) -> list[dict]:
    return [asdict(c) for c in configs]


def record_dicts(records: Sequence[Record]) -> list[dict]:
    return [asdict(r) for r in records]
