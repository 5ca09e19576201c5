"""`specsample bench`: benchmark commands (a thin layer over the bench modules)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specsample.openmp import use_threads
from specsample.outputs import check_output_dir, check_output_file, write_text
from specsample.prompts import TUNED_PER_CATEGORY, Prompt, categories_of, packaged_prompts, read_prompts

app = typer.Typer(help="Benchmarks: cost curve, decoding speed.", add_completion=False, rich_markup_mode=None)


@app.callback(invoke_without_command=True)
def bench(ctx: typer.Context) -> None:
    """Without a command, the help, as `specsample` alone prints its own (typer's no_args_is_help raises a
    usage error, which the entry point would print as one line)."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()

PROMPTS_HELP = "Spec-Bench JSONL file (question_id, category, turns); default: the Spec-Bench prompts in the package."
SPLIT_HELP = "all, or only the odd or even question_ids (held-out halves: the shipped head trained on the even ones)."


SKIP_HELP = (f"Skip the first N prompts of each category (before --split); --split odd --skip {TUNED_PER_CATEGORY} "
             "leaves only prompts nothing was tuned on.")


def read_bench_prompts(path: Optional[Path], split: str, limit: Optional[int] = None,
                       categories: Optional[list[str]] = None, skip: int = 0) -> list[Prompt]:
    """The Spec-Bench prompts of `path` (default: the packaged ones) past the first `skip` of each category,
    in `split`, at most `limit` per category."""
    return read_prompts(path or packaged_prompts(), split=split, categories=categories or (), limit=limit,
                        spec_bench=True, skip=skip)


def _setup(threads: int | None) -> None:
    """Quiet transformers; set the number of CPU threads if asked."""
    from specsample.cli import quiet_transformers

    use_threads(threads)
    quiet_transformers()


@app.command("cost-curve")
def cost_curve(
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2).")] = None,
    context_length: Annotated[int, typer.Option(help="Cached tokens each forward pass attends over.")] = 200,
    max_n: Annotated[int, typer.Option(help="Largest number of new tokens per pass.")] = 16,
    repeats: Annotated[int, typer.Option(help="Repetitions; each f(n) is their median.")] = 7,
    backends: Annotated[str, typer.Option(help="Comma-separated Target backends: fast, transformers, llamacpp, gguf, or auto "
                                          "(the one `generate --backend auto` runs, named in its column).")] = "fast,transformers",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads of every backend (default: one per core).")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """f(n)/f(1): the cost of one forward pass over n new tokens, for n = 1..max_n (llamacpp: the GGUF
    file at its own quantization on llama.cpp; gguf: on its own blocks; the other backends: its float32 weights)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from specsample.bench import cost_curve as cc
    from specsample.cost_curve import measure
    from specsample.gcfreeze import freeze_loaded
    from specsample.models import check_backend, load_model

    names = [b.strip() for b in backends.split(",") if b.strip()]
    if len(set(names)) != len(names):
        raise ValueError(f"--backends names a backend twice: {backends!r}")
    json_file = None if json_path is None else check_output_file(json_path, "--json")
    if max_n < 1 or context_length < 1 or repeats < 1 or not names:
        raise ValueError("--max-n, --context-length and --repeats must be positive, --backends non-empty")
    for name in names:
        check_backend(name)
    _setup(threads)
    backends_of = cc.resolved(model, names, threads)  # column label -> backend
    # llama.cpp runs the file itself: without another backend, only the tokenizer is loaded
    loaded = load_model(model, tokenizer_only=set(backends_of.values()) <= {"llamacpp", "gguf"})
    text = "\n".join(p.turns[0] for p in read_bench_prompts(None, "all"))
    ids = cc.context_tokens(loaded.tokenizer, text, context_length + max_n)
    targets = cc.targets(loaded, backends_of, threads)
    window = min(target.max_length for target in targets.values())
    if context_length + max_n > window:  # refused before any prefill
        raise ValueError(f"--context-length {context_length} + --max-n {max_n} exceeds the context window of {window} tokens")
    freeze_loaded()  # no full collection of the loaded objects inside a timed pass
    curves = measure(targets, ids[:context_length], ids[context_length:], range(1, max_n + 1), repeats)
    table = Table(title=f"f(n): one forward pass over n new tokens after {context_length} cached ({loaded.name})",
                  caption="\n".join(cc.describe(targets)))
    table.add_column("n", justify="right")
    for curve in curves:
        table.add_column(f"{curve.backend} ms", justify="right")
        table.add_column(f"{curve.backend} f(n)/f(1)", justify="right")
    for i, n in enumerate(curves[0].ns):
        table.add_row(str(n), *[cell for c in curves for cell in (f"{c.ms[i]:.1f}", f"{c.ratios[i]:.2f}")])
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    if json_file is not None:
        write_text(json_file, json.dumps({"model": loaded.name, "threads": threads, "backends": cc.describe(targets),
                                          "curves": [c.to_dict() for c in curves]}, indent=2))


@app.command("decode")
def decode(
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2).")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help=PROMPTS_HELP)] = None,
    split: Annotated[str, typer.Option(help=SPLIT_HELP)] = "all",
    limit: Annotated[int, typer.Option(help="Number of prompts (the first of the file, first turns only).")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate per prompt.")] = 128,
    drafter: Annotated[Optional[list[str]], typer.Option(
        help="Also run speculative decoding with this drafter (repeatable): a drafter name, a draft model "
        "path, or 'self' for the target as its own draft model.")] = None,
    k: Annotated[int, typer.Option("--k", help="Speculation length for --drafter runs.")] = 4,
    backend: Annotated[str, typer.Option(help="Target backend of the engine: auto (as `generate` picks it), fast, "
                                         "gguf, transformers or llamacpp (then llama.cpp's own plain decoding runs "
                                         "too).")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: one per core); llamacpp: "
                                                   "threads per pass, of the engine and of llama.cpp's decoding.")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """Greedy decoding tokens/s: our engine against transformers generate (and on the llamacpp backend,
    llama.cpp's own plain decoding), on the same prompts."""
    from rich.console import Console
    from rich.table import Table

    from specsample.bench import decode as bench_decode
    from specsample.drafters import check_spec
    from specsample.models import load_model, make_target
    from specsample.models.choice import resolve

    if limit < 1 or max_new_tokens < 1 or k < 1:
        raise ValueError("--limit, --max-new-tokens and --k must be positive")
    json_file = None if json_path is None else check_output_file(json_path, "--json")
    for spec in drafter or ():
        if spec != "self":
            check_spec(spec)
    items = read_bench_prompts(prompts, split)[:limit]
    _setup(threads)
    backend, backend_reason = resolve(model, backend, threads=threads)
    loaded = load_model(model)
    unavailable: dict[str, str] = {}
    records = bench_decode.run(loaded, make_target(loaded, backend, threads=threads), items, drafter or (), k,
                               max_new_tokens, backend, threads=threads, unavailable=unavailable)
    summaries = bench_decode.summarize(records)
    table = Table(title=f"Greedy decoding, {len(items)} prompts, up to {max_new_tokens} new tokens, backend {backend}")
    table.add_column("system", no_wrap=True)
    for column in ("tokens", "tok/s", "median tok/s", "decode tok/s", "speedup", "same tokens"):
        table.add_column(column, justify="right")
    for s in summaries:
        decode_rate = "" if s.decode_tokens_per_second is None else f"{s.decode_tokens_per_second:.1f}"
        table.add_row(s.system, str(s.tokens), f"{s.tokens_per_second:.1f}", f"{s.median_tokens_per_second:.1f}",
                      decode_rate, f"{s.speedup_vs_transformers:.2f}x", f"{s.matches_transformers}/{s.prompts}")
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    print(f"backend {backend}: {backend_reason}")
    for name, reason in unavailable.items():
        print(f"{name}: not available: {reason}")
    if json_file is not None:
        bench_decode.save(json_file, summaries, records)


@app.command("batch")
def batch(
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2).")] = None,
    drafter: Annotated[str, typer.Option(help="Drafter of every run.")] = "suffix",
    backend: Annotated[str, typer.Option(help="Target backend; batching needs slots: fast, gguf or llamacpp (auto: as `load`).")] = "gguf",
    k: Annotated[str, typer.Option("--k", help="Comma-separated K specs, each run alone and batched: auto, 0, 3...")] = "auto,0",
    max_batch: Annotated[int, typer.Option(help="Requests decoded together at most.")] = 8,
    prompts: Annotated[Optional[Path], typer.Option(help=PROMPTS_HELP)] = None,
    split: Annotated[str, typer.Option(help=SPLIT_HELP)] = "odd",
    skip: Annotated[int, typer.Option(help=SKIP_HELP)] = TUNED_PER_CATEGORY,
    limit: Annotated[int, typer.Option(help="Prompts per round (first turns, in file order, each round the next ones).")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate per prompt.")] = 48,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of every run, each K spec and round on prompts of its own.")] = 2,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: one per core).")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """Batched decoding in one process: generate_batch against the same prompts one at a time, aggregate
    tokens/s, and per batched step the rows, the target pass and everything else (greedy)."""
    from rich.console import Console
    from rich.table import Table

    from specsample.api import SpecSampler
    from specsample.bench import batch as bench_batch
    from specsample.gcfreeze import freeze_loaded
    from specsample.policy import parse_batch_k

    if limit < 1 or max_new_tokens < 1 or max_batch < 1 or rounds < 1:
        raise ValueError("--limit, --max-new-tokens, --max-batch and --rounds must be positive")
    ks = [spec.strip() for spec in k.split(",") if spec.strip()]
    if not ks or len(set(ks)) != len(ks):
        raise ValueError(f"--k needs one or more distinct K specs, comma-separated, got {k!r}")
    for spec in ks:
        parse_batch_k(spec)  # a bad spec refused before the models load
    json_file = None if json_path is None else check_output_file(json_path, "--json")
    if backend == "transformers":
        raise ValueError("bench batch decodes on a backend's slots: fast, gguf or llamacpp (auto picks one); "
                         "transformers has none")
    items = [p.turns[0] for p in read_bench_prompts(prompts, split, skip=skip)]
    if len(items) < limit * rounds * len(ks) + 2:
        raise ValueError(f"{len(items)} prompts: --limit {limit} x --rounds {rounds} x {len(ks)} K specs and 2 to "
                         f"warm up need more")
    _setup(threads)
    one, many = (SpecSampler.load(model, drafter, backend=backend, threads=threads) for _ in range(2))
    freeze_loaded()
    n = len(ks)
    sets = [[items[(r * n + i) * limit : (r * n + i + 1) * limit] for i in range(n)] for r in range(rounds)]
    rows = bench_batch.run(one, many, items[-2:], sets, ks, max_batch, max_new_tokens)
    table = Table(title=f"{limit} prompts per round, {max_new_tokens} new tokens, drafter {drafter}, {many.backend}")
    for column in ("K", "run", "round", "tokens", "tok/s", "x alone", "steps", "rows/step", "pass ms/step",
                   "other ms/step", "prefill s", "differing"):
        table.add_column(column, justify="left" if column in ("K", "run") else "right")
    alone_rates = {(r.k, r.round): r.tokens_per_second for r in rows if r.mode == "alone"}

    def cell(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in rows:
        table.add_row(r.k, r.mode, str(r.round), str(r.tokens), f"{r.tokens_per_second:.1f}",
                      f"{r.tokens_per_second / alone_rates[r.k, r.round]:.2f}", cell(r.steps, "d"),
                      cell(r.rows_per_step, ".1f"), cell(r.pass_ms, ".1f"), cell(r.other_ms, ".1f"),
                      cell(r.prefill_seconds, ".2f"), cell(r.differing, "d"))
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    if json_file is not None:
        bench_batch.save(json_file, rows, {"model": model or many.model.name, "backend": many.backend, "drafter": drafter,
                                           "max_batch": max_batch, "max_new_tokens": max_new_tokens,
                                           "prompts_per_round": limit, "threads": threads})


@app.command("run")
def run(
    config: Annotated[Optional[list[str]], typer.Option(
        help="A configuration: a .toml file or 'drafter=ngram,k=4,temperature=0,...' (repeatable).")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help=PROMPTS_HELP)] = None,
    split: Annotated[str, typer.Option(help=SPLIT_HELP)] = "all",
    skip: Annotated[int, typer.Option(help=SKIP_HELP)] = 0,
    limit: Annotated[Optional[int], typer.Option(help="Prompts per category (default: all).")] = None,
    category: Annotated[Optional[list[str]], typer.Option(help="Only this category (repeatable).")] = None,
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2).")] = None,
    backend: Annotated[str, typer.Option(help="Target backend of the engine: auto (for a GGUF file the one measured "
                                          "fastest here, as generate does), gguf, fast, transformers or llamacpp.")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: one per core); llamacpp: threads "
                                                   "per pass, of the engine and of llama.cpp's baselines.")] = None,
    k: Annotated[Optional[str], typer.Option("--k", help="Default K (or K policy) of configurations.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Default temperature (built-in: 0).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Default top-p.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Default top-k.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Default seed.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Default most new tokens per answer (built-in: 128).")] = None,
    baselines: Annotated[bool, typer.Option(help="Also run transformers generate, prompt lookup and assisted generation.")] = True,
    llamacpp_baselines: Annotated[Optional[bool], typer.Option(
        help="Also run llama.cpp's plain decoding, llama-lookup (stock and batch-invariant builds) and (with a draft GGUF among the configurations) "
        "llama-speculative-simple (default: with --backend llamacpp; tools: scripts/build_llamacpp_tools.sh).")] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up generations of every configuration (on a prompt not measured).")] = 1,
    out: Annotated[str, typer.Option(help="Directory for results.json, table.md, plot.png and notes.md.")] = "bench-results",
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model's own Python code.")] = False,
) -> None:
    """Spec-Bench style run: speedup over plain decoding per category, mean accepted length, mismatches."""
    import platform
    import sys
    from datetime import datetime, timezone

    import torch

    from specsample.bench import harness, report, run_notes
    from specsample.cli import quiet_transformers
    from specsample.gcfreeze import freeze_loaded
    from specsample.models import load_model, make_target
    from specsample.models.choice import resolve
    from specsample.policy import parse_k

    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if k is not None:
        parse_k(k)  # refused even where no configuration of the run takes it
    out = check_output_dir(out, "--out")
    overrides = {"k": k, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                 "max_new_tokens": max_new_tokens}
    defaults, configs = harness.read_configs(config or [], overrides)  # bad configurations and prompts: before any load
    items = read_bench_prompts(prompts, split, limit, category, skip)
    left_out = [] if category else [c for c in categories_of(prompts or packaged_prompts()) if c not in {p.category for p in items}]
    use_threads(threads)  # before `resolve`, which times the candidate backends at this thread count
    backend, backend_reason = resolve(model, backend, threads=threads, trust_remote_code=trust_remote_code)
    with_llamacpp = backend == "llamacpp" if llamacpp_baselines is None else llamacpp_baselines
    configs = harness.with_baselines(defaults, configs, baselines, llamacpp=with_llamacpp)
    quiet_transformers()
    # on llama.cpp without transformers baselines (or engine drafters that need them) only the tokenizer is read
    needs_weights = backend != "llamacpp" or any(c.kind.startswith("hf-") for c in configs)
    loaded = load_model(model, trust_remote_code=trust_remote_code, tokenizer_only=not needs_weights)
    target = make_target(loaded, backend, threads=threads)
    freeze_loaded()
    unavailable: dict[str, str] = {}
    records = harness.run(loaded, target, configs, items, warmup=warmup, trust_remote_code=trust_remote_code,
                          backend=backend, threads=threads, unavailable=unavailable)
    meta = {
        "model": loaded.name, "backend": type(target).__name__, "backend_reason": backend_reason, "prompts": str(prompts or packaged_prompts()),
        "split": split, "skip": skip, "limit": limit,
        "categories": category or [], "categories_left_out": left_out, "warmup": warmup, "reference": harness.REFERENCE,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "threads": threads, "unavailable": unavailable, **run_notes.backend_meta(target),
    }
    results = {"schema": report.SCHEMA, "meta": meta, "configs": harness.config_dicts(configs),
               "records": harness.record_dicts(records)}
    results["summary"] = report.summarize(results["records"], [c.name for c in configs])
    print(report.write(results, out), end="")
    notes = run_notes.markdown(results)
    (out / run_notes.NOTES_FILE).write_text(notes)
    print("\n" + notes, end="", file=sys.stderr)
    print(f"[{len(items)} prompts, {len(configs)} configurations; results in {out}]", file=sys.stderr)


@app.command("copy-bound")
def copy_bound(
    prompts: Annotated[Optional[Path], typer.Option(help=PROMPTS_HELP)] = None,
    split: Annotated[str, typer.Option(help=SPLIT_HELP)] = "all",
    limit: Annotated[Optional[int], typer.Option(help="Prompts per category (default: all).")] = None,
    category: Annotated[Optional[list[str]], typer.Option(help="Only this category (repeatable).")] = None,
    model: Annotated[Optional[str], typer.Option(help="HF model directory or GGUF file (default: bundled SmolLM2).")] = None,
    k: Annotated[Optional[list[int]], typer.Option("--k", help="Speculation length (repeatable; default 4 and 8).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most new tokens per answer.")] = 128,
) -> None:
    """What copying from the context can give: mean accepted lengths on the target's greedy answers (first turns)."""
    from rich.console import Console
    from rich.table import Table

    from specsample.api import SpecSampler
    from specsample.bench import copy_bound as cb
    from specsample.cli import quiet_transformers

    ks = k or [4, 8]
    if min(ks) < 1 or max_new_tokens < 1:
        raise ValueError("--k and --max-new-tokens must be positive")
    if len(set(ks)) != len(ks):
        raise ValueError(f"--k names a speculation length twice: {ks}")
    items = read_bench_prompts(prompts, split, limit, category)
    quiet_transformers()
    sampler = SpecSampler.load(model)
    totals: dict[tuple[str, int, str], list[int]] = {}
    for item in items:
        prompt = sampler.encode([{"role": "user", "content": item.turns[0]}])
        output = sampler.generate([{"role": "user", "content": item.turns[0]}], max_new_tokens=max_new_tokens,
                                  temperature=0, k=0).token_ids
        for kk in ks:
            for name, bound in cb.bounds(prompt, output, kk).items():
                for key in ((item.category, kk, name), ("overall", kk, name)):
                    total = totals.setdefault(key, [0, 0])
                    total[0], total[1] = total[0] + bound.tokens, total[1] + bound.steps
    categories = list(dict.fromkeys(key[0] for key in totals))
    table = Table(title=f"Mean accepted length of copy drafters on {len(items)} greedy answers (up to {max_new_tokens} tokens)")
    table.add_column("K, drafter", no_wrap=True)
    for name in categories:
        table.add_column(name, justify="right")
    for kk in ks:
        for name in ("ngram", "all matches", "any copy"):
            table.add_row(f"K={kk} {name}", *(f"{totals[c, kk, name][0] / totals[c, kk, name][1]:.2f}" for c in categories))
    Console(width=None if sys.stdout.isatty() else 160).print(table)


@app.command("report")
def report_command(
    directory: Annotated[str, typer.Argument(help="A `bench run --out` directory.")],
) -> None:
    """Re-render table.md and plot.png of a run from its results.json; print the table."""
    from specsample.bench import report

    if not directory.strip():  # Path("") is the current directory
        raise ValueError("the results directory is empty (give the directory of a `bench run --out`)")
    print(report.render(report.load(Path(directory)), Path(directory)), end="")
