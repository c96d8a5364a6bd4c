"""Rebuild the shipped FLAN v2 chain-of-thought slice from google-research/FLAN's ``cot_data``.

Source: GitHub google-research/FLAN (Apache-2.0), ``flan/v2/cot_data/{source}_train.tsv``: one
record a line, ``question<TAB>answer<TAB>rationale``, with newlines written as a literal ``\\n``
(FLAN's ``simple_cot_tsv`` reads them the same way). The family is the source name (``gsm8k``,
``ecqa``, ...); the template is FLAN's task name (``cot_gsm8k``, or ``stream_aqua`` for the two
sources FLAN marks as lower-quality annotations).

The target (``output``) is the short final answer, not the rationale: the benchmark's primary
metrics are the loss on the answer and exact match on short answers, and with the 512-piece
stories260K tokenizer most rationales alone exceed the 40-token completion limit. The rationale
is kept in an extra ``rationale`` field for anyone who wants chain-of-thought targets.

    python -m bench.real.flan_cot --source DIR --out bench/real/data/flan_cot --source-commit SHA

``--source`` is the folder holding the ``*_train.tsv`` files (or any folder above it).

Some sources hold the same question more than once in other words (aqua: one problem with other
numbers or options; gsm8k, creak, sensemaking: a few rewordings), so the split is by example group
(``example_id``, ``example_groups.example_group_ids``), never by prompt; see ``EXAMPLE_GROUPS_NOTE``.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

from bench.real.slice_output import (family_table, rebuild_slice, report_lines, slice_parser,
                                          split_and_rebuild_sections, write_readme)
from bench.real.slicing import SliceSettings, SourceRecord

logger = logging.getLogger(__name__)

SOURCE_REPO = "google-research/FLAN"
SOURCE_PATH = "flan/v2/cot_data"
# FLAN's task_configs.py: (source, annotation kind, lines in the train file)
FLAN_COT_SOURCES: tuple[tuple[str, str, int], ...] = (
    ("gsm8k", "cot", 7473),
    ("strategyqa", "cot", 2061),
    ("creak", "cot", 6915),
    ("qasc", "cot", 1084),
    ("esnli", "cot", 36174),
    ("ecqa", "cot", 7112),
    ("sensemaking", "cot", 6070),
    ("aqua", "stream", 2728),
    ("qed", "stream", 5154),
)
DEFAULT_SETTINGS = SliceSettings(heldout_per_family=150, train_size=9000, min_family_records=500)
# Measured on the records left after the filter of commit e9e4ec6e (32,203 records, 7 sources).
EXAMPLE_GROUPS_NOTE = """
FLAN uses one template per source, so rule 2 links nothing here (any content two questions share
is, by its test, held by two prompts of the template); the groups come from rule 1 (the same question
up to case and punctuation) and rule 3 (near-duplicate questions). Measured on this snapshot after the filter:
aqua, 2,401 records in 1,237 groups, 1,423 of
them in 259 groups of two to 29 (one problem with other numbers or options, e.g. "A train 360 m long
is running at a speed of 45 km/hr ..." with other lengths and speeds, or "Find the value of y from
(12)^3 x 6^4 ÷ 432 = y?" with other options; the 8-grams of such a problem occur in up to 48 records,
hence the cut of 50); gsm8k, 28 records in 14 pairs (the same problem with another name or numbers,
or asked the other way round); creak, 39 records in 19 groups (a claim and its contrast: "... it feels
rough" / "... it feels soft"); sensemaking, 16 records in 8 pairs (one sentence pair asked in other
words); ecqa, 1 pair; qasc and strategyqa none. In the split by prompt this replaces, 27 of the 150
held-out aqua questions had a word 8-gram Jaccard similarity of 0.5 or more with a train question.
"""


def source_files(source: Path) -> dict[str, Path]:
    """The ``{name}_train.tsv`` files present under ``source``, by source name."""
    source = Path(source)
    files: dict[str, Path] = {}
    for name, _, _ in FLAN_COT_SOURCES:
        direct = source / f"{name}_train.tsv"
        found = [direct] if direct.is_file() else sorted(source.rglob(f"cot_data/{name}_train.tsv"))
        if found:
            files[name] = found[0]
    if not files:
        raise FileNotFoundError(f"no FLAN cot_data *_train.tsv files under {source}")
    return files


def unescape(text: str) -> str:
    """A TSV field with its literal ``\\n`` turned into newlines and the surrounding whitespace removed."""
    return text.replace("\\n", "\n").strip()


def read_source(source: Path) -> tuple[list[SourceRecord], list[str]]:
    """(records in FLAN's source order then line order, names of the sources whose file is absent)."""
    files = source_files(source)
    missing = [name for name, _, _ in FLAN_COT_SOURCES if name not in files]
    if missing:
        logger.warning("FLAN CoT sources absent from %s: %s", source, ", ".join(missing))
    records: list[SourceRecord] = []
    for name, kind, expected_lines in tqdm(FLAN_COT_SOURCES, desc="FLAN CoT sources"):
        if name not in files:
            continue
        # "\n" only: questions contain U+2028, which str.splitlines() would also split on
        lines = files[name].read_bytes().decode("utf-8").removesuffix("\n").split("\n")
        if len(lines) != expected_lines:
            logger.warning("%s: %d lines, FLAN's task config says %d", files[name], len(lines), expected_lines)
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 3:
                raise ValueError(f"{files[name]}:{number}: {len(fields)} tab-separated fields, expected 3")
            question, answer, rationale = (unescape(f) for f in fields)
            records.append(
                SourceRecord(
                    prompt=question,
                    completion=answer,
                    family=name,
                    dataset=name,
                    template=f"{kind}_{name}",
                    extra=(("rationale", rationale),),
                )
            )
    return records, missing


def readme_text(
    report_markdown: str, table: str, command: str, source_commit: str | None, missing: list[str]
) -> str:
    """The README shipped beside the slice."""
    commit = source_commit or "(not recorded)"
    expected = {name: lines for name, _, lines in FLAN_COT_SOURCES}
    absent = (
        ", ".join(f"`{name}_train.tsv` ({expected[name]} lines)" for name in missing)
        if missing
        else "none"
    )
    return f"""# FLAN v2 chain-of-thought slice (confirmation mixture)

A slice of the FLAN v2 CoT training data, one family per source, for the benchmark's confirmation run.

## Provenance

- Source: GitHub [{SOURCE_REPO}](https://github.com/{SOURCE_REPO}), commit `{commit}`,
  files `{SOURCE_PATH}/*_train.tsv` (`question<TAB>answer<TAB>rationale`, newlines written as `\\n`).
- Licence: Apache-2.0 (the FLAN repository); the underlying datasets keep their own licences.
- Sources absent from the fetched snapshot (files of 4 MiB or more were not fetched): {absent}.
  FLAN's CoT mixture lists nine sources; this slice has the others.

## Records

`train.jsonl.gz` and `heldout.jsonl.gz`, one JSON object a line:
`{{"instruction": question, "input": "", "output": answer, "family": source, "dataset": source,
"template": FLAN task name, "example_id": "<source>:<n>", "rationale": chain of thought}}`
(`example_id` is the example group; see "Example groups").

The target is the short final answer (e.g. `72`, `no`, `(C)`, `Sentence A`), not the rationale: the
benchmark's primary metrics are the answer loss and exact match on short answers, and most
rationales alone are longer than the 40-token completion limit with the 512-piece stories260K
tokenizer. The rationale is kept in `rationale` (not filtered by length) for chain-of-thought use.
The question is used as written, without FLAN's prompt templates, and the text is kept as in the
source, including its few mis-encoded characters (e.g. `âˆª` for `∪` in aqua).

{split_and_rebuild_sections(report_markdown, table, command, SOURCE_PATH, groups_note=EXAMPLE_GROUPS_NOTE)}"""


def main(argv: list[str] | None = None) -> None:
    """Command line: rebuild the FLAN CoT slice from the fetched TSV files."""
    parser = slice_parser("Rebuild the FLAN v2 CoT slice (train/held-out) from cot_data.",
                          f"folder with {SOURCE_PATH}/*_train.tsv", DEFAULT_SETTINGS)
    args = parser.parse_args(argv)
    records, missing = read_source(args.source)
    report, settings, command = rebuild_slice(args, records, "bench.real.flan_cot", DEFAULT_SETTINGS)
    write_readme(args.out, readme_text(report_lines(report, settings), family_table(report), command,
                                       args.source_commit, missing), report)


if __name__ == "__main__":
    main()
