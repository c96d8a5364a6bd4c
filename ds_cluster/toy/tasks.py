"""A synthetic instruction-tuning mixture whose answers can be checked exactly.

Eight task families with strongly skewed (geometric) sizes stand in for a real
instruction mixture such as Alpaca: a few families dominate and the smallest
is more than 30 times smaller, which is the situation cluster-balanced
sampling is meant for. Every record is Alpaca-style
``{"instruction", "input", "output", "family"}``; ``family`` is metadata for
analysis and is never part of the training text.

Strings stay short because the tiny model reads characters, not words.
Everything is derived from one seed through local generators (no global RNG).

Run ``python -m ds_cluster.toy.tasks --out DIR --seed S`` to write
``train.jsonl`` and ``heldout.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import random
from pathlib import Path
from typing import Callable, Iterable, Union

from ds_cluster.dataset import format_prompt, write_jsonl

logger = logging.getLogger(__name__)

# Largest family first: sizes fall geometrically along this order.
FAMILIES: tuple[str, ...] = (
    "add",
    "reverse",
    "case_change",
    "sort_digits",
    "count_letter",
    "lookup",
    "km_to_m",
    "date_format",
)

# The shipped default (DEFAULT_DATA) is generate_mixture() with these.
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "default"
DEFAULT_TOTAL = 3200
DEFAULT_HELDOUT_PER_FAMILY = 50
DEFAULT_SKEW = 32.0

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

# Two wordings per family, so that a family is not a single constant string.
_INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "add": ("Add the two numbers.", "What is the sum?"),
    "reverse": ("Reverse the word.", "Write the word backwards."),
    "case_change": ("Write the word in upper case.", "Write the word in lower case."),
    "sort_digits": ("Sort the digits in ascending order.", "Put the digits in increasing order."),
    "count_letter": ("Count the letter in the word.", "How many times does the letter occur?"),
    "lookup": ("Give the value of the key.", "Look up the key."),
    "km_to_m": ("Convert kilometres to metres.", "How many metres is this?"),
    "date_format": ("Rewrite the date as DD/MM/YYYY.", "Write the date day first."),
}

Record = dict[str, str]
PathLike = Union[str, os.PathLike]


def _pseudo_word(rng: random.Random, min_syllables: int = 2, max_syllables: int = 3) -> str:
    """A pronounceable lower-case non-word such as 'tomaki' (a large, cheap space of words)."""
    syllables = rng.randint(min_syllables, max_syllables)
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def _random_date(rng: random.Random) -> dt.date:
    return dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(100 * 365))


def _format_km(tenths: int) -> str:
    """Kilometres given in tenths, written as '25' or '2.5' (no trailing '.0')."""
    whole, frac = divmod(tenths, 10)
    return f"{whole}.{frac}" if frac else str(whole)


# Each maker returns (instruction index, input, output); the instruction
# index matters for case_change, whose direction the wording states.
def _make_add(rng: random.Random) -> tuple[int, str, str]:
    a, b = rng.randrange(1000), rng.randrange(1000)
    return rng.randrange(2), f"{a} + {b}", str(a + b)


def _make_reverse(rng: random.Random) -> tuple[int, str, str]:
    word = _pseudo_word(rng)
    return rng.randrange(2), word, word[::-1]


def _make_case_change(rng: random.Random) -> tuple[int, str, str]:
    word = _pseudo_word(rng)
    if rng.randrange(2) == 0:
        return 0, word, word.upper()
    return 1, word.upper(), word


def _make_sort_digits(rng: random.Random) -> tuple[int, str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 7)))
    return rng.randrange(2), digits, "".join(sorted(digits))


def _make_count_letter(rng: random.Random) -> tuple[int, str, str]:
    word = _pseudo_word(rng, 2, 4)
    # Mostly a letter of the word, sometimes one it lacks, so 0 is a possible answer.
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(_CONSONANTS + _VOWELS)
    return rng.randrange(2), f"{letter}: {word}", str(word.count(letter))


def _make_lookup(rng: random.Random) -> tuple[int, str, str]:
    keys = rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(3, 4))
    values = [str(rng.randrange(100)) for _ in keys]
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, values))
    index = rng.randrange(len(keys))
    return rng.randrange(2), f"{pairs}; {keys[index]}", values[index]


def _make_km_to_m(rng: random.Random) -> tuple[int, str, str]:
    tenths = rng.randint(1, 9999)
    return rng.randrange(2), f"{_format_km(tenths)} km", f"{tenths * 100} m"


def _make_date_format(rng: random.Random) -> tuple[int, str, str]:
    date = _random_date(rng)
    return rng.randrange(2), date.isoformat(), date.strftime("%d/%m/%Y")


_MAKERS: dict[str, Callable[[random.Random], tuple[int, str, str]]] = {
    "add": _make_add,
    "reverse": _make_reverse,
    "case_change": _make_case_change,
    "sort_digits": _make_sort_digits,
    "count_letter": _make_count_letter,
    "lookup": _make_lookup,
    "km_to_m": _make_km_to_m,
    "date_format": _make_date_format,
}


def family_sizes(total: int, skew: float, families: Iterable[str] = FAMILIES) -> dict[str, int]:
    """Geometric training sizes summing to ``total``; largest / smallest is about ``skew``.

    Rounding is by largest remainder so the sizes add up exactly.
    """
    names = list(families)
    if total < len(names):
        raise ValueError(f"total={total} is smaller than the number of families ({len(names)})")
    if skew < 1.0:
        raise ValueError(f"skew must be >= 1, got {skew}")
    steps = max(len(names) - 1, 1)
    weights = [skew ** ((steps - i) / steps) for i in range(len(names))]
    exact = [total * w / sum(weights) for w in weights]
    sizes = [max(int(x), 1) for x in exact]
    by_remainder = sorted(range(len(names)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return dict(zip(names, sizes))


def _unique_records(family: str, count: int, rng: random.Random) -> list[Record]:
    """``count`` records of one family, no two with the same (instruction, input)."""
    seen: set[tuple[str, str]] = set()
    records: list[Record] = []
    attempts = 0
    while len(records) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise RuntimeError(f"family {family!r} cannot produce {count} distinct records")
        wording, task_input, output = _MAKERS[family](rng)
        instruction = _INSTRUCTIONS[family][wording]
        if (instruction, task_input) in seen:
            continue
        seen.add((instruction, task_input))
        records.append({"instruction": instruction, "input": task_input, "output": output, "family": family})
    return records


def generate_mixture(
    seed: int = 0,
    total: int = DEFAULT_TOTAL,
    heldout_per_family: int = DEFAULT_HELDOUT_PER_FAMILY,
    skew: float = DEFAULT_SKEW,
) -> tuple[list[Record], list[Record]]:
    """The skewed training mixture and a held-out split of ``heldout_per_family`` per family.

    Held-out records never share an (instruction, input) with a training
    record. The training list is shuffled (families interleaved); the held-out
    list is grouped by family. Same arguments, same records.
    """
    sizes = family_sizes(total, skew)
    train: list[Record] = []
    heldout: list[Record] = []
    for index, family in enumerate(FAMILIES):
        # One generator per family: a family's records do not depend on the others' sizes.
        rng = random.Random(f"ds_cluster.tasks:{seed}:{index}:{family}")
        records = _unique_records(family, sizes[family] + heldout_per_family, rng)
        heldout.extend(records[:heldout_per_family])
        train.extend(records[heldout_per_family:])
    random.Random(f"ds_cluster.tasks.shuffle:{seed}").shuffle(train)
    return train, heldout


def generate_pretraining_corpus(seed: int, n: int) -> list[str]:
    """``n`` generic texts over the same characters and formats, but none of the fine-tune tasks.

    The tiny base model learns the prompt template, the end of a response,
    words, numbers, dates, ``k=v`` lists and measurements from these, by
    copying and free text, so fine-tuning has something to build on without
    having seen the tasks it is evaluated on.
    """
    rng = random.Random(f"ds_cluster.pretrain:{seed}")

    def snippet() -> str:
        kind = rng.randrange(5)
        if kind == 0:
            return " ".join(_pseudo_word(rng, 1, 3) for _ in range(rng.randint(1, 4)))
        if kind == 1:
            return " ".join(str(rng.randrange(10 ** rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        if kind == 2:
            return _random_date(rng).isoformat() if rng.random() < 0.5 else _random_date(rng).strftime("%d/%m/%Y")
        if kind == 3:
            keys = rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(2, 4))
            return ", ".join(f"{k}={rng.randrange(100)}" for k in keys)
        unit = rng.choice(("km", "m"))
        return f"{_format_km(rng.randint(1, 9999))} {unit}"

    # Copy-style instructions: they teach the template and where a response ends.
    copy_instructions = ("Repeat the text.", "Copy the input.", "Say it again.", "Echo this.")
    texts: list[str] = []
    for _ in range(n):
        # Mostly copying: it is the skill every fine-tune task builds on, and the slowest to appear.
        style = rng.choices((0, 1, 2), weights=(6, 2, 2))[0]
        if style == 0:
            text = snippet()
            record = {"instruction": rng.choice(copy_instructions), "input": text, "output": text}
            texts.append(format_prompt(record) + text)
        elif style == 1:
            word = _pseudo_word(rng)
            record = {"instruction": f"Say {word}.", "input": "", "output": word}
            texts.append(format_prompt(record) + word)
        else:
            texts.append(". ".join(snippet() for _ in range(rng.randint(1, 3))) + ".")
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic instruction mixture as JSONL.")
    parser.add_argument("--out", required=True, help="folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total", type=int, default=DEFAULT_TOTAL, help="training records in all")
    parser.add_argument("--heldout-per-family", type=int, default=DEFAULT_HELDOUT_PER_FAMILY)
    parser.add_argument("--skew", type=float, default=DEFAULT_SKEW, help="largest / smallest family size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    train, heldout = generate_mixture(args.seed, args.total, args.heldout_per_family, args.skew)
    out = Path(args.out)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(heldout, out / "heldout.jsonl")
    sizes = {family: sum(r["family"] == family for r in train) for family in FAMILIES}
    logger.info("wrote %d train and %d held-out records to %s; train sizes %s", len(train), len(heldout), out, sizes)


if __name__ == "__main__":
    main()
