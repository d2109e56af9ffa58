"""Writes the shipped IMDb-format sample (``imdb_train.csv``, ``imdb_test.csv``: columns text,label).

The reviews are synthetic and original: sentences assembled from a small phrase bank with a seeded RNG, with
clear sentiment words so a tiny model learns the task in a few steps (label 1 = positive, 0 = negative, as IMDb).
Re-run with ``python recipes/data/make_imdb_sample.py`` to regenerate the files byte for byte.
"""

import csv
import random
from pathlib import Path

FILMS = [
    "this film",
    "the movie",
    "this picture",
    "the sequel",
    "this thriller",
    "the comedy",
    "this drama",
    "the documentary",
    "this western",
    "the musical",
    "this remake",
    "the cartoon",
]
PARTS = [
    "the acting",
    "the script",
    "the soundtrack",
    "the ending",
    "the camera work",
    "the lead actor",
    "the dialogue",
    "the pacing",
    "the villain",
    "the plot",
    "the editing",
    "the supporting cast",
]
GOOD = [
    "wonderful",
    "brilliant",
    "superb",
    "delightful",
    "moving",
    "excellent",
    "charming",
    "gripping",
    "beautiful",
    "clever",
    "touching",
    "outstanding",
]
BAD = [
    "awful",
    "boring",
    "dreadful",
    "terrible",
    "clumsy",
    "dull",
    "painful",
    "lifeless",
    "annoying",
    "weak",
    "silly",
    "forgettable",
]
POSITIVE = [
    "I loved {film}, {part} was {adj}.",
    "{Part} was {adj} and I would happily watch it again.",
    "Truly {adj} from start to finish, I left the cinema smiling.",
    "Highly recommended: {part} is {adj}.",
    "My whole family enjoyed {film}; {part} felt {adj}.",
    "The story is {adj} and told with real heart.",
]
NEGATIVE = [
    "I hated {film}, {part} was {adj}.",
    "{Part} was {adj} and I almost walked out.",
    "Simply {adj} from start to finish, a waste of two hours.",
    "Avoid it: {part} is {adj}.",
    "Nobody in my family enjoyed {film}; {part} felt {adj}.",
    "The story is {adj} and told without any care.",
]
NEUTRAL = [
    "I saw {film} last weekend.",
    "It runs a little under two hours.",
    "{Part} reminded me of older films.",
    "The cinema was half full.",
    "My friend suggested {film} to me.",
    "It was released in the autumn.",
]


def review(rng: random.Random, label: int) -> str:
    """One review: 1-2 neutral sentences mixed with 2-3 sentences of the given sentiment."""
    templates, adjectives = (POSITIVE, GOOD) if label else (NEGATIVE, BAD)
    sentences = rng.sample(NEUTRAL, rng.randint(1, 2)) + rng.sample(templates, rng.randint(2, 3))
    rng.shuffle(sentences)
    filled = []
    for s in sentences:
        part = rng.choice(PARTS)
        filled.append(s.format(film=rng.choice(FILMS), part=part, Part=part.capitalize(), adj=rng.choice(adjectives)))
    return " ".join(filled)


def write(path: Path, rows: list[tuple[str, int]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows)


def main() -> None:
    rng = random.Random(0)
    rows = [(review(rng, label), label) for label in [0, 1] * 200]
    here = Path(__file__).parent
    write(here / "imdb_train.csv", rows[:320])
    write(here / "imdb_test.csv", rows[320:])


if __name__ == "__main__":
    main()
