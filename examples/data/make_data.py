"""Regenerate the bundled example data (deterministic; plain English written from templates).

reviews.jsonl: {"text", "label"} short product/restaurant/film reviews, label 1 = positive, 0 = negative.
corpus.txt: one short English paragraph per line, for causal-LM training.
Run: python examples/data/make_data.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUBJECTS = {
    "film": ["the film", "this movie", "the sequel", "the documentary", "the thriller", "the comedy"],
    "food": ["the soup", "the pasta", "dinner", "the bakery", "the curry", "this restaurant", "the coffee"],
    "gear": ["the kettle", "this laptop", "the headphones", "the backpack", "the lamp", "this phone", "the tent"],
    "book": ["the novel", "this book", "the memoir", "the short story collection", "the cookbook"],
}
GOOD = {
    "film": ["kept me smiling from start to finish", "has a clever plot and warm characters",
             "is beautifully shot and well acted", "was worth every minute", "made the whole family laugh"],
    "food": ["was fresh and full of flavour", "arrived hot and tasted wonderful", "was the best I have had in years",
             "was generous, cheap and delicious", "had friendly staff and quick service"],
    "gear": ["works perfectly and feels solid", "was easy to set up", "has a battery that lasts for days",
             "is light, quiet and well made", "still works great after a year of daily use"],
    "book": ["was hard to put down", "is funny, wise and honest", "taught me a lot",
             "has characters I will remember", "is written in clear and lovely prose"],
}
BAD = {
    "film": ["was dull and far too long", "has a confusing plot and flat acting", "put me to sleep",
             "was a waste of an evening", "felt cheap and lazy"],
    "food": ["was cold and bland", "took an hour to arrive", "was overpriced and greasy",
             "made me feel ill", "had rude staff and dirty tables"],
    "gear": ["broke after two days", "is loud, heavy and badly made", "would not turn on",
             "has a battery that dies by noon", "came with missing parts"],
    "book": ["was boring and repetitive", "is full of errors", "has an ending that makes no sense",
             "was a chore to finish", "is badly written and far too long"],
}
OPEN_GOOD = ["Honestly,", "I have to say", "Happy to report that", "Wow,", "To be fair,", ""]
OPEN_BAD = ["Sadly,", "I have to say", "Unfortunately", "Ugh,", "To be honest,", ""]
CLOSE_GOOD = ["I would recommend it.", "Five stars.", "I will be back.", "A real treat.", "Great value.", ""]
CLOSE_BAD = ["I would not recommend it.", "One star.", "Never again.", "What a letdown.", "Avoid it.", ""]

TOPICS = [
    ("river", "The river runs past the old mill and under the stone bridge before it reaches the sea."),
    ("garden", "In spring the garden fills with tulips, and the bees move slowly from one flower to the next."),
    ("market", "On Saturday mornings the market sells bread, cheese, apples and honey from the nearby farms."),
    ("train", "The early train leaves at six, and most passengers read or sleep until the city appears."),
    ("library", "The library is quiet in the afternoon, when students come to study near the tall windows."),
    ("storm", "A storm came in from the west, and the wind bent the trees along the road."),
    ("kitchen", "The kitchen smelled of onions and fresh bread while the soup simmered on the stove."),
    ("harbour", "Fishing boats return to the harbour at dusk, and gulls circle over the nets."),
    ("school", "The children walked to school together, talking about the football match of the day before."),
    ("forest", "Deep in the forest the path grows narrow, and the light turns green under the leaves."),
]
FOLLOW = [
    "Nobody seemed to be in a hurry.", "It had been like this for as long as anyone could remember.",
    "Later that day the weather changed.", "A dog barked somewhere in the distance.",
    "An old man watched from a bench and smiled.", "The clock on the tower struck the hour.",
    "Everyone agreed it was a good day.", "By evening the streets were quiet again.",
    "She wrote it all down in a small notebook.", "He promised to come back the next summer.",
]


def reviews(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        kind = rng.choice(sorted(SUBJECTS))
        label = i % 2
        opener = rng.choice(OPEN_GOOD if label else OPEN_BAD)
        body = rng.choice((GOOD if label else BAD)[kind])
        close = rng.choice(CLOSE_GOOD if label else CLOSE_BAD)
        text = " ".join(w for w in [opener, rng.choice(SUBJECTS[kind]), body + ".", close] if w)
        rows.append({"text": text[0].upper() + text[1:], "label": label})
    return rows


def corpus(n: int, rng: random.Random) -> list[str]:
    lines = []
    for _ in range(n):
        _, first = rng.choice(TOPICS)
        rest = rng.sample(FOLLOW, 2)
        lines.append(" ".join([first, *rest]))
    return lines


def main() -> None:
    rng = random.Random(0)
    with open(HERE / "reviews.jsonl", "w") as f:
        for row in reviews(1200, rng):
            f.write(json.dumps(row) + "\n")
    (HERE / "corpus.txt").write_text("\n".join(corpus(800, rng)) + "\n")


if __name__ == "__main__":
    main()
