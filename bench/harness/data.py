"""A run's data: the train / validation / held-out files it writes in its work folder, the label families that
exact match is scored on, the labels-only analyses and the near-duplicate groups (`prepare_data`).

Validation is carved from train (VALIDATION_FRACTION of every family, at least VALIDATION_MIN, a fixed split seed);
every choice is made on it, never on held-out.
"""
from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from bench.harness.instrument import Settings, data_file
from ds_cluster.data.dataset import prompt_text, read_jsonl, write_jsonl

VALIDATION_FRACTION = 0.1
VALIDATION_MIN = 12
SPLIT_SEED = 20261130
# A family's answers are labels (greedy exact match is scored on it) when its CATEGORICAL_TOP_ANSWERS
# most frequent distinct answers (whitespace stripped) cover at least CATEGORICAL_COVERAGE_MIN of its
# records in the whole training file (before any slice). On the T0 slice: paraphrase 1.00, topic 1.00,
# sentiment 0.92 are labels; closed-book QA 0.55, multiple choice 0.25, summaries 0.21 and generated sentences 0.13
# are not.
CATEGORICAL_TOP_ANSWERS = 20
CATEGORICAL_COVERAGE_MIN = 0.9


@dataclass(frozen=True)
class PreparedData:
    """The files a run trains and evaluates on, and what the report and the job's spec say of them."""

    paths: dict[str, Path]  # "train", "validation", "heldout": WORK/data/NAME.jsonl
    families: list[str]  # the training split's families, sorted
    sizes: dict[str, int]  # training records per family
    num_train: int
    exact_match_families: list[str]  # the label families greedy exact match is scored on
    near_duplicates: dict[str, Any]  # the near-duplicate groups' summary (bench/near_duplicates.py)

    @property
    def small_families(self) -> list[str]:
        """The smaller half of the families by training records (the synthetic gate reads them)."""
        return sorted(self.sizes, key=lambda family: self.sizes[family])[:len(self.sizes) // 2]


def carve_validation(records: list[dict], fraction: float = VALIDATION_FRACTION, minimum: int = VALIDATION_MIN,
                     seed: int = SPLIT_SEED) -> tuple[list[dict], list[dict]]:
    """(train, validation): `fraction` of every family (at least `minimum`) held out of train, seeded.

    Records with an `example_id` (the real slices: one underlying example under several templates)
    go to validation a whole example group at a time, so no example is on both sides.
    """
    if not any("example_id" in record for record in records):
        return _carve_records(records, fraction, minimum, seed)
    by_family: dict[str, dict[str, list[dict]]] = {}
    for index, record in enumerate(records):
        group = str(record.get("example_id", f"#{index}"))
        by_family.setdefault(str(record.get("family", "")), {}).setdefault(group, []).append(record)
    rng = random.Random(seed)
    validation_ids: set[int] = set()
    for family in sorted(by_family):
        groups = by_family[family]
        size = sum(len(members) for members in groups.values())
        count = min(max(minimum, round(fraction * size)), size // 2)
        taken = 0
        for name in rng.sample(sorted(groups), len(groups)):
            if taken >= count:
                break
            if taken + len(groups[name]) > max(count, size // 2):
                continue  # a large group would take more than half the family
            validation_ids.update(id(r) for r in groups[name])
            taken += len(groups[name])
    return ([r for r in records if id(r) not in validation_ids], [r for r in records if id(r) in validation_ids])


def _carve_records(records: list[dict], fraction: float, minimum: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The split of records without example groups (the synthetic mixtures), as the recorded results used."""
    by_family: dict[str, list[dict]] = {}
    for record in records:
        by_family.setdefault(str(record.get("family", "")), []).append(record)
    rng = random.Random(seed)
    validation_ids: set[int] = set()
    for family in sorted(by_family):
        members = by_family[family]
        count = min(max(minimum, round(fraction * len(members))), len(members) // 2)
        validation_ids.update(id(r) for r in rng.sample(members, count))
    return ([r for r in records if id(r) not in validation_ids], [r for r in records if id(r) in validation_ids])


def seeded_share(records: list[dict], fraction: float, seed: int = SPLIT_SEED) -> list[dict]:
    """The same share of every family, whole underlying examples at a time (records with one `example_id`
    stay together, so a validation split carved from it is still split by example), seeded; in file order."""
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, record in enumerate(records):
        groups[str(record.get("family", ""))][str(record.get("example_id", f"#{index}"))].append(index)
    rng = random.Random(seed)
    chosen: list[int] = []
    for family in sorted(groups):
        names = sorted(groups[family])
        want = round(fraction * sum(len(members) for members in groups[family].values()))
        for name in rng.sample(names, len(names)):
            if want <= 0:
                break
            chosen += groups[family][name]
            want -= len(groups[family][name])
    return [records[index] for index in sorted(chosen)]


def categorical_families(records: Sequence[Mapping[str, Any]], top: int = CATEGORICAL_TOP_ANSWERS,
                         coverage: float = CATEGORICAL_COVERAGE_MIN) -> list[str]:
    """The families whose answers are labels: their `top` most frequent answers cover >= `coverage` of them."""
    answers: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        answers[str(record.get("family", ""))][str(record.get("output", "")).strip()] += 1
    return sorted(family for family, counts in answers.items()
                  if sum(n for _, n in counts.most_common(top)) >= coverage * sum(counts.values()))


def to_chat_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """An Alpaca record as a chat record: a user turn (the instruction and input as plain text) and an assistant
    turn (the answer); its other fields (family, example_id, ...) kept, `output` too: the reference answer that
    exact match reads."""
    kept = {key: value for key, value in record.items() if key not in ("instruction", "input")}
    return {**kept, "messages": [{"role": "user", "content": prompt_text(record)},
                                 {"role": "assistant", "content": record["output"]}]}


def prepare_data(settings: Settings) -> PreparedData:
    """Train / validation / held-out files in the work folder, the labels-only analyses, the near-duplicate groups."""
    from bench.near_duplicates import compute_groups

    train_all = read_jsonl(data_file(settings.data, "train"))
    heldout = read_jsonl(data_file(settings.data, "heldout"))
    # A mixture may name its task groups `category` (ds_cluster.data.dataset.task_group): the harness reads `family`.
    for record in train_all + heldout:
        if "family" not in record and "category" in record:
            record["family"] = record["category"]
    if not all("family" in r for r in train_all + heldout):
        raise ValueError(f"{settings.data}: every record needs a task group ('family' or 'category')")
    # Whether a family's answers are labels is a property of the family: judged on the whole train file, since
    # in a small slice every answer of a free-text family (a few underlying examples) is among the most frequent.
    exact_match = categorical_families(train_all)
    if settings.train_fraction < 1.0:
        train_all = seeded_share(train_all, settings.train_fraction)
    if settings.prompt not in ("alpaca", "chat"):
        raise SystemExit(f"prompt: 'alpaca' or 'chat', got {settings.prompt!r}")
    if settings.prompt == "chat":
        train_all, heldout = [to_chat_record(r) for r in train_all], [to_chat_record(r) for r in heldout]
    train, validation = carve_validation(train_all, settings.validation_fraction or VALIDATION_FRACTION)
    if settings.heldout_per_family is not None:
        taken: dict[str, int] = {}
        heldout = [r for r in heldout if taken.setdefault(r["family"], 0) < settings.heldout_per_family
                   and not taken.__setitem__(r["family"], taken[r["family"]] + 1)]
    folder = settings.work_dir / "data"
    paths = {name: folder / f"{name}.jsonl" for name in ("train", "validation", "heldout")}
    for name, records in (("train", train), ("validation", validation), ("heldout", heldout)):
        write_jsonl(records, paths[name])
    families = sorted({r["family"] for r in train})
    sizes = {f: sum(r["family"] == f for r in train) for f in families}
    analyses_root = settings.work_dir / "analyses"
    for name, labels in (("one_cluster", np.zeros(len(train), dtype=np.int64)),
                         ("families", np.array([families.index(r["family"]) for r in train], dtype=np.int64))):
        (analyses_root / name).mkdir(parents=True, exist_ok=True)
        np.save(analyses_root / name / "labels.npy", labels)
    near = analyses_root / "near_duplicates"
    if not (near / "groups.npy").exists():
        compute_groups(train, near)
    # The synthetic families are all short exact strings: exact match is scored on every one of them.
    if settings.instrument == "synthetic":
        exact_match = families
    return PreparedData(paths=paths, families=families, sizes=sizes, num_train=len(train),
                        exact_match_families=exact_match,
                        near_duplicates=json.loads((near / "summary.json").read_text()))
