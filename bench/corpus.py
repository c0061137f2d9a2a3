"""The benchmark's inputs: a deterministic corpus of varied English sentences, shipped as
`bench/corpus.txt` so that every run sends the same text. `generate_corpus` rebuilds it
(`python -m bench corpus`); it composes sentences from fixed word lists with a seeded RNG,
from a few words to a long paragraph, so token counts vary the way real traffic does."""

from __future__ import annotations

import random
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
CORPUS_SEED = 6
CORPUS_SIZE = 400

_SUBJECTS = [
    "the gateway", "a worker process", "the batch window", "our on-call engineer", "the Redis stream",
    "a sentence embedding", "the memory budget", "every request", "the load balancer", "a tired GPU",
    "the reply listener", "a new customer", "the search index", "this small model", "the nightly job",
    "a cold cache", "the support team", "an old laptop", "the release train", "a careful reviewer",
]
_VERBS = [
    "answers", "delays", "measures", "rejects", "batches", "forgets", "replays", "compresses",
    "schedules", "ranks", "splits", "retries", "caches", "summarises", "embeds", "drops",
]
_OBJECTS = [
    "the slow queries", "a thousand short questions", "every pending entry", "the weather report",
    "a recipe for lentil soup", "the quarterly sales figures", "an angry support ticket",
    "the train timetable", "a poem about the sea", "the error budget", "its own heartbeat",
    "a paragraph of legal text", "the product reviews", "two overlapping deadlines", "a stack trace",
]
_CLAUSES = [
    "before the deadline passes", "while the cluster is under load", "because nobody else was awake",
    "after the morning traffic peak", "without touching the disk", "as the documentation promised",
    "even when the network is flaky", "so that latency stays predictable", "once the cache is warm",
    "although the dashboard disagreed", "in less time than a coffee break", "for the third time today",
]
_SHORT = [
    "hello", "thanks!", "where is my order?", "reset password", "GPU out of memory", "is it down?",
    "refund please", "how fast is it", "cheap flights to Lisbon", "best pizza near me",
]


def _sentence(rng: random.Random) -> str:
    shape = rng.random()
    if shape < 0.15:
        return rng.choice(_SHORT)
    words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    clauses = 1 if shape < 0.6 else rng.randint(2, 6)
    for clause in rng.sample(_CLAUSES, clauses):
        words += f" {clause}"
    return words[0].upper() + words[1:] + rng.choice([".", ".", "!", "?"])


def generate_corpus(size: int = CORPUS_SIZE, seed: int = CORPUS_SEED) -> list[str]:
    """`size` sentences, the same for the same seed: 15% short queries, 45% one clause,
    40% long (2-6 clauses, up to ~70 tokens)."""
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(size)]


def write_corpus(path: Path = CORPUS_PATH) -> int:
    """Regenerate the shipped corpus file; returns the number of sentences written."""
    sentences = generate_corpus()
    path.write_text("\n".join(sentences) + "\n")
    return len(sentences)


def load_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The shipped corpus, one sentence per line. Raises FileNotFoundError if it is missing."""
    return [line for line in path.read_text().splitlines() if line.strip()]
