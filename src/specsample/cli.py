"""The `specsample` command line: generate, and the subcommands of later issues.

Every error a user can cause ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from typer.exceptions import Abort, Exit, TyperException

from specsample.openmp import use_threads

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None)

DRAFTER_HELP = (
    "none (plain decoding), ngram, ngram-cache (llama.cpp's n-gram cache rule), suffix, layerskip, quantized, head, head:DIR, recycle, the path of a draft model "
    "(with another tokenizer than the target's too: text:PATH or intersection:PATH pick how its drafts are verified), "
    "or A+B: A's draft where it finds one, else B's (suffix+quantized). Tree drafts: suffix-tree, ngram-tree, "
    "quantized-tree, head-tree, draft-tree:PATH (recycle drafts trees; recycle-chain a chain). Default: the best measured "
    "configuration for the backend on this machine (suffix+quantized with --k auto on the fast backend "
    "with AVX-512 or AVX2 kernels; plain decoding on portable kernels; suffix with --k auto elsewhere)."
)
K_HELP = "Speculation length K, or 'auto' (cost model) or 'auto:heuristic'. Default: auto with the default drafter, else 4."
BACKEND_HELP = ("auto (for a GGUF file, the one measured fastest here), gguf (the project's kernels on the file's own "
                "blocks), fast, transformers or llamacpp (GGUF files on llama.cpp).")
THREADS_HELP = "CPU threads of a forward pass, on every backend (default: all cores, or OMP_NUM_THREADS where it asks for fewer)."


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on our output."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; read from stdin when absent.")] = None,
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2-135M-Instruct).")] = None,
    drafter: Annotated[Optional[str], typer.Option(help=DRAFTER_HELP)] = None,
    k: Annotated[Optional[str], typer.Option("--k", help=K_HELP)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")] = 0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p times the top probability.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed: the text plain decoding gives with it, whatever the drafter and K (same backend).")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Apply the model's chat template.")] = True,
    stream: Annotated[bool, typer.Option(help="Print text as it is generated.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text, token_ids and stats.")] = False,
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "auto",
    threads: Annotated[Optional[int], typer.Option(help=THREADS_HELP)] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model's own Python code.")] = False,
) -> None:
    """Generate a completion with speculative sampling."""
    use_threads(threads)  # before torch loads
    from specsample.api import SpecSampler
    from specsample.gcfreeze import freeze_loaded
    from specsample.engine import check_max_new_tokens
    from specsample.policy import parse_k
    from specsample.sampling import SamplingParams
    from specsample.text import stop_strings

    SamplingParams(temperature, top_k, top_p, min_p)  # validate before the slow load
    stop_strings(stop or ())
    policy = None if k is None else parse_k(k)
    check_max_new_tokens(max_new_tokens)
    text = prompt if prompt is not None else read_stdin()
    if not text:
        raise ValueError("the prompt is empty")
    quiet_transformers()
    sampler = SpecSampler.load(model, drafter, backend=backend, trust_remote_code=trust_remote_code, threads=threads)
    freeze_loaded()
    generation = sampler.stream(
        text, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, k=policy, seed=seed, stop=stop or (), chat=chat,
    )
    for chunk in generation:
        if stream and as_json:
            print(json.dumps({"text": chunk.text, "token_ids": chunk.token_ids}), flush=True)
        elif stream:
            print(chunk.text, end="", flush=True)
    out = generation.result()
    if as_json:
        configuration = sampler.configuration
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "model": sampler.model.name, "drafter": configuration.drafter,
                          "k": configuration.k if k is None else k, "drafter_reason": configuration.reason,
                          "backend": sampler.backend, "backend_reason": sampler.backend_reason,
                          "stats": out.stats.to_dict()}))
        return
    print("" if stream else out.text)
    s = out.stats
    print(f"[drafter {s.drafter}, {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tokens/s, "
          f"{s.drafted_tokens} drafted, acceptance rate {s.acceptance_rate:.2f}, "
          f"mean accepted length {s.mean_accepted_length:.2f}, prefill {s.prefill_seconds:.2f} s, "
          f"load {s.load_seconds:.2f} s]", file=sys.stderr)


@app.command()
def serve(
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2-135M-Instruct).")] = None,
    drafter: Annotated[Optional[str], typer.Option(help=DRAFTER_HELP)] = None,
    k: Annotated[Optional[str], typer.Option("--k", help=K_HELP)] = None,
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "auto",
    threads: Annotated[Optional[int], typer.Option(help=THREADS_HELP)] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model's own Python code.")] = False,
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 exposes the server to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="SPECSAMPLE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 routes.")] = None,
    max_queue: Annotated[int, typer.Option(help="Most requests admitted at once (running or waiting); more get 503. With --replicas: per replica.")] = 16,
    max_batch: Annotated[int, typer.Option(help="Most requests decoded together, one target pass per step (continuous batching; backends fast, gguf and llamacpp, drafters that fork: none, ngram, suffix, recycle, their tree forms and A+B of them); 1: one at a time.")] = 1,
    replicas: Annotated[Optional[int], typer.Option(help="Run N engine replicas on a Ray cluster behind this endpoint (Ray Serve: pip install 'specsample[ray]').")] = None,
    min_replicas: Annotated[Optional[int], typer.Option(help="Autoscale the replicas on queue depth, from this many ...")] = None,
    max_replicas: Annotated[Optional[int], typer.Option(help="... to this many (Ray Serve's autoscaling_config).")] = None,
    target_queue: Annotated[Optional[float], typer.Option(help="With autoscaling: requests per replica (running or waiting) to aim at (default 2).")] = None,
    upscale_delay: Annotated[Optional[float], typer.Option(help="With autoscaling: seconds above the target before a replica is added (Ray Serve's upscale_delay_s, default 30).")] = None,
    downscale_delay: Annotated[Optional[float], typer.Option(help="With autoscaling: seconds below the target before a replica is removed (downscale_delay_s, default 600).")] = None,
    look_back: Annotated[Optional[float], typer.Option(help="With autoscaling: seconds over which the queue depth is averaged (look_back_period_s, default 30).")] = None,
    prefix_affinity: Annotated[bool, typer.Option(help="With replicas: send a request to the replica that saw the longest prefix of its prompt, when queues are within one request (Ray Serve's PrefixCacheAffinityRouter).")] = False,
    ray_address: Annotated[Optional[str], typer.Option(help="With replicas: the Ray cluster (host:port; 'auto': the one `ray start` made here; 'local': a new one here, no dashboard). Default: RAY_ADDRESS, else auto, else a new one.")] = None,
) -> None:
    """Serve an OpenAI-compatible API (chat and text completions, streaming, /metrics)."""
    from specsample.server.app import check_api_key

    check_listen(host, port)
    if api_key is not None:
        check_api_key(api_key)
    if replicas is not None or min_replicas is not None or max_replicas is not None:
        return serve_replicas(locals())
    given = [name for name, value in (("--target-queue", target_queue), ("--upscale-delay", upscale_delay),
                                      ("--downscale-delay", downscale_delay),
                                      ("--look-back", look_back), ("--prefix-affinity", prefix_affinity or None))
             if value is not None]
    if given:
        raise ValueError(f"{given[0]} needs --replicas N or --min-replicas and --max-replicas")
    use_threads(threads)  # before torch loads
    import uvicorn

    from specsample.policy import parse_k
    from specsample.server import create_app
    from specsample.server.app import serving_sampler

    policy = None if k is None else parse_k(k)
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    quiet_transformers()
    sampler = serving_sampler(model, drafter, backend=backend, trust_remote_code=trust_remote_code, threads=threads)
    app = create_app(sampler, k=policy if max_batch == 1 else k, max_queue=max_queue, api_key=api_key, max_batch=max_batch)
    uvicorn.run(app, host=host, port=port)


def check_listen(host: str, port: int) -> None:
    """A one-line error, before any model loads, for a port out of range or an address this process cannot
    listen on (one another server holds, a host that does not resolve); uvicorn would find out only after
    the load, and log it over several lines."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    try:  # socket.gaierror (a host that does not resolve) is an OSError too
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def serve_replicas(args: dict) -> None:
    """`serve` with --replicas or --min/--max-replicas: engine replicas on Ray Serve (`server.ray_app`)."""
    from importlib.util import find_spec

    from pydantic import ValidationError

    if find_spec("ray") is None or find_spec("ray.serve") is None:
        raise ValueError("--replicas needs Ray Serve, which is not installed: pip install 'specsample[ray]'")
    from specsample.server.app import describe
    from specsample.server.ray_app import AUTOSCALING, RayOptions, run

    given = {key: args[key] for key in ("model", "drafter", "k", "backend", "threads", "trust_remote_code", "replicas",
                                        "max_queue", "max_batch", "api_key", "prefix_affinity", *AUTOSCALING)}
    try:
        options = RayOptions(**{key: value for key, value in given.items() if value is not None})
    except ValidationError as error:
        message, param = describe(error.errors()[0])
        raise ValueError(f"--{param.replace('_', '-')}{message[len(param):]}" if param else message) from None
    quiet_transformers()
    run(options, host=args["host"], port=args["port"], address=args["ray_address"])


@app.command("train-draft")
def train_draft(
    out: Annotated[str, typer.Option(help="Directory for the head (head.safetensors, head.json), data shards and checkpoints.")],
    prompts: Annotated[Optional[list[str]], typer.Option(help="Prompts file: .jsonl (prompt or turns) or text, one a line (repeatable).")] = None,
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2-135M-Instruct).")] = None,
    question_ids: Annotated[str, typer.Option(help="Keep only jsonl rows with even or odd question_id (all: keep every row).")] = "all",
    steps: Annotated[int, typer.Option(help="Training steps.")] = 2000,
    batch_size: Annotated[int, typer.Option(help="Training windows per step.")] = 16,
    seq_len: Annotated[int, typer.Option(help="Positions per training window.")] = 256,
    generate_batch: Annotated[int, typer.Option(help="Prompts per batched generate call.")] = 16,
    sampled_answers: Annotated[int, typer.Option(help="Extra answers per prompt sampled at temperature 1 (more data).")] = 0,
    self_prompts: Annotated[int, typer.Option(help="Prompts the target writes itself from its chat template (Magpie), added to --prompts.")] = 0,
    extra_data: Annotated[Optional[list[str]], typer.Option(help="The OUT directory of an earlier run: train on its data shards too, or only on them (repeatable).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer the target generates per prompt.")] = 160,
    data_minutes: Annotated[float, typer.Option(help="Stop generating data after this many minutes and train on it (0: no limit).")] = 0.0,
    vocab_subset: Annotated[int, typer.Option(help="Tokens the head can propose, most frequent first (0: all).")] = 8192,
    layers: Annotated[int, typer.Option(help="Decoder blocks in the head.")] = 1,
    unroll: Annotated[int, typer.Option(help="Training passes on the head's own predicted features.")] = 2,
    feature_layers: Annotated[str, typer.Option(help="Comma-separated decoder layers (1-based) whose outputs the head reads besides the final state, e.g. 2,15,27 (EAGLE-3); empty: the final state only.")] = "",
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 1e-3,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out evaluations and checkpoints.")] = 200,
    holdout: Annotated[float, typer.Option(help="Share of prompts held out for the held-out figures, each by its own hash (0: none).")] = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the split, the windows, the sampled text and the initialisation.")] = 0,
    backend: Annotated[str, typer.Option(help="Backend that writes the prompts and answers, batched where it can: auto (float32: the C++ kernels "
                                          "where they run the model, else transformers), fast, transformers, gguf (a GGUF file's own blocks: twice as "
                                          "fast again on the bundled model, but greedy text that departs from float32's) or llamacpp.")] = "auto",
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model's own Python code.")] = False,
) -> None:
    """Train a draft head for a target by self-distillation on the CPU (resumes from OUT's checkpoint)."""
    from functools import partial
    from pathlib import Path

    from specsample.models import backend_of, check_backend, check_backend_runs, load_model, make_target
    from specsample.outputs import check_output_dir
    from specsample.prompts import SPLITS, read_prompts
    from specsample.training import TrainOptions, data_shards, train
    from specsample.training.generate import Writer

    options = TrainOptions(
        generate_batch=generate_batch, sampled_answers=sampled_answers, self_prompts=self_prompts, batch_size=batch_size,
        max_new_tokens=max_new_tokens, data_minutes=data_minutes, vocab_subset=vocab_subset, layers=layers,
        steps=steps, seq_len=seq_len, lr=lr, unroll=unroll, eval_every=eval_every, holdout=holdout, seed=seed,
        feature_layers=layer_numbers(feature_layers),
    )
    if not prompts and not self_prompts and not extra_data:
        raise ValueError("give --prompts, --self-prompts, --extra-data or several of them")
    if question_ids not in SPLITS:
        raise ValueError(f"--question-ids must be one of {', '.join(SPLITS)}, got {question_ids!r}")
    out_dir = check_output_dir(out, "--out")
    texts = [p.turns[0] for p in read_prompts(*prompts, split=question_ids)] if prompts else []
    extra = [shard for d in extra_data or () for shard in data_shards(Path(d))]
    quiet_transformers()
    check_backend(backend)
    loaded = load_model(model, trust_remote_code=trust_remote_code)
    check_backend_runs(backend, loaded)
    writer = Writer(loaded, partial(make_target, loaded, backend), options.generate_batch, backend_of(loaded, backend))
    report = train(loaded, texts, out_dir, options, log=lambda line: print(line, file=sys.stderr), extra_shards=extra,
                   writer=writer)
    print(json.dumps({k: v for k, v in report.items() if k != "history"}))


def layer_numbers(text: str) -> tuple[int, ...]:
    """`--feature-layers` "2,15,27" as (2, 15, 27); "" as ()."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--feature-layers must be comma-separated layer numbers such as 2,15,27, got {text!r}") from None


@app.command()
def check(
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2-135M-Instruct).")] = None,
    drafter: Annotated[Optional[str], typer.Option(help=DRAFTER_HELP)] = None,
    k: Annotated[Optional[str], typer.Option("--k", help=K_HELP)] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 is greedy).")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")] = 0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p times the top probability.")] = 0.0,
    samples: Annotated[int, typer.Option(help="Token pairs sampled per context (300 missed a recovery drawn from the target instead of the residual; 1,000 caught it).")] = 2000,
    context: Annotated[Optional[list[str]], typer.Option(help="A chat prompt to test after (repeatable; default: three built in).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the sampling; with --identity, the first seed.")] = 0,
    identity: Annotated[bool, typer.Option(help="Check the seed promise instead: over --seeds seeds per context, the configuration's text must be identical to plain decoding's with the same seed.")] = False,
    seeds: Annotated[int, typer.Option(help="With --identity: seeds per context (--seed, --seed + 1, ...).")] = 20,
    max_new_tokens: Annotated[int, typer.Option(help="With --identity: tokens generated per seed.")] = 32,
    broken: Annotated[bool, typer.Option(help="Self-test: the same check with a sampler that always accepts; it must reject.")] = False,
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "auto",
    threads: Annotated[Optional[int], typer.Option(help=THREADS_HELP)] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model's own Python code.")] = False,
) -> None:
    """Certify statistically that a configuration preserves the target distribution (chi-square tests), or
    with --identity that a seed gives it the text plain decoding gives."""
    use_threads(threads)  # before torch loads
    from specsample.engine import check_max_new_tokens
    from specsample.policy import parse_k
    from specsample.sampling import SamplingParams, check_seed
    from specsample.verify import ChainVerifier
    from specsample.verify import check as certificate

    params = SamplingParams(temperature, top_k, top_p, min_p)
    policy = None if k is None else parse_k(k)  # validated before the slow load
    if identity and seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    check_seed(seed)
    if identity:
        check_seed(seed + seeds - 1, "the last seed, --seed + --seeds - 1,")
    check_max_new_tokens(max_new_tokens)
    if any(not text for text in context or ()):
        raise ValueError("a --context is empty: give the text the checked tokens follow")
    if broken and drafter == "none":
        raise ValueError("--broken needs a drafter: with none, the broken sampler never runs")
    quiet_transformers()
    sampler = certificate.load_sampler(model, drafter, backend=backend, trust_remote_code=trust_remote_code,
                                       threads=threads)
    policy = policy or parse_k(sampler.configuration.k)
    verifier = certificate.BROKEN if broken else ChainVerifier()
    contexts = context or certificate.CONTEXTS
    if identity:
        result = certificate.check_identity(sampler, policy, params, contexts=contexts, seeds=range(seed, seed + seeds),
                                            max_new_tokens=max_new_tokens, progress=True, verifier=verifier)
        report = certificate.render_identity(result, broken)
    else:
        result = certificate.certify(sampler, policy, params, contexts=contexts, samples=samples, seed=seed,
                                     progress=True, verifier=verifier)
        report = certificate.render(result, broken)
    if broken and not result.stats.drafted_tokens:
        raise ValueError("--broken needs a configuration that drafts: the drafter proposed no tokens here, so the "
                         "broken sampler never ran")
    print(f"backend {sampler.backend} ({sampler.backend_reason}); drafter {sampler.configuration.drafter} "
          f"({sampler.configuration.reason}), K {k or sampler.configuration.k}")
    print(report)
    if result.rejected != broken:
        raise Exit(1)


def read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no prompt: pass it as an argument or on stdin")
    return sys.stdin.read().removesuffix("\n")  # the newline `echo` ends it with is not part of the prompt


def mount_subcommands() -> None:
    from specsample.bench.cli import app as bench_app

    app.add_typer(bench_app, name="bench", help="Benchmarks: cost curve, decoding speed, Spec-Bench runs.")


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and turns every user error into one line and exit code 2, and Ctrl-C at any
    point (torch still loading included) into exit code 130 without a traceback."""
    args = sys.argv[1:] if argv is None else argv
    try:
        mount_subcommands()
        code = app(args=args or ["--help"], standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exit as done:
        sys.exit(done.exit_code)
    except Abort:
        sys.exit(130)
    except TyperException as e:  # usage errors: unknown option, a value of the wrong type
        fail(e.format_message() if hasattr(e, "format_message") else str(e))
    except (ValueError, OSError) as e:
        fail(str(e))
    if isinstance(code, int) and code:  # outside standalone mode typer returns an Exit's code (130: Ctrl-C)
        sys.exit(code)


def fail(message: str) -> None:
    print(f"specsample: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
