"""The targeted instrument's targets: which task groups a user "cares about", the few examples that describe them
(drawn from the validation split by whole underlying examples), the pool they select from, the checks that nothing
leaks, and the baselines' subsets that need no model (the label oracle, the lexical control).

A target is one task group, two groups in one file (each example names its group in its `target` field), or a
transfer target: a group removed from the pool, so no record of it can be selected and no oracle exists. Target
examples are drawn per seed (each draw paired with that seed's training), K records a group, whole example groups
(`example_id`: one underlying example under several templates) at a time; a group larger than what is still needed
is trimmed, and every record of a drawn example group is left out of the validation records that score that draw.
"""
from __future__ import annotations

import random
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ds_cluster.data.dataset import prompt_text, task_group, write_jsonl

TARGET_FIELD = "target"  # the field of a target example that names its group (the library's group_field)
# Validation is a quarter of every family here (the instrument's 10% leaves topic classification 28 records): the
# target examples are drawn from it, and what is left of the target group scores the choice.
TARGETED_VALIDATION_FRACTION = 0.25
DRAW_SEED = 0x7A96E7


@dataclass(frozen=True)
class Target:
    """One target: its name, the task groups it is made of, and whether its groups are out of the pool."""

    name: str
    groups: tuple[str, ...]
    transfer: bool = False

    @property
    def single(self) -> bool:
        """A single in-pool group: what the headline averages over."""
        return len(self.groups) == 1 and not self.transfer


@dataclass(frozen=True)
class TargetDraw:
    """One seed's examples of one target: the records (each with its `target` field), the example groups they came
    from (all of their records are out of that seed's validation scoring), and where they are written."""

    target: Target
    seed: int
    examples: list = field(default_factory=list)
    example_groups: frozenset = frozenset()
    path: Optional[Path] = None


def targets_of(families: Sequence[str], pairs: Iterable[Sequence[str]] = (), transfer: Iterable[str] = ()
               ) -> list[Target]:
    """Every family alone, the declared pairs (two groups in one target file), and the transfer targets."""
    known = set(families)
    targets = [Target(family, (family,)) for family in families]
    for pair in pairs:
        missing = set(pair) - known
        if missing or len(pair) != 2:
            raise ValueError(f"a two-group target needs two of the mixture's groups, got {list(pair)}")
        targets.append(Target("+".join(pair), tuple(pair)))
    for family in transfer:
        if family not in known:
            raise ValueError(f"transfer target {family!r} is not a group of the mixture ({sorted(known)})")
        targets.append(Target(f"transfer_{family}", (family,), transfer=True))
    return targets


def group_of(record: Mapping[str, Any], index: int) -> str:
    """A record's underlying example: its `example_id`, else the record alone."""
    return str(record.get("example_id", f"#{index}"))


def draw_examples(validation: Sequence[Mapping[str, Any]], target: Target, per_group: int, seed: int) -> TargetDraw:
    """`per_group` validation records of each of the target's groups, whole example groups in a seeded order (the
    last one trimmed), each record marked with its group in TARGET_FIELD."""
    rng = random.Random(f"{DRAW_SEED}:{target.name}:{seed}")
    examples: list[dict] = []
    taken_groups: set[str] = set()
    for group in target.groups:
        by_example: dict[str, list[dict]] = defaultdict(list)
        for index, record in enumerate(validation):
            if task_group(record) == group:
                by_example[group_of(record, index)].append(dict(record))
        names = sorted(by_example)
        available = sum(len(members) for members in by_example.values())
        if available < 2 * per_group:
            raise ValueError(f"target {target.name}: group {group!r} has {available} validation records, fewer than "
                             f"twice the {per_group} examples to draw (what is left scores the choice)")
        wanted = per_group
        for name in rng.sample(names, len(names)):
            if wanted <= 0:
                break
            members = by_example[name][:wanted]
            examples += [{**record, TARGET_FIELD: group} for record in members]
            taken_groups.add(name)
            wanted -= len(members)
    return TargetDraw(target, seed, examples, frozenset(taken_groups))


def write_draw(draw: TargetDraw, folder: Path) -> TargetDraw:
    """The draw's examples as a target file (JSONL, the records' own fields plus `target`)."""
    path = folder / f"{draw.target.name}_s{draw.seed}.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(draw.examples, path)
    return TargetDraw(draw.target, draw.seed, draw.examples, draw.example_groups, path)


def _normalized(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def leakage(draw: TargetDraw, pool: Sequence[Mapping[str, Any]], heldout: Sequence[Mapping[str, Any]]
            ) -> dict[str, int]:
    """What the draw's examples share with the pool and held-out: example groups, and records with the same
    normalized prompt (a template applied to the same example). All zero for a sound draw."""
    pool_groups = {group_of(record, index) for index, record in enumerate(pool) if "example_id" in record}
    heldout_groups = {group_of(record, index) for index, record in enumerate(heldout) if "example_id" in record}
    prompts = {_normalized(prompt_text(record)) for record in draw.examples}
    return {"example_groups_in_pool": len(draw.example_groups & pool_groups),
            "example_groups_in_heldout": len(draw.example_groups & heldout_groups),
            "prompts_in_pool": sum(_normalized(prompt_text(record)) in prompts for record in pool),
            "prompts_in_heldout": sum(_normalized(prompt_text(record)) in prompts for record in heldout)}


def pool_mask(pool: Sequence[Mapping[str, Any]], target: Target) -> np.ndarray:
    """(N,) bool: the pool records a target's arms may select (a transfer target's groups left out)."""
    if not target.transfer:
        return np.ones(len(pool), dtype=bool)
    return np.array([task_group(record) not in target.groups for record in pool])


def oracle_subset(pool: Sequence[Mapping[str, Any]], target: Target, budget: int, seed: int) -> np.ndarray:
    """The label oracle: the budget drawn from the target's groups (evenly over them, random within), random from
    the rest of the pool beyond what they hold. Sorted indices."""
    rng = np.random.default_rng([seed, 0x0AC1E])
    members = [np.flatnonzero([task_group(record) == group for record in pool]) for group in target.groups]
    share = budget // len(members)
    chosen = [rng.permutation(group)[:share] for group in members]
    taken = np.concatenate(chosen)
    rest = np.setdiff1d(np.arange(len(pool)), taken)
    extra = rng.permutation(rest)[:budget - taken.size]
    return np.sort(np.concatenate([taken, extra])).astype(np.int64)


def lexical_subset(pool: Sequence[Mapping[str, Any]], draw: TargetDraw, budget: int, allowed: np.ndarray
                   ) -> np.ndarray:
    """The lexical control: hashed word 1- and 2-grams of prompt and answer (scikit-learn's HashingVectorizer, with
    TF-IDF weights fitted on the pool), cosine to the target examples, then the same round-robin as the targeted
    rule (each example in turn takes its most similar record not yet taken; over groups, each group's score is its
    best example's). Sorted indices of `budget` records among `allowed`."""
    from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer

    def text(record: Mapping[str, Any]) -> str:
        return f"{prompt_text(record)} {record.get('output', '')}"

    vectorizer = HashingVectorizer(ngram_range=(1, 2), n_features=2 ** 18, alternate_sign=False, norm=None)
    pool_counts = vectorizer.transform([text(record) for record in pool])
    tfidf = TfidfTransformer().fit(pool_counts)
    pool_rows = tfidf.transform(pool_counts)
    target_rows = tfidf.transform(vectorizer.transform([text(record) for record in draw.examples]))
    similarity = np.asarray((target_rows @ pool_rows.T).todense())  # (examples, pool); rows L2-normalised
    similarity[:, ~allowed] = -np.inf
    groups = [str(record[TARGET_FIELD]) for record in draw.examples]
    return round_robin(similarity, groups, budget)


def round_robin(similarity: np.ndarray, groups: Sequence[str], budget: int) -> np.ndarray:
    """RDS+'s selection on a (target examples x pool) similarity: within a group, its examples take turns, each its
    most similar record not yet taken; with several groups, the groups take turns. Sorted indices."""
    names = sorted(set(groups))
    orders = {name: [np.argsort(-similarity[row], kind="stable") for row, group in enumerate(groups)
                     if group == name] for name in names}
    cursors = {name: [0] * len(orders[name]) for name in names}
    turn = {name: 0 for name in names}
    taken: list[int] = []
    seen = np.zeros(similarity.shape[1], dtype=bool)
    seen[~np.isfinite(similarity).any(axis=0)] = True  # records no target may take
    while len(taken) < budget and not seen.all():
        for name in names:
            if len(taken) >= budget:
                break
            example = turn[name] % len(orders[name])
            turn[name] += 1
            order, cursor = orders[name][example], cursors[name][example]
            while cursor < order.size and seen[order[cursor]]:
                cursor += 1
            cursors[name][example] = cursor
            if cursor < order.size:
                seen[order[cursor]] = True
                taken.append(int(order[cursor]))
    return np.sort(np.asarray(taken, dtype=np.int64))
