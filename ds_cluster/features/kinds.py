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

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Optional

import torch

from ds_cluster.dataset import IGNORE_INDEX
from ds_cluster.features.projection import KroneckerProjection, kronecker_projection

DEFAULT_CHUNK_SIZE = 256
DEFAULT_LM_HEAD_DIM = 1024
# logits_at(sample indices, positions) -> (n, V) logits at those positions.
LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FeatureKind(ABC):
    """One kind of per-sample feature: its dimension, its projection, and one chunk's contribution."""

    name: ClassVar[str]

    @abstractmethod
    def resolve_dim(self, dim: Optional[int], vocab: int, hidden: int) -> int:
        """The feature dimension for an output layer of (vocab, hidden); ValueError for a `dim` it cannot give."""

    def projection(self, dim: int, vocab: int, hidden: int, seed: int) -> Optional[KroneckerProjection]:
        """The random projection the kind needs (None: it needs none)."""
        return None

    @abstractmethod
    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        """(n, d) rows to add for n response positions: log-softmax (n, V), gold ids (n,), h_t (n, H), 1/|R| (n,)."""


class Proxy(FeatureKind):
    """The paper's feature: mean over response positions of (p_t - 1) h_t; d = hidden size."""

    name = "proxy"

    def resolve_dim(self, dim: Optional[int], vocab: int, hidden: int) -> int:
        if dim is not None and dim != hidden:
            raise ValueError(f"proxy features have the hidden size ({hidden}) as dimension; got dim={dim}. "
                             "Leave dim unset, or use kind='lm_head' for a projected gradient of chosen size.")
        return hidden

    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        # p_t - 1 = expm1(log p_t): accurate when the model is confident.
        coef = torch.expm1(log_probs.gather(1, gold.unsqueeze(1)).squeeze(1)) * weights
        return coef.unsqueeze(1) * hidden


class LmHead(FeatureKind):
    """The exact output-layer gradient, projected to `dim` through its two factors (never formed)."""

    name = "lm_head"

    def resolve_dim(self, dim: Optional[int], vocab: int, hidden: int) -> int:
        if dim is None:
            return min(DEFAULT_LM_HEAD_DIM, vocab * hidden)
        if dim > vocab * hidden:
            raise ValueError(f"dim={dim} is larger than the output-layer gradient it projects "
                             f"({vocab} x {hidden} = {vocab * hidden} values); choose dim <= {vocab * hidden}")
        return dim

    def projection(self, dim: int, vocab: int, hidden: int, seed: int) -> Optional[KroneckerProjection]:
        return kronecker_projection(dim, vocab, hidden, seed)

    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        if projection is None:
            raise ValueError("kind 'lm_head' needs a projection")
        # P_out^T (softmax_t - onehot_t) and P_in^T h_t; their outer product is the projected gradient.
        out_factor = log_probs.exp() @ projection.p_out - projection.p_out[gold]
        in_factor = hidden @ projection.p_in
        return (weights[:, None, None] * out_factor.unsqueeze(2) * in_factor.unsqueeze(1)).flatten(1)


FEATURE_KINDS: dict[str, FeatureKind] = {kind.name: kind for kind in (Proxy(), LmHead())}


def feature_kind(name: str) -> FeatureKind:
    """The feature kind a config or command line names; ValueError naming the kinds there are."""
    if name not in FEATURE_KINDS:
        raise ValueError(f"unknown feature kind {name!r}; use 'proxy' (the paper's feature) or 'lm_head' (the "
                         "exact output-layer gradient, projected)")
    return FEATURE_KINDS[name]


def batch_features(hidden: torch.Tensor, labels: torch.Tensor, logits_at: LogitsAt, kind: FeatureKind,
                   projection: Optional[KroneckerProjection] = None,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-normalised features (B, d) float32 and the empty mask (B,) of one batch.

    hidden (B, T, H): the output layer's input; labels (B, T), unshifted, -100
    ignored; `logits_at(b, t)` the logits of sample b at position t.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(kind, str):
        kind = feature_kind(kind)
    targets = labels[:, 1:].to(hidden.device)
    response = targets != IGNORE_INDEX  # (B, T-1)
    counts = response.sum(dim=1)
    samples, positions = response.nonzero(as_tuple=True)
    # Each sample's feature is a mean over its own response positions.
    weights = 1.0 / counts[samples].float()
    gold = targets[samples, positions]
    dim = projection.dim if projection is not None else hidden.shape[-1]
    rows = torch.zeros(hidden.shape[0], dim, dtype=torch.float32, device=hidden.device)
    for start in range(0, samples.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        b, t = samples[part], positions[part]
        log_probs = torch.log_softmax(logits_at(b, t).float(), dim=-1)  # (n, V)
        rows.index_add_(0, b, kind.contribution(log_probs, gold[part], hidden[b, t].float(), weights[part],
                                                projection))
    return rows, counts == 0


def normalize_rows(rows: torch.Tensor) -> torch.Tensor:
    """L2-normalise each row; zero rows stay zero (never NaN)."""
    norms = rows.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, rows / norms.clamp_min(torch.finfo(rows.dtype).tiny), torch.zeros_like(rows))
