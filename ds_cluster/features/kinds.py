"""The kinds of per-sample feature, in a registry (`FEATURE_KINDS`, the `feature_kind` key).

Each kind gives its dimension, its projection and one chunk of response
positions' contribution, computed on the tensors it is handed (no torch
import here: the config reads the registry). Kinds (docs/design.md, "Features"):

- ``proxy``: g(x) = mean_{t in R} (p_t - 1) h_t, the gold-token rows of the
  per-token output-layer gradients (the paper's feature, d = hidden size);
- ``lm_head``: the exact per-sample gradient of the mean response-token loss
  with respect to the whole output matrix, G = mean_t (softmax_t - onehot_t) h_t^T,
  projected to ``dim`` through its two factors (projection.py), never formed;
- ``lora``: the exact per-sample gradient of the mean response-token loss with
  respect to every LoRA adapter matrix (the trainable parameters of a PEFT
  model), each projected the same way and summed (adapters.py);
- ``hidden``: no gradient, a representation (after RDS+): the output layer's input
  h_t mean-pooled over every attended position (prompt and response) with weights
  rising with the position, w_i = i / sum_j j for the i-th attended token
  (1-based); d = hidden size. Read from the forward alone: no logits, no softmax.

R are the response positions (labels != -100 after the shift: position t
predicts token t+1); `extract.batch_features` feeds them a chunk at a time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Optional, Union

from ds_cluster.registry import Registry

if TYPE_CHECKING:  # the math runs on tensors it is handed: importing the registry (the config does) needs no torch
    import torch

    from ds_cluster.features.projection import KroneckerProjection

DEFAULT_LM_HEAD_DIM = 1024


class FeatureKind(ABC):
    """One kind of per-sample feature: its dimension, its projection, and one chunk's contribution."""

    name: ClassVar[str]
    summary: ClassVar[str]  # a few words for messages and docs
    # Whether the dimension is chosen (`feature_dim`, a random projection) rather than fixed by the model.
    projected: ClassVar[bool] = False
    # Whether the feature is the gradient of the model's LoRA adapters (adapters.py) rather than the output layer's.
    adapter_gradients: ClassVar[bool] = False
    # Whether the feature reads the response positions' logits (the output layer's weight, gathered under ZeRO-3);
    # a kind that does not pools the output layer's input itself (`pool`).
    reads_logits: ClassVar[bool] = True

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


class _HiddenSized(FeatureKind):
    """A kind whose dimension is the model's hidden size."""

    def resolve_dim(self, dim: Optional[int], vocab: int, hidden: int) -> int:
        if dim is not None and dim != hidden:
            raise ValueError(f"{self.name} features have the hidden size ({hidden}) as dimension; got dim={dim}. "
                             "Leave dim unset, or use kind='lm_head' for a projected gradient of chosen size.")
        return hidden


class Proxy(_HiddenSized):
    """The paper's feature: mean over response positions of (p_t - 1) h_t; d = hidden size."""

    name = "proxy"
    summary = "the paper's feature"

    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        # p_t - 1 = expm1(log p_t): accurate when the model is confident.
        coef = log_probs.gather(1, gold.unsqueeze(1)).squeeze(1).expm1() * weights
        return coef.unsqueeze(1) * hidden


class LmHead(FeatureKind):
    """The exact output-layer gradient, projected to `dim` through its two factors (never formed)."""

    name = "lm_head"
    summary = "the exact output-layer gradient, projected"
    projected = True

    def resolve_dim(self, dim: Optional[int], vocab: int, hidden: int) -> int:
        if dim is None:
            return min(DEFAULT_LM_HEAD_DIM, vocab * hidden)
        if dim > vocab * hidden:
            raise ValueError(f"dim={dim} is larger than the output-layer gradient it projects "
                             f"({vocab} x {hidden} = {vocab * hidden} values); choose dim <= {vocab * hidden}")
        return dim

    def projection(self, dim: int, vocab: int, hidden: int, seed: int) -> Optional[KroneckerProjection]:
        from ds_cluster.features.projection import kronecker_projection

        return kronecker_projection(dim, vocab, hidden, seed)

    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        if projection is None:
            raise ValueError("kind 'lm_head' needs a projection")
        # P_out^T (softmax_t - onehot_t) and P_in^T h_t; their outer product is the projected gradient.
        out_factor = log_probs.exp() @ projection.p_out - projection.p_out[gold]
        in_factor = hidden @ projection.p_in
        return (weights[:, None, None] * out_factor.unsqueeze(2) * in_factor.unsqueeze(1)).flatten(1)


class Lora(FeatureKind):
    """The per-sample gradient of every LoRA adapter matrix, each layer projected to `dim` and summed
    (`ds_cluster.features.adapters`); the model must be a PEFT model with LoRA adapters."""

    name = "lora"
    summary = "the LoRA adapters' per-sample gradients, projected"
    projected = True
    adapter_gradients = True

    def resolve_dim(self, dim: Optional[int], vocab: int, hidden: int) -> int:
        if dim is None:
            return DEFAULT_LM_HEAD_DIM
        if dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {dim}")
        return dim

    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        raise TypeError("kind 'lora' reads the adapters' gradients, not the output layer's: "
                        "ds_cluster.features.adapters computes it")


class Hidden(_HiddenSized):
    """The last hidden layer (the output layer's input), mean-pooled with weights rising with the position over the
    prompt and response tokens; d = hidden size. A forward pass alone: no logits, nothing gathered beyond it."""

    name = "hidden"
    summary = "the last hidden layer, position-weighted mean"
    reads_logits = False

    def contribution(self, log_probs: torch.Tensor, gold: torch.Tensor, hidden: torch.Tensor,
                     weights: torch.Tensor, projection: Optional[KroneckerProjection]) -> torch.Tensor:
        raise TypeError("kind 'hidden' reads no logits: its rows come from `pool`")

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, H) float32: sum_t w_t h_t over the attended positions, w_t = i_t / sum_s i_s, i_t the 1-based place of
        position t among them (RDS+'s position-weighted mean); an all-padding row gives 0."""
        mask = attention_mask.to(hidden.device).float()
        place = mask.cumsum(dim=1) * mask
        weights = place / place.sum(dim=1, keepdim=True).clamp_min(1.0)
        return (weights.unsqueeze(1) @ hidden.float()).squeeze(1)  # tensor methods: no torch import here


_KINDS = (Proxy(), LmHead(), Lora(), Hidden())


def _unknown_kind(name: str) -> str:
    choices = " or ".join(f"{kind.name!r} ({kind.summary})" for kind in _KINDS)
    message = f"unknown feature kind {name!r}; use {choices}"
    if name == "layers":  # the kind the paper's ablation names: say why it is absent
        message += ". 'layers' is not available: per-sample gradients of inner layers are not implemented"
    return message


FEATURE_KINDS: Registry[FeatureKind] = Registry("feature_kind", _KINDS, describe_unknown=_unknown_kind)


def feature_kind(kind: Union[str, FeatureKind]) -> FeatureKind:
    """The feature kind a config or command line names; ValueError naming the kinds there are."""
    return FEATURE_KINDS.get_rule(kind)
