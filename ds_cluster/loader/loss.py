"""The weighted language-model loss of one micro-batch.

DeepSpeed divides the scalar it is given by the accumulation steps and
averages the gradients over ranks. Two normalisations (the config's
`loss_reduction`, applied by the loader through each item's
`loss_normalizer`):

- "sample": mean over the micro-batch of w_i * loss_i, loss_i the mean of
  sample i's response-token losses (every sample counts the same);
- "token": sum over the micro-batch of w_i * (sum of sample i's
  response-token losses) / loss_normalizer, where the loader sets the
  normaliser so that the update is the weighted token losses summed over the
  response tokens of the whole global batch and divided by their number (the
  Hugging Face Trainer convention, and the reference implementation's, which
  weights the Trainer's token-level loss).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from ds_cluster.data.dataset import IGNORE_INDEX

# The batch field the loader adds for the token reductions.
LOSS_NORMALIZER = "loss_normalizer"


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's summed next-token cross-entropy over its labelled tokens, and their count: (batch,) each."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    token_loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view(shift_labels.shape)
    return token_loss.sum(dim=1), (shift_labels != IGNORE_INDEX).sum(dim=1)


def per_sample_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample over its labelled tokens: (batch,).

    Position t predicts token t+1; labels of -100 are ignored. A sample with
    no labelled token has loss 0 (it carries no gradient), never NaN.
    """
    sums, counts = token_loss_sums(logits, labels)
    return sums / counts.clamp(min=1)


def weighted_lm_loss(logits: torch.Tensor, labels: torch.Tensor, sample_weight: torch.Tensor,
                     loss_normalizer: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The micro-batch's weighted loss, a scalar with a grad_fn (see the module docstring).

    Without `loss_normalizer` ("sample"): mean_i w_i loss_i. With it ("token", one value per item):
    sum_i w_i (summed token losses of i) / normalizer_i.
    """
    sums, counts = token_loss_sums(logits, labels)
    return _weighted(sums, counts, sample_weight, loss_normalizer)


def _weighted(sums: torch.Tensor, counts: torch.Tensor, sample_weight: torch.Tensor,
              loss_normalizer: Optional[torch.Tensor]) -> torch.Tensor:
    if loss_normalizer is None:
        return ((sums / counts.clamp(min=1)) * sample_weight.to(sums.dtype)).mean()
    return (sums * sample_weight.to(sums.dtype) / loss_normalizer.to(sums.dtype)).sum()


# The attribute of the returned loss that carries (sample indices, per-sample mean losses) to the adaptive
# schedule: `engine.backward(loss)` under the hook hands them to the loader, so the training loop stays as it is.
SAMPLE_LOSSES = "ds_cluster_sample_losses"


def weighted_causal_lm_loss(outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`weighted_lm_loss` for a Hugging Face causal LM's output and a ds_cluster batch.

    The returned scalar also carries each sample's mean response-token loss (detached), with the batch's
    `sample_index`, as its `ds_cluster_sample_losses` attribute: what the adaptive schedule learns from.
    """
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    labels, weights, normalizer = batch["labels"], batch["sample_weight"], batch.get(LOSS_NORMALIZER)
    sums, counts = token_loss_sums(logits, labels)
    loss = _weighted(sums, counts, weights, normalizer)
    if "sample_index" in batch:
        setattr(loss, SAMPLE_LOSSES, (batch["sample_index"], (sums / counts.clamp(min=1)).detach()))
    return loss


def causal_lm_loss(outputs: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The plain loss of a micro-batch without ds_cluster's fields (DeepSpeed's own loader, the block disabled):
    the mean next-token cross-entropy over all its response tokens, as a Hugging Face causal LM computes it."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    sums, counts = token_loss_sums(logits, batch["labels"])
    return sums.sum() / counts.sum().clamp(min=1)


def probe_losses(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each sample's mean response-token loss under `model` (a module or a DeepSpeed engine), forward only, in
    eval mode; the model's mode is restored. What the adaptive schedule's probe set is scored with."""
    was_training = model.training
    model.eval()
    try:
        device = next(iter(model.parameters())).device
        with torch.no_grad():
            outputs = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
        return per_sample_lm_loss(logits, batch["labels"].to(device))
    finally:
        model.train(was_training)
