"""Alpaca-style prompts and a tokenized instruction dataset for causal-LM fine-tuning.

A sample is ``<s> prompt response </s>`` padded to a fixed length; only the
response and the closing ``</s>`` are labelled, so the loss (and the gradient
features computed from it) is about answering, not about reading the prompt.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Mapping, Sequence, Union

import torch
from torch.utils.data import Dataset

from ds_cluster.data.tasks import read_jsonl
from ds_cluster.data.tokenizer import INPUT_HEADER, INSTRUCTION_HEADER, RESPONSE_HEADER

IGNORE_INDEX = -100
DEFAULT_MAX_LENGTH = 96

Source = Union[str, os.PathLike, Sequence[Mapping[str, str]]]


def format_prompt(record: Mapping[str, str]) -> str:
    """The Alpaca prompt up to and including the response header; no input section when input is empty."""
    prompt = f"{INSTRUCTION_HEADER}{record['instruction']}\n\n"
    if record.get("input"):
        prompt += f"{INPUT_HEADER}{record['input']}\n\n"
    return prompt + RESPONSE_HEADER


def encode_prompt(tokenizer, record: Mapping[str, str]) -> list[int]:
    """``<s>`` + the prompt's token ids: what the model is given at generation time."""
    return [tokenizer.bos_token_id] + tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]


def encode_example(tokenizer, record: Mapping[str, str], max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (unpadded) of one record, at most ``max_length`` long.

    When too long, the prompt loses tokens from its start first (the response
    header next to the answer survives longest), then the response its end.
    """
    prompt = encode_prompt(tokenizer, record)
    response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    overflow = len(prompt) + len(response) - max_length
    if overflow > 0:
        # Keep <s>; drop from the start of the prompt text.
        kept_prompt_text = prompt[1:][min(overflow, len(prompt) - 1):]
        prompt = prompt[:1] + kept_prompt_text
        response = response[: max_length - len(prompt)]
    input_ids = prompt + response
    labels = [IGNORE_INDEX] * len(prompt) + response
    return input_ids, labels


class InstructionDataset(Dataset):
    """Fixed-length tokenized instruction records, all tensors built once up front.

    Items hold ``input_ids``, ``attention_mask`` and ``labels`` (int64, length
    ``max_length``) and nothing else, so the default collate works; the raw
    records, with their ``family``, stay in ``self.records``.
    """

    def __init__(self, records: Sequence[Mapping[str, str]], tokenizer, max_length: int = DEFAULT_MAX_LENGTH):
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
        return [r.get("family", "") for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


def _read_records(source: Source) -> list[dict]:
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


def load_instruction_dataset(source: Source, tokenizer, max_length: int = DEFAULT_MAX_LENGTH) -> InstructionDataset:
    """An InstructionDataset from a JSONL file, a ``datasets.Dataset.save_to_disk`` folder, or records."""
    return InstructionDataset(_read_records(source), tokenizer, max_length=max_length)


def dataset_fingerprint(dataset: InstructionDataset) -> str:
    """A short sha256 of the token ids and labels: changes whenever the training tensors do."""
    digest = hashlib.sha256()
    for tensor in (dataset.input_ids, dataset.labels):
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
