"""Rebuild the shipped T0 slice from yizhongw/self-instruct's T0 training sample.

Source: GitHub yizhongw/self-instruct (Apache-2.0),
``data/finetuning/t0_train_50k/data_per_template/*.jsonl``: 294 promptsource templates over 37
datasets, each line ``{"prompt": ..., "completion": ...<|endoftext|>}``. A file is named
``{dataset}_{template}.jsonl``; the dataset is the longest known name the file name starts with.
Datasets are grouped into the task clusters of the T0 paper (Sanh et al. 2022, figure 2):
``DATASET_FAMILIES``. QuAIL, listed in the paper, is not in this sample.

    python -m bench.real.t0 --source DIR --out bench/real/data/t0 --source-commit SHA

``--source`` is the folder holding the ``*.jsonl`` files (or any folder above it). The steps and
the defaults are those of ``bench.real.slicing``; completions lose their ``<|endoftext|>``,
prompts and completions their surrounding whitespace.

The sample renders the same examples of a dataset under all its templates (each template file
starts with the same dataset rows), so the split is by example group (``example_id``), never by
prompt: see ``example_groups.example_group_ids`` and ``EXAMPLE_GROUPS_NOTE``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm import tqdm

from bench.real.slice_output import (dataset_table, family_table, rebuild_slice, report_lines, slice_parser,
                                          split_and_rebuild_sections, write_readme)
from bench.real.slicing import SliceSettings, SourceRecord

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
# Measured on the records left after the filter of commit 0b26ccaa (19,006 records, 29 datasets).
EXAMPLE_GROUPS_NOTE = """
Why these rules and cuts, measured on this sample after the filter (19,006 records over 29 datasets):

- The sample renders the first rows of each dataset under every one of its templates (2 to 12
  templates a dataset), so an example's content has a document frequency (records of the dataset
  holding it) of about its number of templates. Over the distinct word 8-grams of each dataset:
  DF 1: 129,417; DF 2: 27,451; DF 3-6: 33,893; DF 7-12: 13,874; DF 13-20: 561; DF 21-40: 171;
  DF 41-100: 144; DF > 100: 240. Content sits below the valley after 12; every 8-gram above 20, and
  539 of the 561 at 13-20, is held by two or more prompts of one template (template text). Rule 3's
  cut of 50 leaves room for near-duplicate clusters (FLAN's aqua needs 48) and still drops the
  formulas; the template-phrase test drops the text of the larger templates.
- A DF cut alone does not separate template text from content: 7,183 8-grams of DF 2-12 also recur
  within a template (a template's words next to a formula such as "what will Kendall want to do"; the
  wording of templates with few records). Linking on every shared 8-gram of DF <= 12 chains whole
  datasets together (social_i_qa: one group of 1,092 of its 1,186 records; quartz 1,016 of 1,132;
  qasc 991 of 1,082; wiki_qa 712 of 756; DF <= 6 still gives 992 of 1,186). Rule 2 therefore asks for
  a per-template document frequency of one, and uses 4-grams (short questions and facts, e.g. qasc,
  rarely hold a whole 8-gram of content between template words). Of the (4-gram, template) pairs,
  411,818 are held by one prompt, 17,582 by 2-5 and 2,688 by more.
- `common_gen` has 67 concept sets (several reference sentences each, every one under nine
  templates), but its `topic_to_sentence` template asks only "Can you write a sentence about the
  topic train?": one prompt for every concept set with that concept, so rule 1 chains those concept
  sets and `common_gen` makes 22 groups. `structure_to_text` thus has few groups, and its held-out
  takes up to ten records (templates, references) from each held-out `common_gen` group.
- What stays apart: records that share only a question whose rows differ (`wiki_qa` lists several
  candidate answers per question; the question recurs inside its templates, so each candidate is its
  own group, and the question-only templates form the group of the correct answer); a one-word title
  (`dbpedia_14`) under a template with one record; two wire stories with one title and no 8-gram in
  common (`gigaword`: "texas girds for the worst as deadly ike closes in"). Some answers recur across
  different examples by design: labels (`They loved it`, `Science and technology`, `None of the above
  choices .`) and formulas (`How would you describe Jordan?`, `do a good job`).
"""


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
    train_per_dataset = f"\nTrain records and example groups (before the split) per dataset:\n\n{datasets}\n"
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
  Zero-Shot Task Generalization", figure 2), mapped by dataset in `bench/real/t0.py`
  (`FAMILY_DATASETS`). QuAIL is not in the sample. A family is a task cluster, not a template:
  a cluster's templates include inverted tasks (e.g. "generate the question").

## Records

`train.jsonl.gz` and `heldout.jsonl.gz`, one JSON object a line:
`{{"instruction": prompt, "input": "", "output": completion, "family": cluster, "dataset": ..., "template": ...,
"example_id": "<dataset>:<n>"}}` (the example group; see "Example groups").
Completions lost their `<|endoftext|>`; prompts and completions their surrounding whitespace.
All 1,400 `trec` records of the sample have an empty completion (the label is missing in the source),
so topic classification comes from `ag_news` and `dbpedia_14` only.

{split_and_rebuild_sections(report_markdown, table, command, SOURCE_PATH, train_per_dataset, EXAMPLE_GROUPS_NOTE)}"""


def main(argv: list[str] | None = None) -> None:
    """Command line: rebuild the T0 slice from the fetched template files."""
    parser = slice_parser("Rebuild the T0 slice (train/held-out) from self-instruct's sample.",
                          f"folder with {SOURCE_PATH}/*.jsonl", DEFAULT_SETTINGS)
    args = parser.parse_args(argv)
    report, settings, command = rebuild_slice(args, read_source(args.source), "bench.real.t0", DEFAULT_SETTINGS)
    write_readme(args.out, readme_text(report_lines(report, settings), family_table(report),
                                       dataset_table(report, DATASET_FAMILIES), command, args.source_commit), report)


if __name__ == "__main__":
    main()
