"""The first stage: instruction records, their tokenized dataset, and a fingerprint for any dataset.

Records are Alpaca (``instruction``, ``input``, ``output``), prompt/completion (``prompt``, ``completion``:
the prompt used as it is) or chat (``messages`` of role/content turns, or ShareGPT ``conversations`` of
from/value turns; see ``ds_cluster.data.chat`` and docs/data.md). An Alpaca sample is ``<bos> prompt response
<eos>`` padded to a fixed length; only the response and the closing ``<eos>`` are labelled
(``IGNORE_INDEX`` elsewhere), so the loss, and the gradient features computed from it, are about
answering, not about reading the prompt. The prompt is the Alpaca template. A chat
sample is the conversation rendered with the tokenizer's chat template, its assistant tokens labelled.
A tokenizer without a pad token pads with eos (else unk); one without bos gets none prepended. The
attention mask and the labels come from each sample's length, never from comparing ids with the pad id,
which may be eos.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from ds_cluster.data.chat import (chat_field, chat_messages, check_chat_template, encode_chat_prompt,
                                  encode_conversation, last_assistant_turn, truncate_conversation)
from ds_cluster.fileio import write_jsonl_atomic
from ds_cluster.data.special_tokens import bos_prefix, ensure_pad_token, pad_token_id_or_zero

# Labels with this value carry no loss (the Hugging Face and PyTorch convention).
IGNORE_INDEX = -100
DEFAULT_MAX_LENGTH = 96

# The Alpaca template's headers.
INSTRUCTION_HEADER = "### Instruction:\n"
INPUT_HEADER = "### Input:\n"
RESPONSE_HEADER = "### Response:\n"

# A path, records, or a ``datasets.Dataset`` (a sequence of records too).
Source = Union[str, os.PathLike, Sequence[Mapping[str, Any]]]
# How many items the default fingerprint of a dataset without its own reads.
FINGERPRINT_SAMPLE = 1024


def format_prompt(record: Mapping[str, Any]) -> str:
    """The Alpaca prompt up to and including the response header; no input section when input is empty."""
    prompt = f"{INSTRUCTION_HEADER}{record['instruction']}\n\n"
    if record.get("input"):
        prompt += f"{INPUT_HEADER}{record['input']}\n\n"
    return prompt + RESPONSE_HEADER


def encode_prompt(tokenizer: Any, record: Mapping[str, Any], index: int = 0) -> list[int]:
    """What the model is given at generation time: ``<bos>`` (when the tokenizer has one) + the prompt's token ids.

    For a chat record: the conversation before its last assistant turn, with the template's generation prompt.
    """
    if chat_field(record):
        check_chat_template(tokenizer, record, index)
        return encode_chat_prompt(tokenizer, chat_messages(record, index), index)
    prompt_text, _ = _prompt_and_response(record, index)
    return bos_prefix(tokenizer) + tokenizer(prompt_text, add_special_tokens=False)["input_ids"]


def encode_example(tokenizer: Any, record: Mapping[str, Any], max_length: int, index: int = 0
                   ) -> tuple[list[int], list[int]]:
    """Token ids and labels (unpadded) of one record, at most ``max_length`` long.

    When too long, the prompt loses tokens from its start first (the response
    header next to the answer survives longest), then the response its end;
    a leading bos always stays. A chat record loses tokens from the start of
    the conversation, never past the start of its last assistant turn, then
    from its end. ``index`` names the record in error messages.
    """
    if chat_field(record):
        return _encode_chat_example(tokenizer, record, max_length, index)
    prompt = encode_prompt(tokenizer, record, index)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"record {index}: a response ends with the eos token, and the tokenizer "
                         "has none: set tokenizer.eos_token")
    _, response_text = _prompt_and_response(record, index)
    response = tokenizer(response_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    lead = len(bos_prefix(tokenizer))
    overflow = len(prompt) + len(response) - max_length
    if overflow > 0:
        kept_prompt_text = prompt[lead:][min(overflow, len(prompt) - lead):]
        prompt = prompt[:lead] + kept_prompt_text
        response = response[: max_length - len(prompt)]
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


def _encode_chat_example(tokenizer: Any, record: Mapping[str, Any], max_length: int, index: int
                         ) -> tuple[list[int], list[int]]:
    check_chat_template(tokenizer, record, index)
    ids, assistant = encode_conversation(tokenizer, chat_messages(record, index), index)
    bos = bos_prefix(tokenizer)
    lead = 1 if bos and ids[:1] == bos else 0  # the template's own bos stays, as in an Alpaca sample
    ids, assistant = truncate_conversation(ids, assistant, max_length, lead)
    return ids, [token if labelled else IGNORE_INDEX for token, labelled in zip(ids, assistant)]


def _prompt_and_response(record: Mapping[str, Any], index: int) -> tuple[str, str]:
    """The prompt text and the response text of an Alpaca or a prompt/completion record, checked."""
    # None counts as absent: Arrow-backed records hold None for a column another record has.
    prompt_completion = record.get("prompt") is not None and record.get("instruction") is None
    fields = ("prompt", "completion") if prompt_completion else ("instruction", "output")
    for field in fields:
        if field not in record:
            raise ValueError(f"record {index}: field {field!r} is missing (a record needs 'instruction' and "
                             f"'output', or 'prompt' and 'completion', or 'messages', or 'conversations'); its "
                             f"fields: {sorted(record)}")
        if not isinstance(record[field], str):
            raise ValueError(f"record {index}: field {field!r} must be a string, got "
                             f"{type(record[field]).__name__}")
    if fields[0] == "prompt":
        return record["prompt"], record["completion"]
    if record.get("input") is not None and not isinstance(record["input"], str):
        raise ValueError(f"record {index}: field 'input' must be a string, got {type(record['input']).__name__}")
    return format_prompt(record), record["output"]


def prompt_text(record: Mapping[str, Any], index: int = 0) -> str:
    """What the user asked, as plain text (no template): an Alpaca record's instruction and input, a
    prompt/completion record's prompt, a chat record's turns before its last assistant turn. For reading
    (the report's cluster descriptions), never for training."""
    if chat_field(record) is not None:
        messages = chat_messages(record, index)
        last = last_assistant_turn(messages)
        return "\n".join(message["content"] for message in messages[:last])
    if record.get("prompt") is not None and record.get("instruction") is None:
        return str(record["prompt"])
    return "\n".join(str(record[field]) for field in ("instruction", "input") if record.get(field))


class InstructionDataset(Dataset):
    """Fixed-length tokenized instruction records, all tensors built once up front.

    Items hold ``input_ids``, ``attention_mask`` and ``labels`` (int64, length
    ``max_length``) and nothing else, so the default collate works; the raw
    records (with any metadata such as a ``category``) stay in ``self.records``.
    A tokenizer without a pad token gets one (``ensure_pad_token``: eos, else
    unk; one log line on rank 0, ``rank`` else the ``RANK`` variable).
    """

    def __init__(self, records: Sequence[Mapping[str, Any]], tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH,
                 rank: Optional[int] = None, source: Optional[str] = None):
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        ensure_pad_token(tokenizer, rank)
        self.records: list[dict] = [dict(_as_record(r, index)) for index, r in enumerate(records)]
        self.max_length = max_length
        self.tokenizer = tokenizer  # a feature model's re-encoding renders chat records with its template
        self.source = source  # the file or folder the records were read from (an analysis records it), if any
        count = len(self.records)
        # Padded positions are never read (mask 0, label -100): any id would do; the pad id keeps them tidy.
        self.input_ids = torch.full((count, max_length), pad_token_id_or_zero(tokenizer), dtype=torch.int64)
        self.attention_mask = torch.zeros((count, max_length), dtype=torch.int64)
        self.labels = torch.full((count, max_length), IGNORE_INDEX, dtype=torch.int64)
        for row, record in enumerate(self.records):
            ids, labels = encode_example(tokenizer, record, max_length, index=row)
            self.input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            self.attention_mask[row, : len(ids)] = 1  # from the length: pad may be eos, a real token
            self.labels[row, : len(labels)] = torch.tensor(labels, dtype=torch.int64)

    @property
    def categories(self) -> list[str]:
        """Every record's task group (`task_group`: its ``category``, else its ``family``, else '')."""
        return [task_group(r) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "labels": self.labels[index]}


# Batches are cut to their longest row rounded up to a multiple of this: GPU kernels prefer such widths.
PAD_MULTIPLE = 8


def trim_padding_collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a micro-batch of token items and cut the trailing columns that no row attends to.

    InstructionDataset rows are padded on the right to ``max_length``, mostly with pad: the model then
    computes only the columns some row of this batch uses, rounded up to a multiple of ``PAD_MULTIPLE`` (at
    most the full width). Causal attention and the -100 labels of pad make the trimmed batch's loss that
    of the padded one (up to float rounding); a left-padded batch keeps its width. At least 2 columns
    stay for the label shift. The hook's loader uses it when the training script passes no collate_fn.
    """
    batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}
    return trim_padding(batch)


def trim_padding(batch: dict[str, Any]) -> dict[str, Any]:
    """A collated batch (2-D tensors of one width) cut to its longest attended row, rounded up to PAD_MULTIPLE."""
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return batch  # nothing says which columns are padding
    used = mask.bool().any(dim=0).nonzero()
    last = max(int(used.max()) + 1 if used.numel() else 0, 2)
    width = min(-(-last // PAD_MULTIPLE) * PAD_MULTIPLE, mask.shape[1])
    return {key: (value[:, :width] if isinstance(value, torch.Tensor) and value.dim() == 2
                  and value.shape[1] == mask.shape[1] else value) for key, value in batch.items()}


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


# The fields that name a record's task group, first found first: what the analysis's purity, the report's
# cluster-versus-category table and the evaluation's per-group figures read.
TASK_GROUP_FIELDS = ("category", "family")


def task_group(record: Mapping[str, Any]) -> str:
    """A record's task group: its ``category``, else its ``family``, else '' (a None field counts as absent)."""
    return str(_first_present(record, TASK_GROUP_FIELDS, ""))


def _first_present(record: Mapping[str, Any], fields: Sequence[str], default: Any) -> Any:
    # Arrow-backed records hold None for a column another record has, so None counts as absent.
    return next((record[field] for field in fields if record.get(field) is not None), default)


def _as_record(record: Any, index: int) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise ValueError(f"record {index} must be an object of fields (a dict), got {type(record).__name__}: "
                         f"{record!r:.80}")
    return record


def read_jsonl(path: Union[str, os.PathLike]) -> list[dict]:
    """The records of a JSONL file, gzip-compressed or not (blank lines skipped); ValueError naming a bad line."""
    with open(path, "rb") as probe:
        compressed = probe.read(2) == b"\x1f\x8b"  # gzip's magic number, whatever the file's suffix
    opener = gzip.open if compressed else open
    records = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(path)} line {line_number}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{os.fspath(path)} line {line_number}: a record must be a JSON object, got "
                                 f"{type(record).__name__}")
            records.append(record)
    return records


def write_jsonl(records: Sequence[Mapping[str, Any]], path: Union[str, os.PathLike]) -> None:
    """One JSON object per line, written atomically."""
    write_jsonl_atomic(path, records)


def _one_split(loaded: Any, fix: str) -> Any:
    """The Dataset of a one-split DatasetDict (ValueError with ``fix`` for several), any other object as is."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if len(loaded) != 1:
            raise ValueError(f"the data holds splits {list(loaded)}; {fix}")
        loaded = next(iter(loaded.values()))
    return loaded


def read_records(source: Source) -> list[dict]:
    """Records from a JSONL file (``.jsonl`` or gzipped ``.jsonl.gz``), a ``datasets`` ``save_to_disk`` folder
    (one split), a ``datasets.Dataset`` (or a one-split ``DatasetDict``), or a list of dicts."""
    if not isinstance(source, (str, os.PathLike)):
        datasets = sys.modules.get("datasets")  # a datasets object exists only once the library is imported
        if datasets is not None and isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
            source = _one_split(source, "pass one split, e.g. dataset['train']").to_list()
        return [dict(_as_record(r, index)) for index, r in enumerate(source)]
    path = Path(source)
    if path.is_dir():
        import datasets

        return _one_split(datasets.load_from_disk(str(path)), f"point at one split's folder in {path}").to_list()
    if path.is_file() and path.suffix == ".arrow":  # a datasets.Dataset's own file (its cache file)
        import datasets

        return datasets.Dataset.from_file(str(path)).to_list()
    if path.is_file():
        return read_jsonl(path)
    raise FileNotFoundError(f"no JSONL file or save_to_disk folder at {path}")


def load_instruction_dataset(source: Source, tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH,
                             rank: Optional[int] = None) -> InstructionDataset:
    """An InstructionDataset from a JSONL file (optionally gzipped), a ``datasets.Dataset`` or its
    ``save_to_disk`` folder, or records; Alpaca and chat records alike (see ``InstructionDataset``). A file or
    folder is remembered as the dataset's ``source`` (an analysis of it records where its records are)."""
    path = os.path.abspath(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else None
    return InstructionDataset(read_records(source), tokenizer, max_length=max_length, rank=rank, source=path)


def source_fingerprint(path: Union[str, os.PathLike]) -> str:
    """What identifies a data file's (or a save_to_disk folder's) bytes: a hash of its content (a folder's files,
    with their names), so a report can tell whether the records are still the ones an analysis was made of."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*")) if root.is_dir() else [root]:
        if file.is_file():
            digest.update(str(file.relative_to(root) if root.is_dir() else file.name).encode())
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def source_path(dataset: Any) -> Optional[str]:
    """The file or folder a dataset's records can be read again from: an InstructionDataset's (or any dataset's)
    ``source``, or the one Arrow file a ``datasets.Dataset`` is backed by; None for records built in memory."""
    path = getattr(dataset, "source", None)
    if path is None:
        cache_files = getattr(dataset, "cache_files", None)
        if isinstance(cache_files, list) and len(cache_files) == 1:
            path = cache_files[0].get("filename")
    if not isinstance(path, (str, os.PathLike)) or not Path(path).exists():
        return None
    return os.path.abspath(os.fspath(path))


def records_source(dataset: Any) -> Optional[dict[str, str]]:
    """{"path", "fingerprint"} of where a dataset's records can be read again (`source_path`), else None."""
    path = source_path(dataset)
    return None if path is None else {"path": path, "fingerprint": source_fingerprint(path)}
