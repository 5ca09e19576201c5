"""Write benchmarks/head_prompts.jsonl: synthetic instructions for training the bundled model's draft head.

Templates over topics, seeded, so the file is reproducible. They cover the kinds of
request Spec-Bench evaluates (explanation, writing, QA, translation, math, coding)
without using any Spec-Bench prompt: its dev set stays held out (the even
question_ids of it may be added at training time, the odd ones are evaluated).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = [
    "gravity", "photosynthesis", "inflation", "recursion", "democracy", "volcanoes", "the internet", "vaccines",
    "black holes", "climate change", "the French Revolution", "machine learning", "the water cycle", "DNA",
    "supply and demand", "the Roman Empire", "electric cars", "plate tectonics", "the immune system", "blockchain",
    "the stock market", "renewable energy", "the human brain", "antibiotics", "the printing press", "coral reefs",
    "quantum computing", "the Cold War", "bees and pollination", "the solar system", "sleep", "coffee",
    "the Olympic Games", "social media", "urban gardening", "jazz music", "the Great Wall of China", "earthquakes",
    "nutrition", "meditation", "cryptography", "airplanes", "the moon landing", "rainforests", "chess",
    "the Renaissance", "ocean tides", "public libraries", "remote work", "recycling", "volunteering", "budgeting",
    "learning a language", "time management", "the history of tea", "robots", "the Amazon river", "dinosaurs",
    "the Industrial Revolution", "artificial intelligence ethics", "mountain climbing", "honey bees", "glaciers",
]
TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}? Give a short answer.", "Write a short essay about {t}.",
    "List five interesting facts about {t}.", "Why is {t} important?", "Write a poem about {t}.",
    "Write a short story that involves {t}.", "Give me three tips related to {t}.",
    "Summarize the main ideas of {t} in one paragraph.", "What are the pros and cons of {t}?",
    "Explain {t} to a ten-year-old.", "Write a blog post introduction about {t}.",
    "Describe the history of {t} briefly.", "How does {t} affect everyday life?",
    "Compose a professional email to a colleague about {t}.", "Write a dialogue between two friends discussing {t}.",
    "What are common misconceptions about {t}?", "Create a quiz with three questions about {t}.",
    "Imagine you are a teacher. Introduce {t} to your class.", "Write a persuasive paragraph about {t}.",
]
QUESTIONS = [
    "What is the capital of {c}?", "Who was the first president of the United States?", "How many legs does a spider have?",
    "What is the boiling point of water in Fahrenheit?", "Which planet is known as the Red Planet?",
    "What language is spoken in {c}?", "What is the largest ocean on Earth?", "Who painted the Mona Lisa?",
    "What is the chemical symbol for gold?", "How many continents are there?", "What is the tallest mountain in the world?",
    "Who wrote Romeo and Juliet?", "What is the speed of light?", "What currency is used in {c}?",
    "When did World War II end?", "What is the square root of 144?", "Which animal is the largest mammal?",
]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Germany", "Mexico", "Kenya", "Australia", "Spain", "Italy"]
SENTENCES = [
    "The weather is beautiful today.", "I would like a cup of coffee, please.", "Where is the train station?",
    "My brother is reading a book in the garden.", "We are going to the beach tomorrow.", "This restaurant serves excellent food.",
    "Can you help me find my keys?", "The meeting starts at nine o'clock.", "She has lived in this city for ten years.",
    "Learning new things makes me happy.", "The children are playing in the park.", "Please close the window, it is cold.",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Chinese", "Portuguese"]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro"]
ITEMS = ["apples", "pencils", "books", "cookies", "marbles", "stickers", "oranges", "cards"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n", "finds the largest element of a list",
    "counts the vowels in a string", "merges two sorted lists", "returns the Fibonacci numbers up to n",
    "removes duplicates from a list", "checks whether a word is a palindrome", "sums the digits of an integer",
]


def math_prompt(rng: random.Random) -> str:
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c, price = rng.randint(3, 60), rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 15)
    return rng.choice([
        f"{name} has {a} {item}. {name} gives {b} to {other} and then buys {c} times as many as {name} has left. How many {item} does {name} have now?",
        f"A shop sells {item} for ${price} each. {name} buys {a} of them and pays with a ${(a * price // 10 + 1) * 10} bill. How much change does {name} get?",
        f"{name} reads {b} pages a day. How many days does it take to read a book of {a * b} pages?",
        f"There are {a} {item} shared equally among {c} children. How many does each child get, and how many are left over?",
        f"Solve for x: {c}x + {b} = {c * a + b}. Show your steps.",
        f"What is {a} multiplied by {b}, plus {c}? Explain step by step.",
    ])


def prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = [rng.choice(TEMPLATES).format(t=t) for t in TOPICS for _ in range(6)]
    out += [q.format(c=rng.choice(COUNTRIES)) for q in QUESTIONS for _ in range(3)]
    out += [f"Translate into {lang}: {s}" for s in SENTENCES for lang in rng.sample(LANGUAGES, 4)]
    out += [math_prompt(rng) for _ in range(110)]
    out += [f"Write a Python function that {task}." for task in CODE_TASKS]
    rng.shuffle(out)
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    path = Path(__file__).with_name("head_prompts.jsonl")
    rows = prompts()
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    print(f"{len(rows)} prompts -> {path}")
