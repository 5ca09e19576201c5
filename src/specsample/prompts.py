"""Prompt files: the one reader for the benchmarks and for training a draft head.

Three forms are read:

- Spec-Bench JSONL: one object a line with `question_id`, `category` and `turns`
  (a list of user messages; a multi-turn prompt is fed turn by turn);
- JSONL with a `prompt` field (one turn; `question_id` and `category` optional);
- any other file: plain text, one single-turn prompt a line.

The Spec-Bench development prompts ship with the package (`packaged_prompts`),
so the benchmarks run from any directory. Held-out halves are made by
`question_id` parity (`split` "odd" or "even"): the shipped draft head was
trained on the even half, so it is evaluated on the odd one. Prompts without a
`question_id` (plain text, `prompt` rows) belong to both halves: they are kept.
`skip` drops the first prompts of every category, counted in file order before
the split: the drafters and the K policy were tuned on the first `TUNED_PER_CATEGORY`
of each category, so `split="odd", skip=TUNED_PER_CATEGORY` is never-tuned data
(MT-bench's sub-categories have 5 prompts each, all of them tuned on).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("all", "odd", "even")
SPEC_BENCH_FIELDS = "question_id, category, turns"
TUNED_PER_CATEGORY = 6


@dataclass(frozen=True)
class Prompt:
    """One prompt: its user turns, and Spec-Bench's question_id and category where the file has them."""

    question_id: int | str | None
    category: str | None
    turns: tuple[str, ...]


def packaged_prompts() -> Path:
    """The Spec-Bench development prompts shipped in the package (240 prompts, see its README and LICENSE)."""
    return Path(__file__).resolve().parent / "data" / "spec_bench" / "dev.jsonl"


def in_split(question_id: int | str | None, split: str) -> bool:
    """Whether a prompt falls in `split`: "all", or the "odd" or "even" question_ids (none: in both)."""
    check_split(split)
    if split == "all" or question_id is None:
        return True
    if not isinstance(question_id, int) or isinstance(question_id, bool):
        raise ValueError(f"the {split} split needs integer question_ids, got {question_id!r}")
    return question_id % 2 == (split == "odd")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def read_prompts(
    *paths: str | Path,
    split: str = "all",
    categories: Sequence[str] = (),
    limit: int | None = None,
    spec_bench: bool = False,
    skip: int = 0,
) -> list[Prompt]:
    """The prompts of these files, in order: past the first `skip` of each category, those in `split`, of
    `categories` (all when empty), at most `limit` per category (prompts without one count as one
    category). `spec_bench` requires every prompt to carry question_id, category and turns, as the
    benchmark harness does, and distinct question_ids."""
    check_split(split)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    prompts, per_category, position, where = [], {}, {}, {}
    for path in map(Path, paths):
        for prompt in parse_file(path, spec_bench):
            if spec_bench:  # the harness keys answers by question_id: a second one would replace the first's
                if prompt.question_id in where:
                    raise ValueError(f"question_id {prompt.question_id!r} appears twice ({where[prompt.question_id]} "
                                     f"and {path}): a benchmark's prompts need distinct question_ids")
                where[prompt.question_id] = path
            position[prompt.category] = position.get(prompt.category, 0) + 1
            if position[prompt.category] <= skip:
                continue
            if not in_split(prompt.question_id, split) or (categories and prompt.category not in categories):
                continue
            seen = per_category.get(prompt.category, 0)
            if limit is None or seen < limit:
                prompts.append(prompt)
                per_category[prompt.category] = seen + 1
    selection = f" of split {split}" if split != "all" else ""
    selection += f" past the first {skip} of each category" if skip else ""
    files = ", ".join(map(str, paths))
    unknown = [c for c in categories if c not in position]
    if unknown:
        raise ValueError(f"no category {', '.join(map(repr, unknown))} in {files} (its categories: "
                         f"{', '.join(sorted(c for c in position if c is not None))})")
    empty = [c for c in categories if c not in per_category]
    if empty:
        raise ValueError(f"no prompts{selection} in category {', '.join(map(repr, empty))} of {files}")
    if not prompts:
        raise ValueError(f"no prompts{selection} in {files}")
    return prompts


def categories_of(*paths: str | Path) -> list[str]:
    """The categories of these prompt files, in order of first appearance."""
    return list(dict.fromkeys(p.category for path in map(Path, paths) for p in parse_file(path, False)
                              if p.category is not None))


def parse_file(path: Path, spec_bench: bool) -> list[Prompt]:
    """Every prompt of one file: JSON lines if it ends in .jsonl, else plain text, one prompt a line."""
    if path.is_dir():
        raise ValueError(f"prompts file {path} is a directory")
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"prompts file {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if path.suffix != ".jsonl":
        if spec_bench:
            raise ValueError(f"{path}: not a Spec-Bench prompts file (JSONL with {SPEC_BENCH_FIELDS})")
        return [Prompt(None, None, (line.strip(),)) for line in lines if line.strip()]
    return [parse_row(line, f"{path}:{number}", spec_bench) for number, line in enumerate(lines, 1) if line.strip()]


def parse_row(line: str, where: str, spec_bench: bool) -> Prompt:
    """One JSONL row: Spec-Bench's `turns`, or a `prompt` field; `where` names it in errors."""
    try:
        row = json.loads(line)
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
        missing = [key for key in ("question_id", "category", "turns") if key not in row]
        if spec_bench and missing:
            raise ValueError(f"no {', '.join(missing)}")
        if "turns" not in row and "prompt" not in row:
            raise ValueError("no turns or prompt")
        turns = row["turns"] if "turns" in row else [row["prompt"]]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise ValueError("'turns' must be a non-empty list of strings, 'prompt' a string")
        category, question_id = row.get("category"), row.get("question_id")
        if question_id is not None and (not isinstance(question_id, (int, str)) or isinstance(question_id, bool)):
            raise ValueError(f"question_id must be an integer or a string, got {question_id!r}")
        if (spec_bench or category is not None) and not (isinstance(category, str) and category.strip()):
            raise ValueError(f"category must be a non-empty string, got {category!r}")  # it names a table's column
        return Prompt(question_id, category, tuple(turns))
    except ValueError as e:  # json.JSONDecodeError is one
        expected = SPEC_BENCH_FIELDS if spec_bench else f"{SPEC_BENCH_FIELDS}; or prompt"
        raise ValueError(f"{where}: not a prompt ({expected}): {e}") from None
