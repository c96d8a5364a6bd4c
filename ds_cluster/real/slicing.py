"""Shared steps that turn a real instruction mixture into a shipped train/held-out slice.

Both ``t0`` and ``flan_cot`` read their source into ``SourceRecord`` objects and then call
``build_slice``, which

1. drops records whose prompt or completion is empty after stripping,
2. keeps prompts of at most ``max_prompt_tokens`` and completions of at most
   ``max_completion_tokens`` tokens (the stories260K tokenizer, no special tokens),
3. removes exact duplicates (same prompt and completion; the first in source order is kept),
4. drops families with fewer than ``min_family_records`` records left,
5. per family, draws ``heldout_per_family`` distinct prompts (seeded) for the held-out split
   (one record each); every other record with one of those prompts is dropped, so no held-out
   prompt appears in train,
6. samples the same fraction of every family's remaining records so that train has about
   ``train_size`` records (never more than there are): the natural skew between families is kept.

The files are written as gzip'd JSON lines with a fixed gzip header (no name, mtime 0), so a
rebuild from the same source gives the same bytes.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from tqdm import tqdm

logger = logging.getLogger(__name__)

TRAIN_FILE = "train.jsonl.gz"
HELDOUT_FILE = "heldout.jsonl.gz"
TOKENIZE_BATCH = 2048


@dataclass(frozen=True)
class SourceRecord:
    """One prompt/completion pair as read from a source, with its group and origin."""

    prompt: str
    completion: str
    family: str
    dataset: str
    template: str
    extra: tuple[tuple[str, str], ...] = ()  # further fields written after the standard ones

    def to_alpaca(self) -> dict[str, str]:
        """The shipped record: Alpaca fields, then family, dataset, template and any extra fields."""
        record = {
            "instruction": self.prompt,
            "input": "",
            "output": self.completion,
            "family": self.family,
            "dataset": self.dataset,
            "template": self.template,
        }
        record.update(dict(self.extra))
        return record


@dataclass(frozen=True)
class SliceSettings:
    """What ``build_slice`` keeps; the defaults are those of the shipped slices."""

    max_prompt_tokens: int = 200
    max_completion_tokens: int = 40
    heldout_per_family: int = 150
    train_size: int = 9000
    min_family_records: int = 500
    seed: int = 0


@dataclass
class SliceReport:
    """Counts along the way, for the README and the log."""

    source_records: int = 0
    empty_dropped: int = 0
    too_long_dropped: int = 0
    duplicates_dropped: int = 0
    families_dropped: dict[str, int] = field(default_factory=dict)
    heldout_prompt_duplicates_dropped: int = 0
    pool_per_family: dict[str, int] = field(default_factory=dict)
    train_per_family: dict[str, int] = field(default_factory=dict)
    heldout_per_family: dict[str, int] = field(default_factory=dict)
    train_per_dataset: dict[str, int] = field(default_factory=dict)


def load_stories260k_tokenizer() -> Any:
    """The stories260K tokenizer shipped in this package (loads offline, needs only ``tokenizers``)."""
    from transformers import AutoTokenizer

    from ds_cluster.real import STORIES260K_DIR

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
    """Filter, deduplicate and split ``records`` (in source order) into (train, held-out, report)."""
    report = SliceReport(source_records=len(records))
    by_family = _drop_small_families(_filter_records(records, tokenizer, settings, report), settings, report)
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


def _split_heldout(
    by_family: dict[str, list[SourceRecord]], settings: SliceSettings, report: SliceReport
) -> tuple[list[SourceRecord], dict[str, list[SourceRecord]]]:
    """(held-out: ``heldout_per_family`` distinct prompts per family, one record each; the train pool per family).

    The pool has no record whose prompt is held out, in any family; it is shuffled (seeded).
    """
    heldout: list[SourceRecord] = []
    pools: dict[str, list[SourceRecord]] = {}
    for family in sorted(by_family):
        family_records = by_family[family]
        rng = random.Random(f"{settings.seed}/{family}")
        prompts = sorted({r.prompt for r in family_records})
        if len(prompts) < settings.heldout_per_family + 1:
            raise ValueError(f"family {family}: {len(prompts)} distinct prompts, need > {settings.heldout_per_family}")
        rng.shuffle(prompts)
        chosen = set(prompts[: settings.heldout_per_family])
        taken: set[str] = set()
        for record in family_records:
            if record.prompt in chosen and record.prompt not in taken:
                taken.add(record.prompt)
                heldout.append(record)
        pools[family] = [r for r in family_records if r.prompt not in chosen]
        report.heldout_prompt_duplicates_dropped += len(family_records) - len(pools[family]) - len(chosen)
        report.heldout_per_family[family] = len(chosen)
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


def write_jsonl_gz(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write JSON lines, gzip'd with a fixed header (no file name, mtime 0) so equal rows give equal bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as handle:
        handle.write(text.encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def read_jsonl_gz(path: Path) -> list[dict[str, Any]]:
    """Read a file written by ``write_jsonl_gz`` (or any gzip'd JSON lines)."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_slice(out_dir: Path, train: Sequence[SourceRecord], heldout: Sequence[SourceRecord]) -> None:
    """Write ``train.jsonl.gz`` and ``heldout.jsonl.gz`` into ``out_dir``."""
    write_jsonl_gz(Path(out_dir) / TRAIN_FILE, (r.to_alpaca() for r in train))
    write_jsonl_gz(Path(out_dir) / HELDOUT_FILE, (r.to_alpaca() for r in heldout))


def family_table(report: SliceReport) -> str:
    """A Markdown table of the records per family: filtered pool, train, held-out."""
    families = sorted(report.train_per_family, key=lambda f: (-report.train_per_family[f], f))
    lines = ["| family | train | held-out | train pool after the filter |", "| --- | ---: | ---: | ---: |"]
    for family in families:
        lines.append(
            f"| {family} | {report.train_per_family[family]} | {report.heldout_per_family[family]} "
            f"| {report.pool_per_family[family]} |"
        )
    lines.append(
        f"| **total** | {sum(report.train_per_family.values())} | {sum(report.heldout_per_family.values())} "
        f"| {sum(report.pool_per_family.values())} |"
    )
    return "\n".join(lines)


def dataset_table(report: SliceReport, dataset_families: dict[str, str]) -> str:
    """A Markdown table of the train records per dataset, with each dataset's family."""
    lines = ["| dataset | family | train |", "| --- | --- | ---: |"]
    for dataset, count in sorted(report.train_per_dataset.items(), key=lambda item: (-item[1], item[0])):
        lines.append(f"| {dataset} | {dataset_families[dataset]} | {count} |")
    return "\n".join(lines)


def skew(counts: dict[str, int]) -> float:
    """Largest over smallest count."""
    return max(counts.values()) / min(counts.values())


def report_lines(report: SliceReport, settings: SliceSettings) -> str:
    """The filter and the counts along the way, as Markdown bullet points."""
    dropped = ", ".join(f"{f} ({n} left)" for f, n in report.families_dropped.items()) or "none"
    return "\n".join(
        [
            f"- source records read: {report.source_records}",
            f"- dropped with an empty prompt or completion: {report.empty_dropped}",
            f"- dropped by the length filter (prompt > {settings.max_prompt_tokens} or completion > "
            f"{settings.max_completion_tokens} stories260K tokens, no special tokens): {report.too_long_dropped}",
            f"- exact duplicates (prompt and completion) dropped: {report.duplicates_dropped}",
            f"- families dropped (< {settings.min_family_records} records after the filter): {dropped}",
            f"- other records sharing a held-out prompt, dropped: {report.heldout_prompt_duplicates_dropped}",
            f"- train skew (largest / smallest family): {skew(report.train_per_family):.2f}x",
            f"- seed {settings.seed}; held-out {settings.heldout_per_family} prompts per family; train sampled to "
            f"{settings.train_size} records at one fraction for every family",
        ]
    )


def add_slice_arguments(parser: Any, defaults: SliceSettings) -> None:
    """The ``SliceSettings`` options of the rebuild commands."""
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--heldout-per-family", type=int, default=defaults.heldout_per_family)
    parser.add_argument("--train-size", type=int, default=defaults.train_size)
    parser.add_argument("--min-family-records", type=int, default=defaults.min_family_records)
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    parser.add_argument("--max-completion-tokens", type=int, default=defaults.max_completion_tokens)


def settings_from_arguments(args: Any) -> SliceSettings:
    """``SliceSettings`` from parsed ``add_slice_arguments`` options."""
    return SliceSettings(
        max_prompt_tokens=args.max_prompt_tokens,
        max_completion_tokens=args.max_completion_tokens,
        heldout_per_family=args.heldout_per_family,
        train_size=args.train_size,
        min_family_records=args.min_family_records,
        seed=args.seed,
    )


def command_line(module: str, args: Any, defaults: SliceSettings) -> str:
    """The command that rebuilds a slice, with the options that differ from the defaults."""
    parts = [f"python -m {module} --source SOURCE --out {args.out}"]
    if getattr(args, "source_commit", None):
        parts.append(f"--source-commit {args.source_commit}")
    for name in ("seed", "heldout_per_family", "train_size", "min_family_records", "max_prompt_tokens",
                 "max_completion_tokens"):
        value = getattr(args, name)
        if value != getattr(defaults, name):
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def slice_parser(description: str, source_help: str, defaults: SliceSettings) -> Any:
    """The rebuild command line every slice shares: --source, --out, --source-commit and the slice settings."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--source", type=Path, required=True, help=source_help)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--source-commit", default=None, help="commit id of the source, recorded in the README")
    add_slice_arguments(parser, defaults)
    return parser


def rebuild_slice(args: Any, records: Sequence[SourceRecord], module: str, defaults: SliceSettings
                  ) -> tuple[SliceReport, SliceSettings, str]:
    """Filter, split and write the slice the parsed `args` ask for: (report, settings, the command to rebuild it)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = settings_from_arguments(args)
    train, heldout, report = build_slice(records, load_stories260k_tokenizer(), settings)
    write_slice(args.out, train, heldout)
    return report, settings, command_line(module, args, defaults)


def write_readme(out_dir: Path, text: str, report: SliceReport) -> None:
    (Path(out_dir) / "README.md").write_text(text, encoding="utf-8")
    logger.info("train per family %s (skew %.2fx)", report.train_per_family, skew(report.train_per_family))


def split_and_rebuild_sections(report_markdown: str, table: str, command: str, source_path: str,
                               after_table: str = "") -> str:
    """The README's "Filter and split" and "Rebuild" sections, the same for every slice."""
    return f"""## Filter and split

{report_markdown}

Record counts per family (train is one uniform fraction of each family's pool, so the natural
skew after the length filter is kept; held-out is the same number of distinct prompts per family):

{table}
{after_table}
## Rebuild

```
{command}
```

`SOURCE` is the fetched `{source_path}` folder. The output is byte-identical for the same source and options.
"""
