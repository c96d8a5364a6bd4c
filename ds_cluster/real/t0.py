"""Rebuild the shipped T0 slice from yizhongw/self-instruct's T0 training sample.

Source: GitHub yizhongw/self-instruct (Apache-2.0),
``data/finetuning/t0_train_50k/data_per_template/*.jsonl``: 294 promptsource templates over 37
datasets, each line ``{"prompt": ..., "completion": ...<|endoftext|>}``. A file is named
``{dataset}_{template}.jsonl``; the dataset is the longest known name the file name starts with.
Datasets are grouped into the task clusters of the T0 paper (Sanh et al. 2022, figure 2):
``DATASET_FAMILIES``. QuAIL, listed in the paper, is not in this sample.

    python -m ds_cluster.real.t0 --source DIR --out ds_cluster/real/data/t0 --source-commit SHA

``--source`` is the folder holding the ``*.jsonl`` files (or any folder above it). The steps and
the defaults are those of ``ds_cluster.real.slicing``; completions lose their ``<|endoftext|>``,
prompts and completions their surrounding whitespace.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm import tqdm

from ds_cluster.real.slicing import (
    split_and_rebuild_sections,
    SliceSettings,
    SourceRecord,
    dataset_table,
    family_table,
    rebuild_slice,
    report_lines,
    slice_parser,
    write_readme,
)

logger = logging.getLogger(__name__)

SOURCE_REPO = "yizhongw/self-instruct"
SOURCE_PATH = "data/finetuning/t0_train_50k/data_per_template"
END_OF_TEXT = "<|endoftext|>"

# T0 paper's training task clusters -> the dataset names (promptsource name with "/" as "_") in the sample.
FAMILY_DATASETS: dict[str, tuple[str, ...]] = {
    "multiple_choice_qa": (
        "commonsense_qa", "cosmos_qa", "dream", "qasc", "quarel", "quartz", "sciq", "social_i_qa",
        "wiki_hop_original", "wiqa",
    ),
    "extractive_qa": (
        "adversarial_qa_dbert", "adversarial_qa_dbidaf", "adversarial_qa_droberta", "duorc_ParaphraseRC",
        "duorc_SelfRC", "quoref", "ropes",
    ),
    "closed_book_qa": ("kilt_tasks_hotpotqa", "wiki_qa"),
    "sentiment": ("amazon_polarity", "app_reviews", "imdb", "rotten_tomatoes", "yelp_review_full"),
    "topic_classification": ("ag_news", "dbpedia_14", "trec"),
    "structure_to_text": ("common_gen", "wiki_bio"),
    "summarization": ("cnn_dailymail_3_0_0", "gigaword", "multi_news", "samsum", "xsum"),
    "paraphrase_identification": ("glue_mrpc", "glue_qqp", "paws_labeled_final"),
}
DATASET_FAMILIES: dict[str, str] = {d: family for family, names in FAMILY_DATASETS.items() for d in names}
DEFAULT_SETTINGS = SliceSettings(heldout_per_family=150, train_size=9000, min_family_records=500)


def split_file_name(stem: str) -> tuple[str, str]:
    """(dataset, template) of a ``data_per_template`` file name without ``.jsonl``."""
    matches = [d for d in DATASET_FAMILIES if stem.startswith(d + "_")]
    if not matches:
        raise ValueError(f"{stem}: no known T0 dataset name starts this file name; extend FAMILY_DATASETS")
    dataset = max(matches, key=len)
    return dataset, stem[len(dataset) + 1 :]


def template_files(source: Path) -> list[Path]:
    """The template files under ``source``, sorted by name."""
    source = Path(source)
    direct = sorted(source.glob("*.jsonl"))
    files = direct if direct else sorted(source.rglob(f"{Path(SOURCE_PATH).name}/*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl template files under {source}")
    return files


def read_source(source: Path) -> list[SourceRecord]:
    """Every prompt/completion of the template files, in file-name then line order."""
    records: list[SourceRecord] = []
    for path in tqdm(template_files(source), desc="T0 templates"):
        dataset, template = split_file_name(path.stem)
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    continue
                row = json.loads(line)
                records.append(
                    SourceRecord(
                        prompt=row["prompt"].strip(),
                        completion=row["completion"].removesuffix(END_OF_TEXT).strip(),
                        family=DATASET_FAMILIES[dataset],
                        dataset=dataset,
                        template=template,
                    )
                )
    return records


def readme_text(report_markdown: str, table: str, datasets: str, command: str, source_commit: str | None) -> str:
    """The README shipped beside the slice."""
    commit = source_commit or "(not recorded)"
    train_per_dataset = f"\nTrain records per dataset:\n\n{datasets}\n"
    return f"""# T0 slice (real multi-task instruction data)

A slice of the T0 training mixture, grouped into the T0 paper's task clusters (`family`), for the
benchmark's real-data arm.

## Provenance

- Source: GitHub [{SOURCE_REPO}](https://github.com/{SOURCE_REPO}), commit `{commit}`,
  folder `{SOURCE_PATH}/` (294 promptsource templates over 37 datasets: the Self-Instruct authors' `t0_train_50k`
  sample of P3, 55,185 records).
- Licence: Apache-2.0 (the Self-Instruct repository); the underlying datasets keep their own licences
  (see P3 / promptsource).
- Families: the T0 paper's training clusters (Sanh et al. 2022, "Multitask Prompted Training Enables
  Zero-Shot Task Generalization", figure 2), mapped by dataset in `ds_cluster/real/t0.py`
  (`FAMILY_DATASETS`). QuAIL is not in the sample. A family is a task cluster, not a template:
  a cluster's templates include inverted tasks (e.g. "generate the question").

## Records

`train.jsonl.gz` and `heldout.jsonl.gz`, one JSON object a line:
`{{"instruction": prompt, "input": "", "output": completion, "family": cluster, "dataset": ..., "template": ...}}`.
Completions lost their `<|endoftext|>`; prompts and completions their surrounding whitespace.
All 1,400 `trec` records of the sample have an empty completion (the label is missing in the source),
so topic classification comes from `ag_news` and `dbpedia_14` only.

{split_and_rebuild_sections(report_markdown, table, command, SOURCE_PATH, train_per_dataset)}"""


def main(argv: list[str] | None = None) -> None:
    """Command line: rebuild the T0 slice from the fetched template files."""
    parser = slice_parser("Rebuild the T0 slice (train/held-out) from self-instruct's sample.",
                          f"folder with {SOURCE_PATH}/*.jsonl", DEFAULT_SETTINGS)
    args = parser.parse_args(argv)
    report, settings, command = rebuild_slice(args, read_source(args.source), "ds_cluster.real.t0", DEFAULT_SETTINGS)
    write_readme(args.out, readme_text(report_lines(report, settings), family_table(report),
                                       dataset_table(report, DATASET_FAMILIES), command, args.source_commit), report)



if __name__ == "__main__":
    main()
