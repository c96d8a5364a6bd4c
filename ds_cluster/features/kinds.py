"""The per-sample feature of one batch, from the output layer's input and logits (pure torch).

Kinds (docs/design.md, "Features"):

- ``proxy``: g(x) = mean_{t in R} (p_t - 1) h_t, the gold-token rows of the
  per-token output-layer gradients (the paper's feature, d = hidden size);
- ``lm_head``: the exact per-sample gradient of the mean response-token loss
  with respect to the whole output matrix, G = mean_t (softmax_t - onehot_t) h_t^T,
  projected to ``dim`` through its two factors (projection.py), never formed.

R are the response positions (labels != -100 after the shift: position t
predicts token t+1). The softmax over the vocabulary is taken `chunk_size`
response positions at a time, so the extra memory is chunk_size x vocabulary,
whatever the answers' length.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ds_cluster.dataset import IGNORE_INDEX
from ds_cluster.features.projection import KroneckerProjection

DEFAULT_CHUNK_SIZE = 256
# logits_at(sample indices, positions) -> (n, V) logits at those positions.
LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batch_features(hidden: torch.Tensor, labels: torch.Tensor, logits_at: LogitsAt, kind: str,
                   projection: Optional[KroneckerProjection] = None,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-normalised features (B, d) float32 and the empty mask (B,) of one batch.

    hidden (B, T, H): the output layer's input; labels (B, T), unshifted, -100
    ignored; `logits_at(b, t)` the logits of sample b at position t.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    targets = labels[:, 1:].to(hidden.device)
    response = targets != IGNORE_INDEX  # (B, T-1)
    counts = response.sum(dim=1)
    samples, positions = response.nonzero(as_tuple=True)
    # Each sample's feature is a mean over its own response positions.
    weights = 1.0 / counts[samples].float()
    gold = targets[samples, positions]
    if kind == "proxy":
        dim = hidden.shape[-1]
    elif kind == "lm_head":
        if projection is None:
            raise ValueError("kind 'lm_head' needs a projection")
        dim = projection.dim
    else:
        raise ValueError(f"unknown feature kind {kind!r}")
    rows = torch.zeros(hidden.shape[0], dim, dtype=torch.float32, device=hidden.device)
    for start in range(0, samples.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        b, t = samples[part], positions[part]
        log_probs = torch.log_softmax(logits_at(b, t).float(), dim=-1)  # (n, V)
        h = hidden[b, t].float()
        if kind == "proxy":
            # p_t - 1 = expm1(log p_t): accurate when the model is confident.
            coef = torch.expm1(log_probs.gather(1, gold[part].unsqueeze(1)).squeeze(1)) * weights[part]
            rows.index_add_(0, b, coef.unsqueeze(1) * h)
        else:
            # P_out^T (softmax_t - onehot_t) and P_in^T h_t; their outer product is the projected gradient.
            out_factor = log_probs.exp() @ projection.p_out - projection.p_out[gold[part]]
            in_factor = h @ projection.p_in
            contribution = (weights[part, None, None] * out_factor.unsqueeze(2) * in_factor.unsqueeze(1)).flatten(1)
            rows.index_add_(0, b, contribution)
    return rows, counts == 0


def normalize_rows(rows: torch.Tensor) -> torch.Tensor:
    """L2-normalise each row; zero rows stay zero (never NaN)."""
    norms = rows.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, rows / norms.clamp_min(torch.finfo(rows.dtype).tiny), torch.zeros_like(rows))
