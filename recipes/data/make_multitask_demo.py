"""Write the three task files of `recipes/multitask/demo.yaml` (written by doplus, not taken from any data set).

    python recipes/data/make_multitask_demo.py [--rows 280] [--out recipes/data]

- multitask_math.jsonl: one-step arithmetic with small numbers (word problems and expressions); the answer is
  the number alone (metric `exact`).
- multitask_choice.jsonl: four-option questions whose answer can be checked (a prime, the largest number, the
  odd one out...); the answer is the option letter alone (metric `choice`).
- multitask_code.jsonl: next-line completion of Python code: the prompt is a few lines of a module of
  Python's own standard library installed on this machine, the answer its next line (metric `edit_sim`).

Every file is in the TRACE layout {"prompt": ..., "answer": ...}; rows are seeded, so the same Python
version writes the same files; the shipped files are Python 3.11's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sysconfig
from pathlib import Path

NAMES = ("Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemal", "Lena")
ITEMS = ("apples", "books", "marbles", "stamps", "pencils", "cards", "shells", "coins", "stickers", "eggs")


def math_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """One-step arithmetic with small numbers (a 135M model gets few right before training, so the task can
    show learning): sums and differences up to 20, in words or as an expression, and single-digit products."""
    rows = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        kind = rng.randrange(4)
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        if kind == 0:
            prompt, answer = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
        elif kind == 1:
            a = a + b
            prompt, answer = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
        elif kind == 2:
            prompt, answer = f"What is {a} + {b}?", a + b
        else:
            a, b = rng.randint(2, 5), rng.randint(2, 5)
            prompt, answer = f"What is {a} times {b}?", a * b
        rows.append({"prompt": prompt + " Answer with the number only.", "answer": str(answer)})
    return rows


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _choice_question(rng: random.Random) -> tuple[str, list[str], int]:
    """(question, four options, index of the right one)."""
    kind = rng.randrange(5)
    if kind == 0:
        prime = rng.choice([p for p in range(11, 98) if _is_prime(p)])
        others = rng.sample([c for c in range(10, 99) if not _is_prime(c)], 3)
        options, right = [prime, *others], prime
        question = "Which of these numbers is prime?"
    elif kind == 1:
        options = rng.sample(range(10, 1000), 4)
        right = max(options)
        question = "Which number is the largest?"
    elif kind == 2:
        options = rng.sample(range(10, 1000), 4)
        right = min(options)
        question = "Which number is the smallest?"
    elif kind == 3:
        odd = rng.randrange(1, 50) * 2 + 1
        others = [rng.randrange(5, 50) * 2 for _ in range(3)]
        options, right = [odd, *others], odd
        question = "Which of these numbers is odd?"
    else:
        animals = ["cat", "horse", "rabbit", "sparrow", "whale", "frog", "tiger", "owl"]
        tools = ["hammer", "spoon", "ladder", "pencil", "bucket", "kettle", "chair", "rope"]
        if rng.random() < 0.5:
            right, others, question = rng.choice(animals), rng.sample(tools, 3), "Which of these is an animal?"
        else:
            right, others, question = rng.choice(tools), rng.sample(animals, 3), "Which of these is not an animal?"
        options = [right, *others]
    rng.shuffle(options)
    return question, [str(o) for o in options], options.index(right)


def choice_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    rows = []
    for _ in range(n):
        question, options, right = _choice_question(rng)
        listed = " ".join(f"{letter}) {option}" for letter, option in zip("ABCD", options))
        rows.append({"prompt": f"{question} {listed}. Answer with the letter only.", "answer": "ABCD"[right]})
    return rows


STDLIB_MODULES = ("argparse.py", "configparser.py", "csv.py", "difflib.py", "fractions.py", "gettext.py",
                  "heapq.py", "inspect.py", "pathlib.py", "pprint.py", "shutil.py", "statistics.py", "string.py",
                  "tarfile.py", "textwrap.py", "zipfile.py")


def code_rows(rng: random.Random, n: int, context: int = 3) -> list[dict[str, str]]:
    """Next-line completions cut from the standard library's own source files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for name in STDLIB_MODULES:
        path = stdlib / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i in range(context, len(lines)):
            target, window = lines[i], lines[i - context:i]
            stripped = target.strip()
            plain = all(w.strip() and not w.strip().startswith(("#", '"' * 3, "'" * 3)) for w in window)
            if plain and 12 <= len(stripped) <= 60 and not stripped.startswith(("#", '"', "'")):
                candidates.append({"prompt": "Complete the next line of this Python code:\n" + "\n".join(window),
                                   "answer": target.rstrip()})
    if len(candidates) < n:
        raise SystemExit(f"only {len(candidates)} code lines found under {stdlib}")
    return rng.sample(candidates, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=280, help="rows per task (the recipe keeps the last 40 out)")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    for name, make, seed in (("math", math_rows, 1), ("choice", choice_rows, 2), ("code", code_rows, 3)):
        rows = make(random.Random(seed), args.rows)
        path = Path(args.out) / f"multitask_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
