"""A synthetic instruction mixture whose answers can be checked exactly.

Eight character-transformation families with strongly skewed (geometric)
sizes stand in for a real instruction mixture such as Alpaca: a few families
dominate and the smallest is 16 times smaller, which is the situation
cluster-balanced sampling is meant for. Every record is Alpaca-style
``{"instruction", "input", "output", "family"}``; ``family`` is metadata for
analysis and is never part of the training text.

Letter inputs are 3 to 8 uniformly random letters (not words), so a family
cannot be memorised: it has to be learned as an operation on top of the base
model's copying (bench.toy.pretraining). Everything is derived from one
seed through local generators (no global RNG).

Run ``python -m bench.toy.tasks --out DIR --seed S`` to write
``train.jsonl`` and ``heldout.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import random
from pathlib import Path
from typing import Callable, Optional, Sequence

from ds_cluster.data.dataset import write_jsonl

logger = logging.getLogger(__name__)

# Largest family first: sizes fall geometrically along this order. The three
# that need the most data to learn (reverse, rotate, swap_case) hold the
# largest slots; put in a small slot they are not learned at all, and the
# benchmark could no longer tell a good subset from a bad one.
FAMILIES: tuple[str, ...] = (
    "reverse", "rotate", "swap_case", "date_reorder", "double", "first_last", "dashes", "km_to_m",
)

# The shipped default (DEFAULT_DATA) is generate_mixture() with these.
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "default"
DEFAULT_TOTAL = 2400
DEFAULT_HELDOUT_PER_FAMILY = 100
DEFAULT_SKEW = 16.0

# The confirmation mixture: another seed, total and skew, and another order (shuffled, with
# date_reorder and first_last trading halves: date_reorder gets a 52-record slot, which a base model
# pretrained longer does not learn; bench/results/archive/README.md). Nothing is chosen on it.
SECOND_MIXTURE: dict = {
    "seed": 3, "total": 2600, "skew": 24.0, "heldout_per_family": 100,
    "families": ("rotate", "swap_case", "reverse", "first_last", "km_to_m", "double", "date_reorder", "dashes"),
}

LOWER = "abcdefghijklmnopqrstuvwxyz"

# Two short wordings per family: the prompt is most of every sequence.
INSTRUCTIONS: dict[str, tuple[str, str]] = {
    "reverse": ("Reverse the letters.", "Write it backwards."),
    "rotate": ("Move the first letter to the end.", "Rotate left by one."),
    "swap_case": ("Swap the case.", "Invert the case of each letter."),
    "date_reorder": ("Rewrite as DD/MM/YYYY.", "Write the date day first."),
    "double": ("Double each letter.", "Write each letter twice."),
    "first_last": ("Give the first and last letter.", "First and last letter."),
    "dashes": ("Put dashes between letters.", "Join the letters with dashes."),
    "km_to_m": ("Convert km to m.", "How many metres is this?"),
}

Record = dict[str, str]


def letters(rng: random.Random, low: int = 3, high: int = 8, alphabet: str = LOWER) -> str:
    """``low`` to ``high`` letters drawn uniformly from ``alphabet``."""
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    text = letters(rng)
    return text, text[::-1]


def _rotate(rng: random.Random) -> tuple[str, str]:
    while True:  # the answer must differ from the input
        text = letters(rng)
        if text[1:] + text[0] != text:
            return text, text[1:] + text[0]


def _swap_case(rng: random.Random) -> tuple[str, str]:
    text = letters(rng, alphabet=LOWER + LOWER.upper())
    return text, text.swapcase()


def _date_reorder(rng: random.Random) -> tuple[str, str]:
    date = dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(100 * 365))
    return date.isoformat(), date.strftime("%d/%m/%Y")


def _double(rng: random.Random) -> tuple[str, str]:
    text = letters(rng)
    return text, "".join(c + c for c in text)


def _first_last(rng: random.Random) -> tuple[str, str]:
    text = letters(rng)
    return text, text[0] + text[-1]


def _dashes(rng: random.Random) -> tuple[str, str]:
    text = letters(rng)
    return text, "-".join(text)


def _km_to_m(rng: random.Random) -> tuple[str, str]:
    km = rng.randint(1, 999)
    return f"{km} km", f"{km * 1000} m"


MAKERS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": _reverse, "rotate": _rotate, "swap_case": _swap_case, "date_reorder": _date_reorder,
    "double": _double, "first_last": _first_last, "dashes": _dashes, "km_to_m": _km_to_m,
}


def family_sizes(total: int, skew: float, families: Sequence[str] = FAMILIES) -> dict[str, int]:
    """Geometric training sizes summing to ``total``; first largest, largest / smallest about ``skew``.

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
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(names)), key=lambda i: exact[i] - sizes[i], reverse=True)
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return dict(zip(names, sizes))


def _family_records(family: str, count: int, rng: random.Random) -> list[Record]:
    """``count`` records of one family, no two with the same input."""
    seen: set[str] = set()
    records: list[Record] = []
    attempts = 0
    while len(records) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise RuntimeError(f"family {family!r} cannot produce {count} distinct records")
        task_input, output = MAKERS[family](rng)
        if task_input in seen:
            continue
        seen.add(task_input)
        instruction = INSTRUCTIONS[family][rng.randrange(2)]
        records.append({"instruction": instruction, "input": task_input, "output": output, "family": family})
    return records


def generate_mixture(
    seed: int = 0,
    total: int = DEFAULT_TOTAL,
    heldout_per_family: int = DEFAULT_HELDOUT_PER_FAMILY,
    skew: float = DEFAULT_SKEW,
    families: Sequence[str] = FAMILIES,
) -> tuple[list[Record], list[Record]]:
    """The skewed training mixture and a held-out split of ``heldout_per_family`` per family.

    Sizes fall geometrically along ``families``. Held-out records never share
    an input with a training record of their family. The training list is
    shuffled (families interleaved); the held-out list is grouped by family.
    Same arguments, same records.
    """
    unknown = sorted(set(families) - set(MAKERS))
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {sorted(MAKERS)}")
    sizes = family_sizes(total, skew, families)
    train: list[Record] = []
    heldout: list[Record] = []
    for family in families:
        # One generator per family: a family's records do not depend on the others' sizes.
        rng = random.Random(f"base.tasks:{seed}:{family}")
        records = _family_records(family, sizes[family] + heldout_per_family, rng)
        heldout.extend(records[:heldout_per_family])
        train.extend(records[heldout_per_family:])
    random.Random(f"base.tasks.shuffle:{seed}").shuffle(train)
    return train, heldout


def write_mixture(out: Path, **arguments) -> dict[str, int]:
    """generate_mixture(**arguments) written as ``out/train.jsonl`` and ``out/heldout.jsonl``; train sizes."""
    train, heldout = generate_mixture(**arguments)
    write_jsonl(train, Path(out) / "train.jsonl")
    write_jsonl(heldout, Path(out) / "heldout.jsonl")
    families = arguments.get("families", FAMILIES)
    return {family: sum(r["family"] == family for r in train) for family in families}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic instruction mixture as JSONL.")
    parser.add_argument("--out", required=True, help="folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total", type=int, default=DEFAULT_TOTAL, help="training records in all")
    parser.add_argument("--heldout-per-family", type=int, default=DEFAULT_HELDOUT_PER_FAMILY)
    parser.add_argument("--skew", type=float, default=DEFAULT_SKEW, help="largest / smallest family size")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, largest first")
    parser.add_argument("--second-mixture", action="store_true", help="the confirmation mixture (SECOND_MIXTURE)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    arguments = dict(seed=args.seed, total=args.total, heldout_per_family=args.heldout_per_family, skew=args.skew,
                     families=tuple(args.families.split(",")))
    if args.second_mixture:
        arguments = dict(SECOND_MIXTURE)
    sizes = write_mixture(Path(args.out), **arguments)
    logger.info("wrote %s to %s; train sizes %s", arguments, args.out, sizes)


if __name__ == "__main__":
    main()
