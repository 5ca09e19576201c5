"""What `bench run` writes beside report's tables (notes.md, and on stderr): decode-only rates of
every configuration (llama.cpp's baselines included, each measured like the engine: prefill and
model loading excluded) and how each ran, the baselines that could not run here, and what the
cost-model K policy (`--k auto`) chose and measured.
"""

from __future__ import annotations

from collections.abc import Sequence

from specsample.bench.report import OVERALL, fmt

NOTES_FILE = "notes.md"


def backend_meta(target) -> dict:
    """For a llamacpp target: the GGUF file, threads, context window and llama.cpp's CPU variant."""
    if not hasattr(target, "n_threads"):
        return {}
    from specsample.models.llamacpp import system_info

    return {"llamacpp": {"gguf": str(target.path), "threads": target.n_threads, "n_ctx": target.max_length,
                         "cpu": system_info()}}


def markdown(results: dict) -> str:
    """The notes of a run, as markdown."""
    parts = [decode_rates(results)]
    left_out = results["meta"].get("categories_left_out") or []
    if left_out:
        meta = results["meta"]
        skipped = f", past the first {meta['skip']} of each category" if meta.get("skip") else ""
        parts.append(f"Categories with no prompts in this selection (split {meta['split']}{skipped}), so not in the "
                     f"tables: {', '.join(left_out)}")
    unavailable = results["meta"].get("unavailable") or {}
    if unavailable:
        parts.append("Not available in this run\n\n" + "\n".join(f"- {name}: not available: {reason}"
                                                                  for name, reason in unavailable.items()))
    policy = k_policy(results["records"], [c["name"] for c in results["configs"] if c["kind"] == "engine"
                                           and c["k"].startswith("auto")])
    if policy:
        parts.append(policy)
    return "\n\n".join(parts) + "\n"


def decode_rates(results: dict) -> str:
    """Decode-only and end-to-end tokens/s per configuration, overall, and how each ran."""
    overall = {r["config"]: r for r in results["summary"] if r["category"] == OVERALL}
    lines = ["Decode-only tokens/s (prefill and model loading excluded; end to end: prefill included)\n",
             "| configuration | decode tokens/s | end-to-end tokens/s | prefill seconds | ran as |", "|---" * 5 + "|"]
    for config in results["configs"]:
        name = config["name"]
        mine = [r for r in results["records"] if r["config"] == name]
        if not mine:
            continue
        stats = [r["stats"] for r in mine if r["stats"]]
        prefill = sum(s["prefill_seconds"] for s in stats) if stats else None
        label = stats[0]["drafter"] if stats and config["kind"] != "engine" else config["kind"]
        if config["kind"] == "engine":
            label = f"engine, drafter {config['drafter']}, k {config['k']}"
        lines.append(f"| {name} | {fmt(overall[name]['decode_tokens_per_second'], 1)} "
                     f"| {fmt(overall[name]['tokens_per_second'], 1)} | {fmt(prefill, 2)} | {label} |")
    return "\n".join(lines)


def k_policy(records: Sequence[dict], names: Sequence[str]) -> str:
    """For each `--k auto` configuration: the K it chose at its steps (0: a plain step), the draft
    tokens it verified per step, and the cost curve f(n)/f(1) the policy had measured when the
    last answer ended (f(n): seconds to score n positions)."""
    lines = []
    for name in names:
        stats = [r["stats"] for r in records if r["config"] == name and r["stats"]]
        if not stats:
            continue
        steps = sum(s["steps"] for s in stats)
        chosen: dict[int, int] = {}
        for s in stats:
            for k, count in (s.get("chosen_k") or {}).items():
                chosen[int(k)] = chosen.get(int(k), 0) + count
        target_ms = {int(n): ms for n, ms in (stats[-1].get("policy") or {}).get("target_ms", {}).items()}
        curve = (", ".join(f"{n}: {ms / target_ms[1]:.2f}" for n, ms in sorted(target_ms.items()))
                 if 1 in target_ms else "not measured")
        drafted = sum(s["drafted_tokens"] for s in stats)
        lines.append(
            f"- {name}: {steps} steps; K chosen (K: steps): "
            f"{', '.join(f'{k}: {c}' for k, c in sorted(chosen.items())) or 'not recorded'}; "
            f"draft tokens verified per step {fmt(drafted / steps if steps else None)}; "
            f"f(n)/f(1) as the policy measured it (f(1) {fmt(target_ms.get(1), 1)} ms): {curve}")
    return ("K policy (`--k auto`)\n\n" + "\n".join(lines)) if lines else ""
