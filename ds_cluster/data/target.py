"""Target examples: a few records of what the user cares about, read and tokenized like the training data.

A targeted selection (docs/targeted.md) takes the training records whose features are most like these examples'.
They come in any record format the package reads (Alpaca, chat `messages`, ShareGPT `conversations`,
prompt/completion; docs/data.md), from a JSONL file, a `datasets` folder or records in memory. With a `group_field`,
the field's value names the target an example belongs to (several targets in one file); examples without it form one
target of their own. They are tokenized with the training data's tokenizer and max length, and, unlike training
records, none may be cut short or lack an answer: each one is checked, and any problem is a ValueError naming the
example. Their fingerprint (of the records and their targets) is what an analysis and a plan record of them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from ds_cluster.data.dataset import IGNORE_INDEX, InstructionDataset, encode_example, prompt_text, read_records

KEY = "cluster_sampling.target.data"
# The target of examples when the file names none (no group_field), and of examples without the group field.
ONE_TARGET = "target"
UNGROUPED = "(no group)"
# Long enough that no record is cut: what a record's full length is measured with.
_UNCUT = 1 << 30


@dataclass(frozen=True)
class TargetExamples:
    """Target examples as read: the records, each one's target (an index into `group_names`, sorted), the tokenized
    examples the features read (`dataset`: an InstructionDataset), their fingerprint, and where they were read."""

    records: tuple[dict, ...]
    groups: np.ndarray
    group_names: tuple[str, ...]
    dataset: Any
    fingerprint: str
    source: Optional[str] = None

    @property
    def prompts(self) -> tuple[str, ...]:
        """Each example's prompt as plain text (for reports)."""
        return tuple(prompt_text(record, index) for index, record in enumerate(self.records))

    def encoded_with(self, encode: Callable[[Any], Any]) -> "TargetExamples":
        """The same examples re-encoded by `encode` (a feature model's tokenizer: `FeatureSource.encode`), checked
        again: none may be cut short by the new encoding either."""
        dataset = encode(self.dataset)
        if dataset is self.dataset:
            return self
        check_examples(dataset, self.source)
        return dataclasses.replace(self, dataset=dataset)


def read_target_fingerprint(source: Union[str, os.PathLike, Sequence[Mapping[str, Any]]], *,
                            group_field: Optional[str] = None, groups: Optional[Sequence[str]] = None) -> str:
    """The fingerprint `read_target` gives the same examples, without tokenizing them (what `ds-cluster plan` checks
    an analysis's target against)."""
    records = _records(source)
    names, group_of = _targets(records, group_field, groups, 1, _path(source))
    return target_fingerprint(records, [names[g] for g in group_of])


def _path(source: Any) -> Optional[str]:
    return os.path.abspath(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else None


def _records(source: Any) -> list[dict]:
    path = _path(source)
    if path is not None and not Path(path).exists():
        raise FileNotFoundError(f"{KEY}: no file or folder at {path} (the target examples: JSONL or a datasets "
                                "save_to_disk folder; docs/targeted.md)")
    try:
        records = read_records(source)
    except ValueError as err:
        raise ValueError(f"{KEY} {path or '(records)'}: {err}") from None
    if not records:
        raise ValueError(f"{KEY} {path or '(records)'} holds no examples: give at least one per target")
    return [dict(record) for record in records]


def read_target(source: Union[str, os.PathLike, Sequence[Mapping[str, Any]]], tokenizer: Any, max_length: int, *,
                group_field: Optional[str] = None, min_examples: int = 1,
                groups: Optional[Sequence[str]] = None) -> TargetExamples:
    """The target examples of `source`, tokenized with `tokenizer` at `max_length` (the training data's); ValueError
    (FileNotFoundError for a missing file) naming what is wrong: no examples, a record that cannot be rendered or
    tokenized or has no answer, one longer than max_length, a target with fewer than `min_examples` examples, a
    declared target (`groups`) with none, an example of a target not declared."""
    path = _path(source)
    records = _records(source)
    names, group_of = _targets(records, group_field, groups, min_examples, path)
    try:
        dataset = InstructionDataset(records, tokenizer, max_length=max_length, source=path)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{KEY} {path or '(records)'}: a target example cannot be rendered or tokenized: {err}") \
            from None
    check_examples(dataset, path)
    return TargetExamples(records=tuple(dataset.records), groups=group_of, group_names=names, dataset=dataset,
                          fingerprint=target_fingerprint(dataset.records, [names[g] for g in group_of]), source=path)


def _targets(records: Sequence[Mapping[str, Any]], group_field: Optional[str], declared: Optional[Sequence[str]],
             min_examples: int, path: Optional[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """The targets' names (sorted) and each example's target, checked against the declared ones and the minimum."""
    def name_of(record: Mapping[str, Any]) -> str:
        if group_field is None:
            return ONE_TARGET
        value = record.get(group_field)
        return UNGROUPED if value is None or value == "" else str(value)

    per_example = [name_of(record) for record in records]
    names = tuple(sorted(set(per_example)))
    where = f"{KEY} {path or '(records)'}"
    if declared is not None:
        undeclared = sorted(set(names) - set(declared))
        if undeclared:
            raise ValueError(f"{where}: examples of targets that cluster_sampling.target.groups does not name: "
                             f"{undeclared} (its groups: {list(declared)}; the field {group_field!r})")
        missing = [name for name in declared if name not in names]
        if missing:
            raise ValueError(f"{where}: the target groups {missing} have no examples (no record has {group_field!r} "
                             "equal to them): add their examples, or remove them from cluster_sampling.target.groups")
        names = tuple(sorted(declared))
    counts = {name: per_example.count(name) for name in names}
    short = {name: count for name, count in counts.items() if count < min_examples}
    if short:
        raise ValueError(f"{where}: fewer target examples than cluster_sampling.target.min_examples = {min_examples}: "
                         + ", ".join(f"{name!r} has {count}" for name, count in short.items()))
    return names, np.array([names.index(name) for name in per_example], dtype=np.int64)


def check_examples(dataset: Any, path: Optional[str]) -> None:
    """Every tokenized example has an answer, and none was cut short by the dataset's max_length."""
    where = f"{KEY} {path or '(records)'}"
    for index, record in enumerate(dataset.records):
        try:
            ids, labels = encode_example(dataset.tokenizer, record, _UNCUT, index=index)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: target example {index} cannot be rendered or tokenized: {err}") from None
        if len(ids) > dataset.max_length:
            raise ValueError(f"{where}: target example {index} is {len(ids)} tokens long, more than the max length "
                             f"{dataset.max_length} the training data is tokenized with: a target example is never "
                             "cut short; shorten it, or raise the max length")
        if all(label == IGNORE_INDEX for label in labels):
            raise ValueError(f"{where}: target example {index} has no answer tokens (an empty response): give it "
                             "the answer the target expects")


def target_fingerprint(records: Sequence[Mapping[str, Any]], groups: Sequence[str]) -> str:
    """What identifies a target set: a hash of its records (their fields, in order) and each one's target."""
    digest = hashlib.sha256()
    for record, group in zip(records, groups):
        digest.update(json.dumps([record, group], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def target_encoding(training_data: Any, tokenizer: Any = None, max_length: Optional[int] = None) -> tuple[Any, int]:
    """The tokenizer and max length the training data is tokenized with, for its target examples: `tokenizer` else the
    data's `tokenizer`; `max_length` else the data's `max_length`, else the width of its items."""
    tokenizer = tokenizer if tokenizer is not None else getattr(training_data, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"{KEY}: the target examples are tokenized like the training data, and nothing gives its "
                         f"tokenizer ({type(training_data).__name__} has no `tokenizer` attribute): build the data "
                         "with ds_cluster.data.dataset.InstructionDataset, set `dataset.tokenizer`, or pass the "
                         "Trainer its tokenizer (processing_class)")
    length = max_length or getattr(training_data, "max_length", None)
    if length is None:
        length = len(training_data[0]["input_ids"])
    return tokenizer, int(length)
