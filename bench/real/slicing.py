"""Shared steps that turn a real instruction mixture into a shipped train/held-out slice.

Both ``t0`` and ``flan_cot`` read their source into ``SourceRecord`` objects and then call
``build_slice``, which

1. drops records whose prompt or completion is empty after stripping,
2. keeps prompts of at most ``max_prompt_tokens`` and completions of at most
   ``max_completion_tokens`` tokens (the stories260K tokenizer, no special tokens),
3. removes exact duplicates (same prompt and completion; the first in source order is kept),
4. drops families with fewer than ``min_family_records`` records left,
5. groups the records that render the same underlying example (``example_groups.example_group_ids``: one
   example under several templates, several answers to one prompt, near-duplicate source
   examples) and stamps every record with its group's ``example_id`` (``"<dataset>:<n>"``),
6. per family, holds out whole example groups (seeded; at most ``max_heldout_group_share`` of the
   family's groups and at most ``heldout_per_family``): the held-out split takes their records one
   group at a time in rounds (one record per group per round) up to ``heldout_per_family`` records,
   and their other records are dropped, so no example group is on both sides,
7. samples the same fraction of every family's remaining records so that train has about
   ``train_size`` records (never more than there are): the natural skew between families is kept.

The files are written as gzip'd JSON lines with a fixed gzip header (no name, mtime 0), so a
rebuild from the same source gives the same bytes.
"""
from __future__ import annotations

import logging
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from tqdm import tqdm

from bench.real.example_groups import example_group_ids
from bench.real.records import SourceRecord

logger = logging.getLogger(__name__)

TRAIN_FILE = "train.jsonl.gz"
HELDOUT_FILE = "heldout.jsonl.gz"
TOKENIZE_BATCH = 2048


@dataclass(frozen=True)
class SliceSettings:
    """What ``build_slice`` keeps; the defaults are those of the shipped slices."""

    max_prompt_tokens: int = 200
    max_completion_tokens: int = 40
    heldout_per_family: int = 150
    train_size: int = 9000
    min_family_records: int = 500
    seed: int = 0
    max_heldout_group_share: float = 0.5  # held-out takes at most this share of a family's example groups


@dataclass
class SliceReport:
    """Counts along the way, for the README and the log."""

    source_records: int = 0
    empty_dropped: int = 0
    too_long_dropped: int = 0
    duplicates_dropped: int = 0
    families_dropped: dict[str, int] = field(default_factory=dict)
    example_groups_per_family: dict[str, int] = field(default_factory=dict)
    example_groups_per_dataset: dict[str, int] = field(default_factory=dict)
    records_in_shared_groups: int = 0  # records whose example group holds more than one record
    heldout_groups_per_family: dict[str, int] = field(default_factory=dict)
    heldout_group_records_dropped: int = 0  # records of held-out groups beyond the held-out records
    heldout_prompt_duplicates_dropped: int = 0
    pool_per_family: dict[str, int] = field(default_factory=dict)
    train_per_family: dict[str, int] = field(default_factory=dict)
    heldout_per_family: dict[str, int] = field(default_factory=dict)
    train_per_dataset: dict[str, int] = field(default_factory=dict)


def load_stories260k_tokenizer() -> Any:
    """The stories260K tokenizer shipped in this package (loads offline, needs only ``tokenizers``)."""
    from transformers import AutoTokenizer

    from bench.real import STORIES260K_DIR

    return AutoTokenizer.from_pretrained(STORIES260K_DIR)


def count_tokens(texts: Sequence[str], tokenizer: Any, description: str = "tokenizing") -> list[int]:
    """Token counts of ``texts`` without special tokens, in batches."""
    counts: list[int] = []
    for start in tqdm(range(0, len(texts), TOKENIZE_BATCH), desc=description, disable=len(texts) < 10 * TOKENIZE_BATCH):
        batch = list(texts[start : start + TOKENIZE_BATCH])
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        counts.extend(len(ids) for ids in encoded)
    return counts


def build_slice(
    records: Sequence[SourceRecord], tokenizer: Any, settings: SliceSettings
) -> tuple[list[SourceRecord], list[SourceRecord], SliceReport]:
    """Filter, deduplicate, group and split ``records`` (in source order) into (train, held-out, report)."""
    report = SliceReport(source_records=len(records))
    kept = _filter_records(records, tokenizer, settings, report)
    kept = [replace(record, example_id=example_id) for record, example_id in zip(kept, example_group_ids(kept))]
    by_family = _drop_small_families(kept, settings, report)
    _count_example_groups(by_family, report)
    heldout, pools = _split_heldout(by_family, settings, report)
    train = _sample_train(pools, settings, report)
    report.train_per_dataset = dict(sorted(Counter(r.dataset for r in train).items()))
    logger.info("slice: %d train, %d held-out from %d source records", len(train), len(heldout), len(records))
    return train, heldout, report


def _filter_records(
    records: Sequence[SourceRecord], tokenizer: Any, settings: SliceSettings, report: SliceReport
) -> list[SourceRecord]:
    """Records with a non-empty prompt and completion within the token limits, exact duplicates removed."""
    nonempty = [r for r in records if r.prompt.strip() and r.completion.strip()]
    report.empty_dropped = len(records) - len(nonempty)
    prompt_tokens = count_tokens([r.prompt for r in nonempty], tokenizer, "prompt tokens")
    completion_tokens = count_tokens([r.completion for r in nonempty], tokenizer, "completion tokens")
    short = [
        r
        for r, n_prompt, n_completion in zip(nonempty, prompt_tokens, completion_tokens)
        if n_prompt <= settings.max_prompt_tokens and n_completion <= settings.max_completion_tokens
    ]
    report.too_long_dropped = len(nonempty) - len(short)
    seen: set[tuple[str, str]] = set()
    distinct: list[SourceRecord] = []
    for record in short:
        key = (record.prompt, record.completion)
        if key not in seen:
            seen.add(key)
            distinct.append(record)
    report.duplicates_dropped = len(short) - len(distinct)
    return distinct


def _drop_small_families(
    records: list[SourceRecord], settings: SliceSettings, report: SliceReport
) -> dict[str, list[SourceRecord]]:
    """Records by family, without the families that have fewer than ``min_family_records``."""
    by_family: dict[str, list[SourceRecord]] = defaultdict(list)
    for record in records:
        by_family[record.family].append(record)
    for family in sorted(by_family):
        if len(by_family[family]) < settings.min_family_records:
            report.families_dropped[family] = len(by_family.pop(family))
            logger.warning(
                "family %s dropped: %d records left after the filter (< %d)",
                family,
                report.families_dropped[family],
                settings.min_family_records,
            )
    return dict(by_family)


def _count_example_groups(by_family: dict[str, list[SourceRecord]], report: SliceReport) -> None:
    """Example groups per family and per dataset, and the records that share their group, into ``report``."""
    sizes = Counter(r.example_id for records in by_family.values() for r in records)
    for family, records in sorted(by_family.items()):
        report.example_groups_per_family[family] = len({r.example_id for r in records})
    datasets = Counter(example_id.rsplit(":", 1)[0] for example_id in sizes)
    report.example_groups_per_dataset = dict(sorted(datasets.items()))
    report.records_in_shared_groups = sum(size for size in sizes.values() if size > 1)
    logger.info("example groups: %d for %d records (%d records share their group)",
                len(sizes), sum(sizes.values()), report.records_in_shared_groups)


def _split_heldout(
    by_family: dict[str, list[SourceRecord]], settings: SliceSettings, report: SliceReport
) -> tuple[list[SourceRecord], dict[str, list[SourceRecord]]]:
    """(held-out records from whole example groups, per family; the train pool per family).

    Per family the example groups are shuffled (seeded) and the first
    ``min(heldout_per_family, max_heldout_group_share * groups)`` are held out. Held-out takes their
    records in rounds, one record of every held-out group a round (each group's records in a seeded
    order), until it has ``heldout_per_family`` records or the groups run out; the rest of those
    groups' records are dropped. The pool is every record of the other groups, less any record whose
    prompt is held out in another family; it is shuffled (seeded).
    """
    heldout: list[SourceRecord] = []
    pools: dict[str, list[SourceRecord]] = {}
    for family in sorted(by_family):
        groups: dict[str, list[SourceRecord]] = defaultdict(list)
        for record in by_family[family]:
            groups[record.example_id].append(record)
        group_ids = sorted(groups)
        group_count = min(settings.heldout_per_family, int(len(group_ids) * settings.max_heldout_group_share))
        if group_count < 1:
            raise ValueError(f"family {family}: {len(group_ids)} example groups, too few to hold any out")
        rng = random.Random(f"{settings.seed}/{family}")
        rng.shuffle(group_ids)
        queues = [rng.sample(groups[example_id], len(groups[example_id])) for example_id in group_ids[:group_count]]
        family_heldout: list[SourceRecord] = []
        for round_number in range(max(len(queue) for queue in queues)):
            for queue in queues:
                if round_number < len(queue) and len(family_heldout) < settings.heldout_per_family:
                    family_heldout.append(queue[round_number])
        heldout.extend(family_heldout)
        report.heldout_per_family[family] = len(family_heldout)
        report.heldout_groups_per_family[family] = group_count
        report.heldout_group_records_dropped += sum(len(queue) for queue in queues) - len(family_heldout)
        pools[family] = [r for example_id in group_ids[group_count:] for r in groups[example_id]]
        if len(family_heldout) < settings.heldout_per_family:
            logger.warning("family %s: %d held-out records from %d example groups (fewer than %d)",
                           family, len(family_heldout), group_count, settings.heldout_per_family)
    heldout_prompts = {r.prompt for r in heldout}  # a prompt may recur in another family
    for family, pool in pools.items():
        kept = [r for r in pool if r.prompt not in heldout_prompts]
        report.heldout_prompt_duplicates_dropped += len(pool) - len(kept)
        random.Random(f"{settings.seed}/{family}/train").shuffle(kept)
        pools[family] = kept
        report.pool_per_family[family] = len(kept)
    return heldout, pools


def _sample_train(
    pools: dict[str, list[SourceRecord]], settings: SliceSettings, report: SliceReport
) -> list[SourceRecord]:
    """One fraction of every family's pool, about ``train_size`` records in all, in a seeded order."""
    pool_total = sum(len(pool) for pool in pools.values())
    target = min(settings.train_size, pool_total)
    fraction = target / pool_total if pool_total else 0.0
    shares = {family: fraction * len(pool) for family, pool in pools.items()}
    keep = {family: int(share) for family, share in shares.items()}
    # largest remainders first, so that the families add up to the target exactly
    by_remainder = sorted(shares, key=lambda family: (keep[family] - shares[family], family))
    for family in by_remainder[: target - sum(keep.values())]:
        keep[family] += 1
    train: list[SourceRecord] = []
    for family in sorted(pools):
        train.extend(pools[family][: keep[family]])
        report.train_per_family[family] = keep[family]
    random.Random(f"{settings.seed}/order").shuffle(train)
    logger.info("train: %.3f of each family's pool", fraction)
    return train
