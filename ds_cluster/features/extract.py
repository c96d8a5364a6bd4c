"""Per-sample gradient features from a DeepSpeed engine's forward pass, under any ZeRO stage.

Kinds (docs/design.md, "Features"):

- ``proxy``: g(x) = mean_{t in R} (p_t - 1) h_t, the gold-token rows of the
  per-token output-layer gradients (the paper's feature, d = hidden size);
- ``lm_head``: the exact per-sample gradient of the mean response-token loss
  w.r.t. the whole output matrix, G = mean_t (softmax_t - onehot_t) h_t^T,
  projected to ``dim`` through the two factors (see projection.py);
- ``layers``: not implemented yet.

h_t is the input of the output layer (captured with a forward hook, so it is
exactly what the logits are computed from, after the final norm), p_t the
probability of the gold next token (labels are shifted: token t+1 is the
target of position t, -100 is ignored). Only logits and that input are
needed, so ZeRO-3's sharded output layer works unchanged: the engine gathers
it for the forward as usual. All ranks run the same number of forwards
(ZeRO-3 gathers parameters collectively), padding with a discarded dummy
batch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import numpy as np
import torch

from ds_cluster.dataset import IGNORE_INDEX, dataset_fingerprint
from ds_cluster.distributed import agree_on_error, all_gather_object, check_agreement, get_rank, get_world_size
from ds_cluster.features.projection import KroneckerProjection, kronecker_projection
from ds_cluster.features.store import DEFAULT_SHARD_SIZE, FeatureStore, StoreManifest

logger = logging.getLogger(__name__)

FeatureKind = Literal["proxy", "lm_head", "layers"]
DEFAULT_LM_HEAD_DIM = 1024
# Config keys that name where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
                         "_attn_implementation_autoset", "_commit_hash", "use_cache", "output_hidden_states",
                         "return_dict", "architectures"}
_CHECKSUM_MODULUS = (1 << 61) - 1


@dataclass
class ExtractionResult:
    """What extract_features computed, plus what a report needs."""

    features: np.ndarray  # (N, d) float32, identical on every rank
    empty_mask: np.ndarray  # (N,) bool: samples without response tokens (zero rows)
    kind: str
    dim: int
    computed_shards: list[int] = field(default_factory=list)  # computed by this call, all ranks
    reused_shards: list[int] = field(default_factory=list)  # read back from the store
    seconds: float = 0.0
    manifest: Optional[StoreManifest] = None

    @property
    def num_empty(self) -> int:
        return int(self.empty_mask.sum())


# --------------------------------------------------------------------------- model access
def unwrap_model(engine: Any) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (or the model itself)."""
    return getattr(engine, "module", engine)


def find_output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The layer that maps the last hidden state to the logits."""
    layer = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        layer = getter()
    if layer is None:
        layer = getattr(model, "lm_head", None)
    if layer is None or getattr(layer, "weight", None) is None:
        raise ValueError(
            f"{type(model).__name__} has no output layer to compute gradient features for: looked for "
            "model.get_output_embeddings() (returned None or is missing) and a `lm_head` attribute. "
            "Use a causal language model with an output (lm_head) layer."
        )
    return layer


def output_layer_shape(layer: torch.nn.Module) -> tuple[int, int]:
    """(vocab V, hidden H) of the output matrix, also when ZeRO-3 has partitioned it."""
    weight = layer.weight
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    if len(shape) != 2:
        raise ValueError(f"output layer weight has shape {shape}, expected (vocab, hidden)")
    return int(shape[0]), int(shape[1])


def _device_of(engine: Any, model: torch.nn.Module) -> torch.device:
    device = getattr(engine, "device", None)
    if device is not None:
        return torch.device(device)
    return next(model.parameters()).device


# --------------------------------------------------------------------------- fingerprints
def _parameter_checksum(param: torch.Tensor) -> int:
    """Sum of the float bit patterns of this rank's part of a parameter (exact, so it adds up across ZeRO-3 shards)."""
    partition = getattr(param, "ds_tensor", None)
    if partition is not None:
        # ZeRO-3: this rank holds elements [rank * size, rank * size + size) of the flat
        # parameter; the tail of the last partition is uninitialised padding.
        import torch.distributed as dist

        size = partition.ds_numel if hasattr(partition, "ds_numel") else partition.numel()
        group = getattr(param, "ds_process_group", None)
        rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        valid = max(0, min(size, param.ds_numel - rank * size))
        values = partition.detach().reshape(-1)[:valid]
    else:
        values = param.detach().reshape(-1)
    values = values.cpu().contiguous()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    return int(values.view(bits).to(torch.int64).sum().item()) % _CHECKSUM_MODULUS


def model_fingerprint(engine: Any) -> str:
    """Hash of the model config, parameter names/shapes/dtypes and an exact checksum of every parameter's values.

    Identical across ZeRO stages and world sizes for the same weights: under
    ZeRO-3 each rank sums the bit patterns of its own partition and the sums
    are added across ranks, so no parameter is gathered. Collective: call on
    every rank.
    """
    model = unwrap_model(engine)
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    config_dict = {key: value for key, value in config_dict.items() if key not in _VOLATILE_CONFIG_KEYS}
    names, checksums = [], []
    for name, param in model.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        names.append(f"{name}:{shape}:{param.dtype}")
        checksums.append(_parameter_checksum(param))
    partitioned = any(hasattr(param, "ds_tensor") for param in model.parameters())
    if partitioned:
        per_rank = all_gather_object(checksums)
        checksums = [sum(column) % _CHECKSUM_MODULUS for column in zip(*per_rank)]
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    digest.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    digest.update(json.dumps(names).encode())
    digest.update(json.dumps(checksums).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- the features of one batch
def batch_features(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, kind: str,
                   projection: Optional[KroneckerProjection] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-normalised features (B, d) float32 and the empty mask (B,) of one batch.

    logits (B, T, V), hidden (B, T, H): the output layer's output and input;
    labels (B, T) with -100 ignored, unshifted.
    """
    logits = logits[:, :-1].float()
    hidden = hidden[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    response = targets != IGNORE_INDEX  # (B, T-1)
    counts = response.sum(dim=1)
    empty = counts == 0
    # Weight 1/|R| on response positions, 0 elsewhere: a per-sample mean as one batched product.
    weights = response.float() / counts.clamp_min(1).unsqueeze(1).float()
    positions = response.nonzero(as_tuple=True)
    gold = targets[positions]
    log_probs = torch.log_softmax(logits[positions], dim=-1)  # only response rows: (n, V)
    if kind == "proxy":
        # p_t - 1 = expm1(log p_t): accurate when the model is confident.
        coef = torch.zeros_like(weights)
        coef[positions] = torch.expm1(log_probs.gather(1, gold.unsqueeze(1)).squeeze(1))
        rows = torch.bmm((coef * weights).unsqueeze(1), hidden).squeeze(1)
    elif kind == "lm_head":
        assert projection is not None
        # P_out^T (softmax_t - onehot_t) and P_in^T h_t, then the mean of their outer products.
        out_factor = torch.zeros(*weights.shape, projection.p_out.shape[1], device=logits.device)
        out_factor[positions] = log_probs.exp() @ projection.p_out - projection.p_out[gold]
        in_factor = hidden @ projection.p_in
        rows = torch.bmm((out_factor * weights.unsqueeze(2)).transpose(1, 2), in_factor).flatten(1)
    else:
        raise ValueError(f"unknown feature kind {kind!r}")
    return rows, empty


def normalize_rows(rows: torch.Tensor) -> torch.Tensor:
    """L2-normalise each row; zero rows stay zero (never NaN)."""
    norms = rows.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, rows / norms.clamp_min(torch.finfo(rows.dtype).tiny), torch.zeros_like(rows))


# --------------------------------------------------------------------------- the whole dataset
def _collate(dataset: Sequence[dict], indices: range) -> dict[str, torch.Tensor]:
    items = [dataset[index] for index in indices]
    return {key: torch.stack([torch.as_tensor(item[key]) for item in items])
            for key in ("input_ids", "attention_mask", "labels")}


class _OutputLayerInput:
    """Captures the input of the output layer during a forward pass."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.value: Optional[torch.Tensor] = None
        self._handle = layer.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: tuple, output: Any) -> None:
        self.value = inputs[0]

    def close(self) -> None:
        self._handle.remove()


def _forward(engine: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
             capture: _OutputLayerInput) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"].to(device),
                              "attention_mask": batch["attention_mask"].to(device)}
    if hasattr(getattr(model, "config", None), "use_cache"):
        kwargs["use_cache"] = False
    capture.value = None
    outputs = engine(**kwargs)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    if capture.value is None:
        raise RuntimeError("the output layer was not called during the forward pass; cannot read its input")
    return logits, capture.value


def _resolve_dim(kind: str, dim: Optional[int], vocab: int, hidden: int) -> int:
    if kind == "proxy":
        if dim is not None and dim != hidden:
            raise ValueError(f"proxy features have the hidden size ({hidden}) as dimension; got dim={dim}. "
                             "Leave dim unset, or use kind='lm_head' for a projected gradient of chosen size.")
        return hidden
    if dim is None:
        return min(DEFAULT_LM_HEAD_DIM, vocab * hidden)
    if dim > vocab * hidden:
        raise ValueError(f"dim={dim} is larger than the output-layer gradient it projects "
                         f"({vocab} x {hidden} = {vocab * hidden} values); choose dim <= {vocab * hidden}")
    return dim


def _batches_of(shards: Sequence[int], bounds: Callable[[int], tuple[int, int]], batch_size: int) -> list[tuple[int, range]]:
    """(shard, indices) batches; batches never cross a shard, so a shard is done after its last batch."""
    batches = []
    for shard in shards:
        start, stop = bounds(shard)
        batches += [(shard, range(first, min(stop, first + batch_size))) for first in range(start, stop, batch_size)]
    return batches


def _prepare_store(store: FeatureStore, manifest: StoreManifest, overwrite: bool, rank: int) -> list[int]:
    """Rank 0 creates or checks the store, every rank then checks it; returns the shards left to compute."""
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            store.prepare(manifest, overwrite=overwrite)
        except (ValueError, OSError) as err:
            error = err
    agree_on_error(error, "preparing the feature store")
    error = None
    try:
        store.check(manifest)
        pending = sorted(set(range(manifest.num_shards)) - set(store.finished_shards(manifest)))
    except (ValueError, OSError) as err:
        error, pending = err, []
    agree_on_error(error, "opening the feature store")
    check_agreement(pending, "feature-store shards left to compute (is the store on a filesystem every rank sees?)")
    return pending


def run_extraction(engine: Any, dataset: Sequence[dict], *, kind: FeatureKind, dim: Optional[int] = None,
                   batch_size: int = 8, store: Union[None, str, Path, FeatureStore] = None, seed: int = 0,
                   normalize: bool = True, show_progress: bool = True, shard_size: int = DEFAULT_SHARD_SIZE,
                   overwrite: bool = False,
                   on_shard_done: Optional[Callable[[int], None]] = None) -> ExtractionResult:
    """extract_features with everything it found out: empty mask, shards computed and reused, timing.

    Collective: call on every rank with the same arguments. `on_shard_done(shard)`
    is called after each shard this rank finished (tests use it to crash mid-run).
    """
    if kind == "layers":
        raise NotImplementedError(
            "feature kind 'layers' (per-sample gradients of chosen layers through hooks, with a backward "
            "pass under ZeRO) is not implemented yet; use 'proxy' or 'lm_head'")
    if kind not in ("proxy", "lm_head"):
        raise ValueError(f"unknown feature kind {kind!r}; expected 'proxy', 'lm_head' or 'layers'")
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1, got {batch_size} and {shard_size}")
    started = time.perf_counter()
    rank, world_size = get_rank(), get_world_size()
    model = unwrap_model(engine)
    layer = find_output_layer(model)
    vocab, hidden = output_layer_shape(layer)
    dim = _resolve_dim(kind, dim, vocab, hidden)
    num_samples = len(dataset)
    if num_samples == 0:
        raise ValueError("the dataset is empty: nothing to extract features from")
    device = _device_of(engine, model)
    projection = kronecker_projection(dim, vocab, hidden, seed).to(device) if kind == "lm_head" else None

    feature_store = FeatureStore(store) if isinstance(store, (str, Path)) else store
    manifest = StoreManifest(kind=kind, dim=dim, seed=seed, normalize=normalize,
                             model_fingerprint=model_fingerprint(engine) if feature_store else "",
                             dataset_fingerprint=dataset_fingerprint(dataset) if feature_store else "",
                             num_samples=num_samples, shard_size=shard_size)
    if feature_store is not None:
        pending = _prepare_store(feature_store, manifest, overwrite, rank)
    else:
        pending = list(range(manifest.num_shards))
    run_id = all_gather_object(uuid.uuid4().hex)[0]

    # Shards are dealt round-robin; every rank runs as many forwards as the busiest one.
    shares = [_batches_of(pending[r::world_size], manifest.shard_bounds, batch_size) for r in range(world_size)]
    mine = shares[rank]
    num_forwards = max(len(share) for share in shares)
    dummy = _collate(dataset, range(0, 1))

    computed: dict[int, tuple[np.ndarray, list[int]]] = {}
    partial: dict[int, list[tuple[range, torch.Tensor, torch.Tensor]]] = {}
    shard_started: dict[int, float] = {}
    progress = _progress_bar(sum(len(indices) for _, indices in mine), show_progress and rank == 0, kind)
    capture = _OutputLayerInput(layer)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step in range(num_forwards):
                if step >= len(mine):
                    _forward(engine, model, dummy, device, capture)  # lockstep only; result discarded
                    continue
                shard, indices = mine[step]
                shard_started.setdefault(shard, time.perf_counter())
                batch = _collate(dataset, indices)
                logits, hidden_states = _forward(engine, model, batch, device, capture)
                rows, empty = batch_features(logits, hidden_states, batch["labels"], kind, projection)
                if normalize:
                    rows = normalize_rows(rows)
                partial.setdefault(shard, []).append((indices, rows.cpu(), empty.cpu()))
                progress.update(len(indices))
                if indices.stop == manifest.shard_bounds(shard)[1]:
                    rows_np, empty_idx = _join(partial.pop(shard))
                    if feature_store is not None:
                        feature_store.write_shard(manifest, shard, rows_np, empty_idx, rank, run_id,
                                                  time.perf_counter() - shard_started[shard])
                    computed[shard] = (rows_np, empty_idx)
                    if on_shard_done is not None:
                        on_shard_done(shard)
    finally:
        capture.close()
        model.train(was_training)
        progress.close()

    computed_shards = sorted(shard for shards in all_gather_object(sorted(computed)) for shard in shards)
    if feature_store is not None:
        # Every rank wrote its shards before the gather above: read them all back, validated.
        features, empty_mask = feature_store.assemble(manifest)
    else:
        features = np.zeros((num_samples, dim), dtype=np.float32)
        empty_mask = np.zeros(num_samples, dtype=bool)
        for part in all_gather_object(computed):
            for shard, (rows_np, empty_idx) in part.items():
                start, stop = manifest.shard_bounds(shard)
                features[start:stop] = rows_np
                empty_mask[empty_idx] = True
    if empty_mask.any():
        logger.warning("%d of %d samples have no response tokens (all labels -100): their feature rows are zero",
                       int(empty_mask.sum()), num_samples)
    return ExtractionResult(features=features, empty_mask=empty_mask, kind=kind, dim=dim,
                            computed_shards=computed_shards,
                            reused_shards=sorted(set(range(manifest.num_shards)) - set(pending)),
                            seconds=time.perf_counter() - started,
                            manifest=manifest if feature_store is not None else None)


def extract_features(engine: Any, dataset: Sequence[dict], *, kind: FeatureKind, dim: Optional[int] = None,
                     batch_size: int = 8, store: Union[None, str, Path, FeatureStore] = None, seed: int = 0,
                     normalize: bool = True, show_progress: bool = True, **options: Any) -> np.ndarray:
    """Per-sample features (N, d) float32, identical on every rank; see run_extraction for the options."""
    return run_extraction(engine, dataset, kind=kind, dim=dim, batch_size=batch_size, store=store, seed=seed,
                          normalize=normalize, show_progress=show_progress, **options).features


def _join(parts: list[tuple[range, torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, list[int]]:
    rows = torch.cat([part[1] for part in parts]).numpy().astype(np.float32, copy=False)
    empty = [index for indices, _, flags in parts for index, flag in zip(indices, flags.tolist()) if flag]
    return rows, empty


def _progress_bar(total: int, enabled: bool, kind: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="sample", desc=f"{kind} features (rank 0 share)",
                dynamic_ncols=True, smoothing=0.1)
