"""What the trainers over someone else's token rows share: TRL's SFTTrainer, axolotl and LLaMA-Factory.

Each of them tokenizes the user's records itself into rows of variable-length
`input_ids` and `labels` (-100 on the tokens without loss) and pads each batch
in its collator. The plan is of those rows (sample i is row i): its checks and
an analysis computed in the job stack whole items, so they read
`PaddedRowsView`, the rows padded to one width; training reads the rows
themselves through the frontend's collator. `RowsPlanMixin` gives a
`ClusterSamplingMixin` trainer that view as what its plan is of.

This module imports neither TRL nor a frontend, so every integration (and a
user's own trainer over such rows) can use it.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch
from torch.utils.data import Dataset

from ds_cluster.data.dataset import IGNORE_INDEX, TASK_GROUP_FIELDS, task_group

logger = logging.getLogger(__name__)

# The columns of prepared rows the plan reads.
ROW_COLUMNS = ("input_ids", "labels")


class PaddedRowsView(Dataset):
    """Prepared token rows as same-width items: what the plan's checks and an analysis computed in the job read.

    The rows hold variable-length `input_ids` and `labels`; feature extraction
    stacks whole items, so each row is padded on the right to the longest row
    (attention mask 0 and label -100 there: under causal attention no real
    position sees the padding). The labels are the rows' own, so the features
    and the "token" reduction's counts are about the tokens the loss trains on.
    Same length and order as the rows: index i is row i.
    """

    def __init__(self, rows: Any, pad_token_id: int, source: Optional[str] = None):
        self.rows = rows
        self.pad_token_id = int(pad_token_id)
        # Where the records these rows were prepared from can be read again, one per row, if known.
        self.source = source
        # At least 2 columns: the loss and the features shift labels by one.
        self.width = max([len(ids) for ids in rows["input_ids"]] + [2])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[int(index)]
        length = len(row["input_ids"])
        input_ids = torch.full((self.width,), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros(self.width, dtype=torch.int64)
        labels = torch.full((self.width,), IGNORE_INDEX, dtype=torch.int64)
        input_ids[:length] = torch.as_tensor(row["input_ids"], dtype=torch.int64)
        attention_mask[:length] = 1
        labels[:length] = torch.as_tensor(row["labels"], dtype=torch.int64)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    @property
    def categories(self) -> Optional[list[str]]:
        """Every row's task group (`task_group`: its `category`, else `family`), for the analysis summary's cluster
        purity; None when the rows have neither column."""
        names = getattr(self.rows, "column_names", None) or []
        columns = {column: self.rows[column] for column in TASK_GROUP_FIELDS if column in names}
        if not columns:
            return None
        return [task_group({column: values[index] for column, values in columns.items()})
                for index in range(len(self.rows))]


def missing_row_columns(rows: Any) -> list[str]:
    """The columns of ROW_COLUMNS that prepared rows lack (none: the plan can read them)."""
    columns = getattr(rows, "column_names", None) or []
    return [column for column in ROW_COLUMNS if column not in columns]


class RowsPlanMixin:
    """For a `ClusterSamplingMixin` trainer whose `train_dataset` holds prepared token rows: the plan is of those
    rows, read through a `PaddedRowsView` (built once per `train_dataset`).

    Put it before `ClusterSamplingMixin`. A subclass says which pad id the view uses (`rows_pad_token_id`, any id
    would do: it is masked out) and where the rows' records can be read again (`rows_source`, for the report).
    """

    _padded_rows: Optional[PaddedRowsView] = None

    def rows_pad_token_id(self) -> int:
        """The collator's pad id when it has one (the rows as the model sees them), else 0."""
        value = getattr(getattr(self, "data_collator", None), "pad_token_id", None)
        return value if isinstance(value, int) else 0

    def rows_source(self) -> Optional[str]:
        """The file the rows' records can be read again from, one per row in the rows' order (None: unknown)."""
        return None

    def cluster_plan_dataset(self) -> PaddedRowsView:
        """The prepared rows padded to one width (`PaddedRowsView`): what the plan and a computed analysis read."""
        rows = self.train_dataset  # type: ignore[attr-defined]
        if self._padded_rows is None or self._padded_rows.rows is not rows:
            self._padded_rows = PaddedRowsView(rows, self.rows_pad_token_id(), source=self.rows_source())
            logger.info("ds_cluster: the plan reads %s's %d prepared rows, padded to %d tokens for the checks and "
                        "the features", type(self).__name__, len(self._padded_rows), self._padded_rows.width)
        return self._padded_rows


def rendered_record(row: Mapping[str, Any], tokenizer: Any) -> dict[str, str]:
    """A prepared row as the frontend rendered it, for reading: `prompt` (the tokens before the first one with
    loss) and `completion` (the tokens with loss), decoded; the form `ds-cluster report` and `export` read."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    first = next((position for position, label in enumerate(labels) if label != IGNORE_INDEX), len(ids))
    trained = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
    return {"prompt": tokenizer.decode(ids[:first]), "completion": tokenizer.decode(trained)}
