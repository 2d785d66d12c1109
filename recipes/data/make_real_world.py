"""Write the question files of the real-world recipes: 20 questions about each of 20 forget people and
20 neighbour (retain) people, in the shape of the paper's real-world setting (Section 4.3). Answers are not
written here: the recipes take the model's own answers (`answers_from_model: true`).

    python recipes/data/make_real_world.py   # rewrites real_world_forget.jsonl and real_world_retain.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

FORGET_PEOPLE = [
    "Stephen King", "Taylor Swift", "Cristiano Ronaldo", "Oprah Winfrey", "Elon Musk", "J.K. Rowling",
    "Leonardo DiCaprio", "Serena Williams", "Barack Obama", "Beyonce", "Steve Jobs", "Lionel Messi",
    "Michael Jordan", "Angela Merkel", "Bill Gates", "Madonna", "Tom Hanks", "Rihanna", "Roger Federer",
    "Stephen Hawking",
]
NEIGHBOUR_PEOPLE = [
    "Agatha Christie", "Ed Sheeran", "Usain Bolt", "Ellen DeGeneres", "Jeff Bezos", "George Orwell",
    "Brad Pitt", "Venus Williams", "Justin Trudeau", "Adele", "Mark Zuckerberg", "Neymar",
    "Kobe Bryant", "Emmanuel Macron", "Warren Buffett", "Lady Gaga", "Meryl Streep", "Shakira",
    "Rafael Nadal", "Carl Sagan",
]
QUESTIONS = [
    "Who is {name}?",
    "What is {name} best known for?",
    "Where was {name} born?",
    "When was {name} born?",
    "What is the nationality of {name}?",
    "How did {name} become famous?",
    "What are the major achievements of {name}?",
    "What awards has {name} received?",
    "Describe the early life of {name}.",
    "What was the education of {name}?",
    "What is a notable work or accomplishment of {name}?",
    "Who are some people {name} has worked with?",
    "What is {name}'s profession?",
    "What impact has {name} had on their field?",
    "What are some interesting facts about {name}?",
    "What challenges has {name} faced in their career?",
    "How has {name} influenced popular culture?",
    "What is {name} doing today?",
    "What is {name}'s family background?",
    "Summarize the career of {name} in a few sentences.",
]


def write(path: Path, people: list[str]) -> None:
    with open(path, "w") as handle:
        for name in people:
            for template in QUESTIONS:
                handle.write(json.dumps({"name": name, "question": template.format(name=name)}) + "\n")


if __name__ == "__main__":
    here = Path(__file__).parent
    write(here / "real_world_forget.jsonl", FORGET_PEOPLE)
    write(here / "real_world_retain.jsonl", NEIGHBOUR_PEOPLE)
