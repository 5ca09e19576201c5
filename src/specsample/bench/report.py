"""Benchmark results: the JSON file, the markdown tables and the PNG plot.

Figures are pooled over the answers of a category (and over all answers for
"overall"): tokens per second = generated tokens / seconds, summed over the
answers. Speedup = a configuration's tokens per second / plain decoding's, in
the same category of the same run. Two speedups are reported:
- speedup: end-to-end wall time of each call, prefill included (as Spec-Bench
  times methods); defined for every configuration, transformers ones included;
- decode speedup: the engine's decoding time only (Stats.decode_seconds,
  prefill excluded); engine configurations only.
Mean accepted length = generated tokens / verification steps; acceptance rate
= accepted draft tokens / drafted tokens.

Each speedup comes with a 95% confidence interval from a paired bootstrap over
the questions (a question's turns, each with plain decoding's answer to the
same turn, are resampled together: a second turn continues its first, so turns
are not independent draws), so that a category's ratio can be told from the
run's noise: the A/A control's intervals show what noise alone gives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from scipy.stats import bootstrap, norm
from scipy.stats import t as student_t

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specsample.bench.harness import REFERENCE

RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
PLOT_FILE = "plot.png"
OVERALL = "overall"
SCHEMA = 1
CONFIDENCE = 0.95
RESAMPLES = 2000  # at least
TAIL_RESAMPLES = 25  # resamples beyond each end of an interval, at least
MIN_QUESTIONS = 4  # for an interval


def summarize(records: Sequence[dict], configs: Sequence[str], reference: str = REFERENCE) -> list[dict]:
    """One row per configuration and category (and overall), with speedups against `reference`."""
    categories = list(dict.fromkeys(r["category"] for r in records))
    in_category = {category: [r for r in records if r["category"] == category] for category in categories}
    in_category[OVERALL] = list(records)
    rows = []
    for config in configs:
        for category, chosen in in_category.items():
            row = pool(config, category, [r for r in chosen if r["config"] == config])
            row["speedup_interval"] = speedup_interval(chosen, config, reference) if config != reference else None
            rows.append(row)
    base = {row["category"]: row for row in rows if row["config"] == reference}
    for row in rows:
        ref = base.get(row["category"])
        row["speedup"] = ratio(row["tokens_per_second"], ref and ref["tokens_per_second"])
        row["decode_speedup"] = ratio(row["decode_tokens_per_second"], ref and ref["decode_tokens_per_second"])
    return rows


def expanded_level(questions: int, confidence: float = CONFIDENCE) -> float:
    """The percentile level that gives the bootstrap interval of `questions` about `confidence` coverage:
    Hesterberg's expanded percentile interval, the tail 2 Phi(-sqrt(n / (n - 1)) t_{n-1}) for n questions.
    The plain percentile interval runs narrow on few questions (95% intervals of a true 1.25x speedup
    covered it in 74% of 300 simulated runs of 3 questions, 82% of 5, 89% of 10)."""
    n = questions
    tail = 2 * norm.cdf(-math.sqrt(n / (n - 1)) * student_t.ppf(1 - (1 - confidence) / 2, n - 1))
    return 1 - tail


def resamples(level: float) -> int:
    """Bootstrap resamples for a percentile interval at `level`: TAIL_RESAMPLES beyond each end. The expanded
    level of 5 questions (0.998) leaves 0.1% a tail, 2 of RESAMPLES, and the ends then moved with the seed
    (an upper end of 1.22 or 1.38 on the same answers)."""
    return max(RESAMPLES, math.ceil(2 * TAIL_RESAMPLES / (1 - level)))


def speedup_interval(records: Sequence[dict], config: str, reference: str = REFERENCE) -> list[float] | None:
    """The CONFIDENCE interval of `config`'s end-to-end speedup over `reference` on these records:
    percentile bootstrap (fixed seed) over the questions, on the turns both answered, a question's
    turns and both configurations' answers to them kept together, at the `expanded_level`; None with fewer
    than MIN_QUESTIONS questions (3 questions have 10 distinct resamples, and their widest interval covered
    a true speedup in 74% of simulated runs)."""
    answers = {(r["question_id"], r["turn"], r["config"]): r for r in records}
    turns: dict[object, list[int]] = {}  # question_id -> its turns both answered
    for q, t, c in answers:
        if c == config and (q, t, reference) in answers:
            turns.setdefault(q, []).append(t)
    if len(turns) < MIN_QUESTIONS:
        return None
    columns = [np.array([sum(answers[(q, t, c)][key] for t in ts) for q, ts in turns.items()], dtype=float)
               for c in (config, reference) for key in ("generated_tokens", "wall_seconds")]

    def speedup(tokens, seconds, ref_tokens, ref_seconds, axis=-1):
        return (tokens.sum(axis) / seconds.sum(axis)) / (ref_tokens.sum(axis) / ref_seconds.sum(axis))

    level = expanded_level(len(turns))
    result = bootstrap(columns, speedup, paired=True, vectorized=True, n_resamples=resamples(level), batch=RESAMPLES,
                       confidence_level=level, method="percentile", rng=np.random.default_rng(0))
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def pool(config: str, category: str, records: Sequence[dict]) -> dict:
    """Sums over the answers, and the rates made of them."""
    engine = [r["stats"] for r in records if r["stats"] is not None]
    checked = [r["matches_plain"] for r in records if r["matches_plain"] is not None]
    tokens = sum(r["generated_tokens"] for r in records)
    steps, drafted = total(engine, "steps"), total(engine, "drafted_tokens")
    decode_seconds = total(engine, "decode_seconds")
    return {
        "config": config,
        "category": category,
        "answers": len(records),
        "generated_tokens": tokens,
        "wall_seconds": sum(r["wall_seconds"] for r in records),
        "tokens_per_second": ratio(tokens, sum(r["wall_seconds"] for r in records)),
        "decode_tokens_per_second": ratio(total(engine, "generated_tokens"), decode_seconds) if engine else None,
        "mean_accepted_length": ratio(total(engine, "generated_tokens"), steps) if engine else None,
        "acceptance_rate": ratio(total(engine, "accepted_tokens"), drafted) if engine else None,
        "checked": len(checked),
        "mismatches": checked.count(False),
    }


def total(stats: Sequence[dict], key: str) -> float:
    return sum(s[key] for s in stats)


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def fmt(value: float | list[float] | None, digits: int = 2) -> str:
    """A figure, an interval [low, high] as "low-high", or n/a."""
    if isinstance(value, list):
        return "-".join(fmt(v, digits) for v in value)
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    """Three tables: overall figures, speedup per category, mean accepted length per category."""
    rows, configs = results["summary"], [c["name"] for c in results["configs"]]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    cell = {(r["config"], r["category"]): r for r in rows}
    overall = ["| configuration | speedup | decode speedup | mean accepted length | acceptance rate "
               "| tokens/s | answers | mismatches with plain (t=0, or the same seed) |", "|---" * 8 + "|"]
    for name in configs:
        r = cell[name, OVERALL]
        mismatches = f"{r['mismatches']}/{r['checked']}" if r["checked"] else "n/a"
        overall.append(f"| {name} | {fmt(r['speedup'])} | {fmt(r['decode_speedup'])} | {fmt(r['mean_accepted_length'])} "
                       f"| {fmt(r['acceptance_rate'])} | {fmt(r['tokens_per_second'], 1)} | {r['answers']} | {mismatches} |")
    with_interval = [n for n in configs if cell[n, OVERALL]["speedup_interval"]]
    intervals = (per_category(cell, with_interval, categories, "speedup_interval") if with_interval else
                 f"none: every configuration answered fewer than {MIN_QUESTIONS} questions in common with plain decoding")
    return "\n\n".join([
        "\n".join(overall),
        "Speedup (end to end) per category\n\n" + per_category(cell, configs, categories, "speedup"),
        f"{CONFIDENCE:.0%} confidence interval of each speedup (paired bootstrap over the questions)\n\n" + intervals,
        "Mean accepted length per category\n\n" + per_category(
            cell, [n for n in configs if cell[n, OVERALL]["mean_accepted_length"] is not None], categories,
            "mean_accepted_length"),
    ]) + "\n"


def per_category(cell: dict, configs: Sequence[str], categories: Sequence[str], key: str) -> str:
    lines = ["| configuration | " + " | ".join(categories) + " |", "|---" * (len(categories) + 1) + "|"]
    for name in configs:
        lines.append(f"| {name} | " + " | ".join(fmt(cell[name, c][key]) for c in categories) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Bars of speedup per category for each configuration, and of mean accepted length."""
    rows, reference = results["summary"], results["meta"].get("reference", REFERENCE)
    categories = list(dict.fromkeys(r["category"] for r in rows))
    cell = {(r["config"], r["category"]): r for r in rows}
    names = [c["name"] for c in results["configs"] if c["name"] != reference]
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(categories)), 5))
    for ax, key, title in ((axes[0], "speedup", "Speedup over plain decoding (end to end)"),
                           (axes[1], "mean_accepted_length", "Mean accepted length")):
        shown = [n for n in names if cell[n, OVERALL][key] is not None]
        width = 0.8 / max(1, len(shown))
        for i, name in enumerate(shown):
            values = [cell[name, c][key] or 0.0 for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], values, width, color=colors[name])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
        ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    fig.legend(handles, names, loc="lower center", ncol=max(1, min(len(names), 4)), fontsize="small")
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: dict, out: Path) -> str:
    """results.json, table.md and plot.png in `out`; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=1))
    return render(results, out)


def render(results: dict, out: Path) -> str:
    """table.md and plot.png from results; returns the markdown."""
    table = markdown(results)
    (out / TABLE_FILE).write_text(table)
    plot(results, out / PLOT_FILE)
    return table


def load(out: Path) -> dict:
    """The results of a run directory, with the summary recomputed from the per-prompt records."""
    path = Path(out) / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {RESULTS_FILE} in {out}")
    try:
        results = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    if not isinstance(results, dict) or results.get("schema") != SCHEMA:
        schema = results.get("schema") if isinstance(results, dict) else None
        raise ValueError(f"{path}: unknown schema {schema!r}, expected {SCHEMA}")
    if not (isinstance(results.get("configs"), list) and results["configs"] and isinstance(results.get("records"), list)
            and results["records"]):
        raise ValueError(f"{path} holds no configurations or no records: nothing to report")
    try:
        names = [c["name"] for c in results["configs"]]
        results["summary"] = summarize(results["records"], names, results["meta"].get("reference", REFERENCE))
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not a `bench run` results file (missing or malformed {error})") from None
    odd = [r.get("category") for r in results["records"] if not isinstance(r.get("category"), str)]
    if odd:  # categories and names head the tables' columns and rows
        raise ValueError(f"{path} is not a `bench run` results file (a record's category is {odd[0]!r}, not a string)")
    return results
