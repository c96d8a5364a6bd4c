"""The weighted language-model loss: each sample's mean token loss times its plan weight.

DeepSpeed averages the scalar it is given over ranks and accumulation
steps, so the mean over the micro-batch of w_i * loss_i makes the update the
stratified estimate of the full-data mean gradient.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ds_cluster.dataset import IGNORE_INDEX


def per_sample_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample over its labelled tokens: (batch,).

    Position t predicts token t+1; labels of -100 are ignored. A sample with
    no labelled token has loss 0 (it carries no gradient), never NaN.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    token_loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view(shift_labels.shape)
    counts = (shift_labels != IGNORE_INDEX).sum(dim=1)
    return token_loss.sum(dim=1) / counts.clamp(min=1)


def weighted_lm_loss(logits: torch.Tensor, labels: torch.Tensor, sample_weight: torch.Tensor) -> torch.Tensor:
    """mean_i (w_i * loss_i) over the micro-batch: a scalar with a grad_fn."""
    losses = per_sample_lm_loss(logits, labels)
    return (losses * sample_weight.to(losses.dtype)).mean()


def weighted_causal_lm_loss(outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`weighted_lm_loss` for a Hugging Face causal LM's output and a ds_cluster batch."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return weighted_lm_loss(logits, batch["labels"], batch["sample_weight"])
