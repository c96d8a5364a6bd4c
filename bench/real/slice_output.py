"""A slice's files and words: gzip'd JSON lines with fixed bytes, the README's tables and sections,
and the rebuild command line every slice shares."""
from __future__ import annotations

import gzip
import io
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.real.example_groups import EXAMPLE_GROUP_RULE_MARKDOWN
from bench.real.slicing import (HELDOUT_FILE, TRAIN_FILE, SliceReport, SliceSettings, SourceRecord, build_slice,
                                     load_stories260k_tokenizer)

logger = logging.getLogger(__name__)


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
    """A Markdown table per family: train, held-out (records and example groups), train pool, example groups."""
    families = sorted(report.train_per_family, key=lambda f: (-report.train_per_family[f], f))
    lines = [
        "| family | train | held-out | held-out example groups | train pool | example groups |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for family in families:
        lines.append(
            f"| {family} | {report.train_per_family[family]} | {report.heldout_per_family[family]} "
            f"| {report.heldout_groups_per_family[family]} | {report.pool_per_family[family]} "
            f"| {report.example_groups_per_family[family]} |"
        )
    totals = [sum(counts[f] for f in families) for counts in (
        report.train_per_family, report.heldout_per_family, report.heldout_groups_per_family,
        report.pool_per_family, report.example_groups_per_family)]
    lines.append("| **total** | " + " | ".join(str(total) for total in totals) + " |")
    return "\n".join(lines)


def dataset_table(report: SliceReport, dataset_families: dict[str, str]) -> str:
    """A Markdown table of the train records per dataset, with each dataset's family and example groups."""
    lines = ["| dataset | family | train | example groups |", "| --- | --- | ---: | ---: |"]
    for dataset, count in sorted(report.train_per_dataset.items(), key=lambda item: (-item[1], item[0])):
        groups = report.example_groups_per_dataset.get(dataset, 0)
        lines.append(f"| {dataset} | {dataset_families[dataset]} | {count} | {groups} |")
    return "\n".join(lines)


def skew(counts: dict[str, int]) -> float:
    """Largest over smallest count."""
    return max(counts.values()) / min(counts.values())


def report_lines(report: SliceReport, settings: SliceSettings) -> str:
    """The filter and the counts along the way, as Markdown bullet points."""
    dropped = ", ".join(f"{f} ({n} left)" for f, n in report.families_dropped.items()) or "none"
    groups = sum(report.example_groups_per_family.values())
    records = sum(report.pool_per_family.values()) + sum(report.heldout_per_family.values()) + (
        report.heldout_group_records_dropped + report.heldout_prompt_duplicates_dropped)
    return "\n".join(
        [
            f"- source records read: {report.source_records}",
            f"- dropped with an empty prompt or completion: {report.empty_dropped}",
            f"- dropped by the length filter (prompt > {settings.max_prompt_tokens} or completion > "
            f"{settings.max_completion_tokens} stories260K tokens, no special tokens): {report.too_long_dropped}",
            f"- exact duplicates (prompt and completion) dropped: {report.duplicates_dropped}",
            f"- families dropped (< {settings.min_family_records} records after the filter): {dropped}",
            f"- example groups (see below): {groups} over the {records} records left; "
            f"{report.records_in_shared_groups} records share their group with others",
            f"- held-out: at most {settings.heldout_per_family} example groups per family and at most "
            f"{settings.max_heldout_group_share:g} of the family's groups, one record per group a round up to "
            f"{settings.heldout_per_family} records; the other records of held-out groups, dropped: "
            f"{report.heldout_group_records_dropped}",
            f"- other records sharing a held-out prompt (in another family), dropped: "
            f"{report.heldout_prompt_duplicates_dropped}",
            f"- train skew (largest / smallest family): {skew(report.train_per_family):.2f}x",
            f"- seed {settings.seed}; train sampled to {settings.train_size} records at one fraction for every family",
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
    parser.add_argument("--max-heldout-group-share", type=float, default=defaults.max_heldout_group_share)


def settings_from_arguments(args: Any) -> SliceSettings:
    """``SliceSettings`` from parsed ``add_slice_arguments`` options."""
    return SliceSettings(
        max_prompt_tokens=args.max_prompt_tokens,
        max_completion_tokens=args.max_completion_tokens,
        heldout_per_family=args.heldout_per_family,
        train_size=args.train_size,
        min_family_records=args.min_family_records,
        seed=args.seed,
        max_heldout_group_share=args.max_heldout_group_share,
    )


def command_line(module: str, args: Any, defaults: SliceSettings) -> str:
    """The command that rebuilds a slice, with the options that differ from the defaults."""
    parts = [f"python -m {module} --source SOURCE --out {args.out}"]
    if getattr(args, "source_commit", None):
        parts.append(f"--source-commit {args.source_commit}")
    for name in ("seed", "heldout_per_family", "train_size", "min_family_records", "max_prompt_tokens",
                 "max_completion_tokens", "max_heldout_group_share"):
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
                               after_table: str = "", groups_note: str = "") -> str:
    """The README's "Filter and split", "Example groups" and "Rebuild" sections, the same for every slice."""
    return f"""## Filter and split

{report_markdown}

Record counts per family (train is one uniform fraction of each family's pool, so the natural
skew after the length filter is kept; held-out takes whole example groups, at most one record of a
group until every held-out group has given one):

{table}
{after_table}
## Example groups

{EXAMPLE_GROUP_RULE_MARKDOWN}{groups_note}
## Rebuild

```
{command}
```

`SOURCE` is the fetched `{source_path}` folder. The output is byte-identical for the same source and options.
"""
