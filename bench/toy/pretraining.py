"""The base model's pretraining text and its copy probe.

Every task family (bench.toy.tasks) is a transformation of its input, so
it needs copying (induction) first. The pretraining corpus therefore teaches
copying and repeating over random letter strings, pseudo-words, numbers,
dates, ``k=v`` lists and measurements, plus free text, and none of the
fine-tune operations (no reversing, case swapping, doubling, dashes,
rotating, first/last letter, date reordering or unit conversion). The copy
probe checks that the skill is there before any fine-tune.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ds_cluster.data.dataset import format_prompt

LOWER = "abcdefghijklmnopqrstuvwxyz"
UPPER = LOWER.upper()
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
COPY_INSTRUCTIONS = ("Repeat the text.", "Copy the input.", "Say it again.", "Echo this.",
                     "Write the input exactly.", "Repeat after me.")
PROBE_INSTRUCTIONS = ("Repeat the text.", "Copy the input.")

# The instruction decides how the copy is wrapped or repeated (still copying only).
_WRAPPINGS = (
    ("Repeat the text twice.", lambda text: f"{text} {text}"),
    ("Write the text in brackets.", lambda text: f"[{text}]"),
    ("Write the text in quotes.", lambda text: f'"{text}"'),
    ("Copy the input and add a full stop.", lambda text: f"{text}."),
)
_LINE_CHOICES = (("Copy the first line.", 0), ("Copy the second line.", 1))


@dataclass(frozen=True)
class CorpusMix:
    """Shares of each kind of document (chosen so the copy probe passes;
    bench/results/recipe/single_process/REPORT.md)."""

    copy: float = 0.6           # plain copy of a snippet, among documents that are not wrapped copies
    say: float = 0.1            # "Say X." with no input
    random_letters: float = 0.35  # a snippet is uniformly random letters
    wrapped_copy: float = 0.3   # copy variants: twice, brackets, quotes, one of two lines
    repetitive: float = 0.4     # snippets over a tiny alphabet (digits, 2-4 letters)


def pseudo_word(rng: random.Random, low: int = 1, high: int = 3) -> str:
    """A pronounceable non-word such as 'tomaki'."""
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(low, high)))


def random_letters(rng: random.Random, low: int = 1, high: int = 12) -> str:
    """Uniformly random letters; mostly lower case, sometimes upper or mixed."""
    count = rng.randint(low, high)
    style = rng.random()
    alphabet = LOWER if style < 0.7 else UPPER if style < 0.85 else LOWER + UPPER
    return "".join(rng.choice(alphabet) for _ in range(count))


def repetitive(rng: random.Random) -> str:
    """A string over a tiny alphabet: copying it needs positions, not "find the last time this character came"."""
    count = rng.randint(3, 12)
    if rng.random() < 0.5:
        return "".join(rng.choice("0123456789") for _ in range(count))
    alphabet = "".join(rng.sample(LOWER, rng.randint(2, 4)))
    return "".join(rng.choice(alphabet) for _ in range(count))


def snippet(rng: random.Random, mix: CorpusMix) -> str:
    """One piece of generic text."""
    if rng.random() < mix.random_letters:
        return random_letters(rng)
    if mix.repetitive and rng.random() < mix.repetitive:
        return repetitive(rng)
    kind = rng.randrange(6)
    if kind == 0:
        return " ".join(pseudo_word(rng) for _ in range(rng.randint(1, 3)))
    if kind == 1:
        return " ".join(str(rng.randrange(10 ** rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
    if kind == 2:  # a date in one format or the other, never both (no reordering pairs)
        year, month, day = rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)
        return f"{year:04d}-{month:02d}-{day:02d}" if rng.random() < 0.5 else f"{day:02d}/{month:02d}/{year:04d}"
    if kind == 3:
        keys = rng.sample(LOWER, rng.randint(2, 4))
        return ", ".join(f"{key}={rng.randrange(100)}" for key in keys)
    if kind == 4:
        return f"{rng.randint(1, 9999)} {rng.choice(('km', 'm', 'kg', 'g', 'cm'))}"
    return " ".join(random_letters(rng, 2, 6) for _ in range(rng.randint(2, 3)))


def _wrapped_copy(rng: random.Random, mix: CorpusMix, text: str) -> str:
    if rng.random() < 0.25:
        other = snippet(rng, mix)
        instruction, which = rng.choice(_LINE_CHOICES)
        lines = f"{text}\n{other}" if which == 0 else f"{other}\n{text}"
        return format_prompt({"instruction": instruction, "input": lines}) + text
    instruction, wrap = rng.choice(_WRAPPINGS)
    return format_prompt({"instruction": instruction, "input": text}) + wrap(text)


def generate_pretraining_corpus(seed: int, count: int, mix: CorpusMix = CorpusMix()) -> tuple[list[str], set[str]]:
    """``count`` texts, and the set of strings that were copy inputs (the probe avoids them)."""
    rng = random.Random(f"base.pretrain:{seed}")
    texts: list[str] = []
    copied: set[str] = set()
    for _ in range(count):
        draw = rng.random()
        if mix.wrapped_copy and rng.random() < mix.wrapped_copy:
            text = snippet(rng, mix)
            copied.add(text)
            texts.append(_wrapped_copy(rng, mix, text))
        elif draw < mix.copy:
            text = snippet(rng, mix)
            copied.add(text)
            record = {"instruction": rng.choice(COPY_INSTRUCTIONS), "input": text}
            texts.append(format_prompt(record) + text)
        elif draw < mix.copy + mix.say:
            word = random_letters(rng, 2, 8) if rng.random() < 0.5 else pseudo_word(rng, 1, 3)
            copied.add(word)
            texts.append(format_prompt({"instruction": f"Say {word}.", "input": ""}) + word)
        else:
            texts.append(". ".join(snippet(rng, mix) for _ in range(rng.randint(1, 3))) + ".")
    return texts, copied


def copy_probe_records(count: int = 200, seed: int = 1000, exclude: frozenset[str] | set[str] = frozenset()
                       ) -> list[dict[str, str]]:
    """Fresh copy probes: 3 to 8 uniformly random lower-case letters, none in ``exclude``, family "copy"."""
    rng = random.Random(f"base.probe:{seed}")
    records: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(records) < count:
        text = "".join(rng.choice(LOWER) for _ in range(rng.randint(3, 8)))
        if text in exclude or text in seen:
            continue
        seen.add(text)
        records.append({"instruction": PROBE_INSTRUCTIONS[len(records) % 2], "input": text, "output": text,
                        "family": "copy"})
    return records
