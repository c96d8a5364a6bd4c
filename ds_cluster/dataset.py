"""The first stage: instruction records, their tokenized dataset, and a fingerprint for any dataset.

A sample is ``<bos> prompt response <eos>`` padded to a fixed length; only the
response and the closing ``<eos>`` are labelled (``IGNORE_INDEX`` elsewhere),
so the loss, and the gradient features computed from it, are about answering,
not about reading the prompt. The prompt is the Alpaca template. Works with
any Hugging Face tokenizer that has pad, bos and eos tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from ds_cluster.fileio import write_jsonl_atomic

# Labels with this value carry no loss (the Hugging Face and PyTorch convention).
IGNORE_INDEX = -100
DEFAULT_MAX_LENGTH = 96

# The Alpaca template's headers.
INSTRUCTION_HEADER = "### Instruction:\n"
INPUT_HEADER = "### Input:\n"
RESPONSE_HEADER = "### Response:\n"

Source = Union[str, os.PathLike, Sequence[Mapping[str, Any]]]
# How many items the default fingerprint of a dataset without its own reads.
FINGERPRINT_SAMPLE = 1024


def format_prompt(record: Mapping[str, Any]) -> str:
    """The Alpaca prompt up to and including the response header; no input section when input is empty."""
    prompt = f"{INSTRUCTION_HEADER}{record['instruction']}\n\n"
    if record.get("input"):
        prompt += f"{INPUT_HEADER}{record['input']}\n\n"
    return prompt + RESPONSE_HEADER


def encode_prompt(tokenizer: Any, record: Mapping[str, Any]) -> list[int]:
    """``<bos>`` + the prompt's token ids: what the model is given at generation time."""
    return [tokenizer.bos_token_id] + tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]


def encode_example(tokenizer: Any, record: Mapping[str, Any], max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (unpadded) of one record, at most ``max_length`` long.

    When too long, the prompt loses tokens from its start first (the response
    header next to the answer survives longest), then the response its end.
    """
    prompt = encode_prompt(tokenizer, record)
    response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    overflow = len(prompt) + len(response) - max_length
    if overflow > 0:
        kept_prompt_text = prompt[1:][min(overflow, len(prompt) - 1):]
        prompt = prompt[:1] + kept_prompt_text
        response = response[: max_length - len(prompt)]
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


class InstructionDataset(Dataset):
    """Fixed-length tokenized instruction records, all tensors built once up front.

    Items hold ``input_ids``, ``attention_mask`` and ``labels`` (int64, length
    ``max_length``) and nothing else, so the default collate works; the raw
    records (with any metadata such as a ``family``) stay in ``self.records``.
    """

    def __init__(self, records: Sequence[Mapping[str, Any]], tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH):
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        if tokenizer.pad_token_id is None or tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs pad, bos and eos tokens")
        self.records: list[dict] = [dict(r) for r in records]
        self.max_length = max_length
        count = len(self.records)
        self.input_ids = torch.full((count, max_length), tokenizer.pad_token_id, dtype=torch.int64)
        self.attention_mask = torch.zeros((count, max_length), dtype=torch.int64)
        self.labels = torch.full((count, max_length), IGNORE_INDEX, dtype=torch.int64)
        for row, record in enumerate(self.records):
            ids, labels = encode_example(tokenizer, record, max_length)
            self.input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            self.attention_mask[row, : len(ids)] = 1
            self.labels[row, : len(labels)] = torch.tensor(labels, dtype=torch.int64)

    @property
    def families(self) -> list[str]:
        """The ``family`` of every record ('' where a record has none)."""
        return [str(r.get("family", "")) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "labels": self.labels[index]}


def trim_padding_collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a micro-batch of token items and cut the trailing columns that no row attends to.

    InstructionDataset rows are padded on the right to ``max_length``, mostly with pad: the model then
    computes only the columns some row of this batch uses. Causal attention and the -100 labels of pad
    make the trimmed batch's loss that of the padded one (up to float rounding); a
    left-padded batch keeps its width. At least 2 columns stay for the label shift.
    """
    batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}
    if "attention_mask" not in batch:
        return batch  # nothing says which columns are padding
    used = batch["attention_mask"].bool().any(dim=0).nonzero()
    width = max(int(used.max()) + 1 if used.numel() else 0, 2)
    return {key: (value[:, :width] if value.dim() == 2 else value) for key, value in batch.items()}


def dataset_fingerprint(dataset: Any) -> str:
    """What identifies a map-style dataset's content: its own ``fingerprint()`` when it has one.

    Otherwise: its length and a hash of up to FINGERPRINT_SAMPLE items at
    evenly spaced indices (all of them for smaller datasets; first and last
    always), as the data loader sees them. Numbers hash the same whether they
    come as tensors, arrays or lists, so one content gives one fingerprint in
    whatever dataset class holds it. Define ``fingerprint()`` on a dataset for
    one that covers every item of a large dataset.
    """
    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        return str(own())
    size = len(dataset)
    digest = hashlib.sha256(str(size).encode())
    if size:
        indices = np.unique(np.linspace(0, size - 1, num=min(size, FINGERPRINT_SAMPLE)).round().astype(np.int64))
        for index in indices.tolist():
            _hash_item(digest, dataset[index])
    return digest.hexdigest()[:16]


def _hash_item(digest: Any, item: Any) -> None:
    if isinstance(item, Mapping):
        for key in sorted(item, key=str):
            digest.update(f"<{key}>".encode())
            _hash_item(digest, item[key])
        return
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    elif isinstance(item, (list, tuple)) and all(isinstance(x, (int, float, bool, np.number)) for x in item):
        item = np.asarray(item)
    if isinstance(item, np.ndarray) and item.dtype != object:
        digest.update(f"{item.dtype.kind}{item.dtype.itemsize}{item.shape}".encode())
        digest.update(np.ascontiguousarray(item).tobytes())
    elif isinstance(item, (list, tuple)):
        digest.update(f"[{len(item)}".encode())
        for part in item:
            _hash_item(digest, part)
    else:
        digest.update(repr(item).encode())


def read_jsonl(path: Union[str, os.PathLike]) -> list[dict]:
    """The records of a JSONL file (blank lines skipped)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl(records: Sequence[Mapping[str, Any]], path: Union[str, os.PathLike]) -> None:
    """One JSON object per line, written atomically."""
    write_jsonl_atomic(path, records)


def read_records(source: Source) -> list[dict]:
    """Records from a JSONL file, a ``datasets`` ``save_to_disk`` folder (one split), or a list of dicts."""
    if not isinstance(source, (str, os.PathLike)):
        return [dict(r) for r in source]
    path = Path(source)
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if len(loaded) != 1:
                raise ValueError(f"{path} holds splits {list(loaded)}; point at one split's folder")
            loaded = next(iter(loaded.values()))
        return loaded.to_list()
    if path.is_file():
        return read_jsonl(path)
    raise FileNotFoundError(f"no JSONL file or save_to_disk folder at {path}")


def load_instruction_dataset(source: Source, tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH
                             ) -> InstructionDataset:
    """An InstructionDataset from a JSONL file, a ``datasets.Dataset.save_to_disk`` folder, or records."""
    return InstructionDataset(read_records(source), tokenizer, max_length=max_length)
