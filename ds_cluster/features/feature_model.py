"""A separate feature model: a checkpoint used only to compute the features, in its own forward-only engine.

A small model trained on a CPU, or a cheap run, can select its data with the
features of a stronger model (LESS reports that selection transfers across
model sizes). The feature model may have its own tokenizer: every sample's
prompt and response are re-encoded with it, from the dataset's records when
it has them (`InstructionDataset.records`), else by decoding the trained
tokenizer's ids (a dataset with a `tokenizer` attribute), so it scores the
same response text. Chat records meet a feature tokenizer without a chat
template as text rendered with the trained tokenizer's template (the last
assistant turn is the response). The trained model is never touched.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from ds_cluster.data.chat import CHAT_FIELDS, chat_field, chat_messages, last_assistant_turn, render_chat
from ds_cluster.data.dataset import IGNORE_INDEX, InstructionDataset

logger = logging.getLogger(__name__)


def feature_dataset(training_data: Any, feature_tokenizer: Any, max_length: Optional[int] = None) -> InstructionDataset:
    """The training samples re-encoded with the feature model's tokenizer, in the same order.

    `max_length` (in the feature tokenizer's tokens) defaults to the training
    data's own `max_length`. ValueError, naming the fix, for a dataset that has
    neither records nor a tokenizer to decode its ids with.
    """
    length = max_length or getattr(training_data, "max_length", None)
    records = getattr(training_data, "records", None)
    if records is None:
        records = [_decoded_record(training_data, index) for index in range(len(training_data))]
    trained = getattr(training_data, "tokenizer", None)
    if not getattr(feature_tokenizer, "chat_template", None) and getattr(trained, "chat_template", None):
        records = [_rendered_chat_record(trained, record, index) if chat_field(record) else record
                   for index, record in enumerate(records)]
    if length is None:
        raise ValueError("cluster_sampling.feature_max_length is not set and the training data has no max_length: "
                         "set feature_max_length (tokens of the feature model's tokenizer)")
    return InstructionDataset(records, feature_tokenizer, max_length=int(length))


def _rendered_chat_record(tokenizer: Any, record: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A chat record as prompt/completion text, for a feature model without a chat template: the conversation
    before its last assistant turn rendered with the trained tokenizer's template (generation prompt included),
    and that turn's text; the feature model sees the text the trained model reads and scores the last answer."""
    messages = chat_messages(record, index)
    last = last_assistant_turn(messages)
    prompt = render_chat(tokenizer, messages[:last], index, add_generation_prompt=True) if last else ""
    kept = {key: value for key, value in record.items() if key not in CHAT_FIELDS}
    return {**kept, "prompt": prompt, "completion": messages[last]["content"]}


def _decoded_record(training_data: Any, index: int) -> dict[str, str]:
    """A record of raw text from one tokenized sample: the prompt (unlabelled tokens) and the response (labelled)."""
    tokenizer = getattr(training_data, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"cluster_sampling.feature_model re-encodes every sample with the feature model's tokenizer, but the "
            f"training data ({type(training_data).__name__}) has neither `records` (as InstructionDataset has) nor "
            "a `tokenizer` attribute to decode its ids with: set `dataset.tokenizer = <the trained tokenizer>`, "
            "or build it with ds_cluster.data.dataset.InstructionDataset")
    item = training_data[index]
    ids = torch.as_tensor(item["input_ids"]).tolist()
    labels = torch.as_tensor(item["labels"]).tolist()
    mask = torch.as_tensor(item.get("attention_mask", [1] * len(ids))).tolist()
    prompt = [token for token, label, seen in zip(ids, labels, mask) if seen and label == IGNORE_INDEX]
    response = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
    # A prompt/completion record: the decoded prompt already holds whatever template the data used.
    return {"prompt": tokenizer.decode(prompt, skip_special_tokens=True),
            "completion": tokenizer.decode(response, skip_special_tokens=True)}


def __getattr__(name: str) -> Any:
    if name == "feature_engine":
        raise AttributeError("ds_cluster.features.feature_model.feature_engine is gone since 0.6.0: "
                             "ds_cluster.features.source.feature_source builds the feature model's engine (and "
                             "destroys it after)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
