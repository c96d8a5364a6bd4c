"""Per-sample gradient features from a DeepSpeed engine's forward pass, under any ZeRO stage.

The kinds and their math are in kinds.py. h_t, the input of the output layer,
is captured with a forward pre-hook (exactly what the logits are computed
from, after the final norm); the hook also lets the output layer compute only
the last position's logits during the forward, and the logits of the response
positions are then computed here, a chunk of positions at a time, from the
output layer's weight (gathered once per batch under ZeRO-3). So neither the
forward nor the softmax ever holds (batch x length x vocabulary) values. All
ranks run the same number of forwards (ZeRO-3 gathers parameters
collectively), padding with a discarded dummy batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ds_cluster.data.dataset import IGNORE_INDEX, dataset_fingerprint
from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.features.adapters import Adapters, adapter_rows, loss_gradient_at_hidden
from ds_cluster.features.batches import (Batch, Piece, _batches_of, _collate, deal_batches, join_finished,
                                         sample_lengths, shard_completion_steps, work_per_rank)
from ds_cluster.features.kinds import FeatureKind, feature_kind
from ds_cluster.features.model_info import find_output_layer, model_fingerprint, output_layer_shape, unwrap_model
from ds_cluster.features.output_matrix import OutputMatrix
from ds_cluster.features.projection import KroneckerProjection
from ds_cluster.features.store import (ADAPTER_GAUSSIAN, ADAPTER_SKETCH, BATCHING_BY_LENGTH, BATCHING_FULL_WIDTH,
                                      DEFAULT_SHARD_SIZE, FeatureStore, StoreManifest, assemble_rows, own_shards,
                                      prepare_store)
from ds_cluster.phases import release_freed_memory
from ds_cluster.settings import FeatureSettings

logger = logging.getLogger(__name__)



@dataclass
class ExtractionResult:
    """What extract_features computed, plus what a report needs."""

    features: np.ndarray  # (N, d) float32, identical on every rank; this rank's rows only when `rows` is set
    empty_mask: np.ndarray  # (N,) bool: samples without response tokens (zero rows), every sample
    kind: str
    dim: int
    computed_shards: list[int] = field(default_factory=list)  # computed by this call, all ranks
    reused_shards: list[int] = field(default_factory=list)  # read back from the store
    seconds: float = 0.0
    # This rank's seconds in the engine's forward passes and in the features computed from their output.
    timings: dict[str, float] = field(default_factory=dict)
    manifest: Optional[StoreManifest] = None
    rows: Optional[np.ndarray] = None  # sharded results: the global indices of `features`' rows
    # What each rank computed in this call (the even split: batches within one of each other).
    samples_per_rank: list[int] = field(default_factory=list)
    batches_per_rank: list[int] = field(default_factory=list)

    @property
    def num_empty(self) -> int:
        return int(self.empty_mask.sum())


# --------------------------------------------------------------------------- one batch
DEFAULT_CHUNK_SIZE = 256
# logits_at(sample indices, positions) -> (n, V) logits at those positions.
LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


class _OutputLayerInput:
    """Captures the output layer's input and lets it compute the last position's logits only."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.value: Optional[torch.Tensor] = None
        # Before DeepSpeed's own pre-hook (ZeRO-3 wraps the input for its backward bookkeeping): the lora kind's
        # backward starts at the input as the model made it, not at ZeRO's wrapper around the output layer.
        self._handle = layer.register_forward_pre_hook(self._hook, prepend=True)

    def _hook(self, module: torch.nn.Module, inputs: tuple) -> tuple:
        self.value = inputs[0]
        return (inputs[0][:, -1:], *inputs[1:])

    def close(self) -> None:
        self._handle.remove()


@contextlib.contextmanager
def _full_weight(layer: torch.nn.Module) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """The output layer's weight and bias, gathered for the block under ZeRO-3 (collective then)."""
    params = [param for param in (layer.weight, getattr(layer, "bias", None)) if param is not None]
    if any(hasattr(param, "ds_tensor") for param in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield layer.weight, getattr(layer, "bias", None)
    else:
        yield layer.weight, getattr(layer, "bias", None)


def _batch_rows(engine: Any, model: torch.nn.Module, layer: torch.nn.Module, capture: _OutputLayerInput,
                batch: dict[str, torch.Tensor], kind: FeatureKind, projection: Optional[KroneckerProjection],
                chunk_size: int, timings: dict[str, float], adapters: Optional[Adapters] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one batch through the engine, then the features of its samples (collective under ZeRO-3); with
    `adapters` (the lora kind) the forward keeps its graph and one backward gives the adapters' gradients.

    `timings` gains the seconds of the forward ("forward") and of the features from its output ("features").
    """
    started = time.perf_counter()
    device = _device_of(engine, model)
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"].to(device),
                              "attention_mask": batch["attention_mask"].to(device)}
    if hasattr(getattr(model, "config", None), "use_cache"):
        kwargs["use_cache"] = False
    capture.value = None
    with torch.enable_grad() if adapters is not None else contextlib.nullcontext():
        engine(**kwargs)
    if capture.value is None:
        raise RuntimeError("the output layer was not called during the forward pass; cannot read its input")
    hidden = capture.value
    forwarded = time.perf_counter()
    if not kind.reads_logits:  # a representation of the forward itself (hidden): nothing gathered, no logits
        counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).to(hidden.device)
        pooled = kind.pool(hidden, batch["attention_mask"])  # type: ignore[attr-defined]
        rows = torch.where((counts > 0)[:, None], pooled, torch.zeros_like(pooled)), counts == 0
        timings["forward"] = timings.get("forward", 0.0) + forwarded - started
        timings["features"] = timings.get("features", 0.0) + time.perf_counter() - forwarded
        return rows
    with _full_weight(layer) as (weight, bias):
        # The logits of the response positions in float32, whatever the engine's precision, never a float32 copy
        # of the whole matrix (output_matrix.py).
        output = OutputMatrix(weight, bias)
        if adapters is not None:
            hidden_gradient, counts = loss_gradient_at_hidden(hidden, batch["labels"], output, chunk_size)
        else:
            def logits_at(samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                return output.logits(hidden[samples, positions])

            rows = batch_features(hidden, batch["labels"], logits_at, kind, projection, chunk_size)
    if adapters is not None:  # the backward runs outside the gather: ZeRO-3's own hooks gather what it needs
        with torch.enable_grad():
            rows = adapter_rows(hidden, hidden_gradient, adapters.capture, adapters.projections), counts == 0
        del hidden, hidden_gradient
        _release_gathered(engine)
    # The batch's temporaries (gathers, logits, a backward) go back to the system before the next batch: glibc
    # would keep them, and the pass's footprint would grow by what fragments.
    release_freed_memory(collect=False)
    timings["forward"] = timings.get("forward", 0.0) + forwarded - started
    timings["features"] = timings.get("features", 0.0) + time.perf_counter() - forwarded
    return rows


def _release_gathered(engine: Any) -> None:
    """Under ZeRO-3, give back every parameter the engine still holds gathered. The lora kind's backward stops at the
    first adapter, so the modules below it never run the post-backward hook that would release what their backward
    gathered: without this, most of the model stays gathered after each batch, and into training."""
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "empty_partition_cache"):
        optimizer.empty_partition_cache()


def _device_of(engine: Any, model: torch.nn.Module) -> torch.device:
    device = getattr(engine, "device", None)
    if device is not None:
        return torch.device(device)
    return next(model.parameters()).device


# --------------------------------------------------------------------------- the whole dataset
@dataclass(frozen=True)
class ExtractionOptions:
    """How one features pass runs, beside what it computes (the stage's `FeatureSettings`): `batch_size` samples a
    forward; `store` the feature store (a folder or a FeatureStore; None keeps the rows in memory) of `shard_size`
    samples a shard, started afresh with `overwrite`; `chunk_size` response positions share one softmax over the
    vocabulary (the bound on extra memory); `fingerprint` the dataset's, when the caller has it; `pad_to_longest`:
    batches of similar length padded to their longest row (default; False: full width in index order, as before
    0.4.0, for measuring); `on_shard_done(shard)` after each shard this rank joined and wrote (tests crash there)."""

    batch_size: int = 8
    store: Union[None, str, Path, FeatureStore] = None
    shard_size: int = DEFAULT_SHARD_SIZE
    overwrite: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    show_progress: bool = True
    fingerprint: Optional[str] = None
    pad_to_longest: bool = True
    on_shard_done: Optional[Callable[[int], None]] = None


def extract(engine: Any, dataset: Sequence[dict], settings: FeatureSettings,
            options: Optional[ExtractionOptions] = None, collectives: Collectives = LOCAL) -> ExtractionResult:
    """The features stage: every sample's feature row by `engine` (any ZeRO stage), as its frozen settings say (the
    kind; the dimension, which applies to the projected kinds, the others having the hidden size; the projection
    seed; normalisation; `sharded`: every rank keeps only its own store shards, s mod W, which needs a store).

    Collective: call on every rank with the same arguments; `collectives` is this rank among the ranks sharing the
    work (`LOCAL`, or `distributed.collectives()`)."""
    if not feature_kind(settings.kind).projected:
        settings = dataclasses.replace(settings, dim=None)
    return _extract(engine, dataset, settings, options or ExtractionOptions(), collectives)


def run_extraction(engine: Any, dataset: Sequence[dict], *, kind: str, dim: Optional[int] = None,
                   seed: int = 0, normalize: bool = True, sharded: bool = False,
                   collectives: Collectives = LOCAL, **options: Any) -> ExtractionResult:
    """`extract` with its settings and options as keywords (`ExtractionOptions`' fields), for scripts and tests;
    a `dim` the kind cannot give (a dimension for a hidden-sized kind other than the hidden size) is an error
    here, where the stage ignores the block's `feature_dim` for those kinds."""
    settings = FeatureSettings(kind=kind, dim=dim, seed=seed, normalize=normalize, sharded=sharded)
    return _extract(engine, dataset, settings, ExtractionOptions(**options), collectives)


def _extract(engine: Any, dataset: Sequence[dict], settings: FeatureSettings, options: ExtractionOptions,
             collectives: Collectives) -> ExtractionResult:
    kind, dim, seed, normalize, sharded = (settings.kind, settings.dim, settings.seed, settings.normalize,
                                           settings.sharded)
    batch_size, store, shard_size, chunk_size = (options.batch_size, options.store, options.shard_size,
                                                 options.chunk_size)
    kind_object = feature_kind(kind)
    _check_arguments(dataset, batch_size, shard_size, sharded, store)
    started = time.perf_counter()
    model = unwrap_model(engine)
    layer = find_output_layer(model)
    vocab, hidden = output_layer_shape(layer)
    dim = kind_object.resolve_dim(dim, vocab, hidden)
    projection = kind_object.projection(dim, vocab, hidden, seed)
    projection = projection.to(_device_of(engine, model)) if projection is not None else None
    adapters = Adapters.of(model, dim, seed, _device_of(engine, model)) if kind_object.adapter_gradients else None
    feature_store = FeatureStore(store) if isinstance(store, (str, Path)) else store
    fingerprint = (options.fingerprint or dataset_fingerprint(dataset)) if feature_store else ""
    manifest = StoreManifest(kind=kind, dim=dim, seed=seed, normalize=normalize,
                             model_fingerprint=model_fingerprint(engine, collectives) if feature_store else "",
                             dataset_fingerprint=fingerprint, num_samples=len(dataset), shard_size=shard_size,
                             batching=BATCHING_BY_LENGTH if options.pad_to_longest else BATCHING_FULL_WIDTH,
                             adapter_projection=ADAPTER_SKETCH if kind_object.adapter_gradients else ADAPTER_GAUSSIAN)
    pending = (prepare_store(feature_store, manifest, options.overwrite, collectives) if feature_store is not None
               else list(range(manifest.num_shards)))
    timings: dict[str, float] = {}

    def rows_of(batch: dict[str, torch.Tensor], capture: _OutputLayerInput) -> tuple[torch.Tensor, torch.Tensor]:
        rows, empty = _batch_rows(engine, model, layer, capture, batch, kind_object, projection, chunk_size, timings,
                                  adapters)
        return (normalize_rows(rows) if normalize else rows), empty

    with adapters if adapters is not None else contextlib.nullcontext():  # the adapters' hooks, for this pass
        computed, shares = _compute_shards(model, layer, dataset, manifest, pending, batch_size, rows_of,
                                           feature_store, options.show_progress, options.on_shard_done, collectives,
                                           options.pad_to_longest)
    if sharded:
        collectives.barrier()  # every rank has written its shards
        features, rows, empty_mask = own_shards(manifest, feature_store, collectives)
    else:
        (features, empty_mask), rows = assemble_rows(manifest, feature_store, computed, collectives), None
    if empty_mask.any():
        logger.warning("%d of %d samples have no response tokens (all labels -100): their feature rows are zero",
                       int(empty_mask.sum()), len(dataset))
    computed_shards = sorted(shard for shards in collectives.gather(sorted(computed)) for shard in shards)
    return ExtractionResult(features=features, empty_mask=empty_mask, kind=kind, dim=dim,
                            computed_shards=computed_shards,
                            reused_shards=sorted(set(range(manifest.num_shards)) - set(pending)),
                            seconds=time.perf_counter() - started, timings=timings,
                            manifest=manifest if feature_store is not None else None, rows=rows,
                            **work_per_rank(shares))


def _check_arguments(dataset: Sequence[dict], batch_size: int, shard_size: int, sharded: bool, store: Any) -> None:
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1, got {batch_size} and {shard_size}")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: nothing to extract features from")
    if sharded and store is None:
        raise ValueError("sharded extraction keeps the rows in a feature store: pass store")


def _compute_shards(model: torch.nn.Module, layer: torch.nn.Module, dataset: Sequence[dict],
                    manifest: StoreManifest, pending: list[int], batch_size: int, rows_of: Callable,
                    feature_store: Optional[FeatureStore], show_progress: bool,
                    on_shard_done: Optional[Callable[[int], None]], collectives: Collectives, trim: bool
                    ) -> tuple[dict[int, tuple[np.ndarray, list[int]]], list[list[Batch]]]:
    """This rank's share of the pending shards' batches; each shard, once its batches are done on every rank,
    joined and written to the store by one rank (shard mod W). Returns the shards this rank joined and every
    rank's share. Long because the lockstep loop and the per-shard bookkeeping are one sequence."""
    rank, world_size = collectives.rank, collectives.world_size
    run_id = collectives.gather(uuid.uuid4().hex)[0]
    # The batches of every pending shard, dealt evenly over the ranks (whatever the number of samples and
    # shards); every rank runs as many forwards as the busiest one, which has at most one batch more.
    lengths = sample_lengths(dataset) if trim else None
    shares = deal_batches(_batches_of(pending, manifest.shard_bounds, batch_size, lengths), world_size)
    mine = shares[rank]
    completing = shard_completion_steps(shares)
    first_step = {}  # shard -> the first step any rank spends on it
    for share in shares:
        for step, (shard, _) in enumerate(share):
            first_step[shard] = min(step, first_step.get(shard, step))
    dummy = _collate(dataset, [0], trim)
    computed: dict[int, tuple[np.ndarray, list[int]]] = {}
    pieces: dict[int, list[Piece]] = {}  # this rank's rows of the shards not finished yet
    shard_started: dict[int, float] = {}
    progress = _progress_bar(sum(len(indices) for _, indices in mine), show_progress and rank == 0,
                             manifest.kind)
    capture = _OutputLayerInput(layer)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step in range(max(len(share) for share in shares)):
                now = time.perf_counter()
                shard_started.update({shard: now for shard, first in first_step.items() if first == step})
                if step >= len(mine):
                    rows_of(dummy, capture)  # lockstep only; result discarded
                else:
                    shard, indices = mine[step]
                    rows, empty = rows_of(_collate(dataset, indices, trim), capture)
                    pieces.setdefault(shard, []).append((indices, rows.cpu().numpy(), empty.cpu().numpy()))
                    progress.update(len(indices))
                if step in completing:
                    joined = join_finished(completing[step], pieces, collectives)
                    for shard, (rows_np, empty_idx) in joined.items():
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
    return computed, shares


def extract_features(engine: Any, dataset: Sequence[dict], *, kind: str, dim: Optional[int] = None,
                     batch_size: int = 8, store: Union[None, str, Path, FeatureStore] = None, seed: int = 0,
                     normalize: bool = True, show_progress: bool = True, **options: Any) -> np.ndarray:
    """Per-sample features (N, d) float32, identical on every rank; see run_extraction for the options."""
    return run_extraction(engine, dataset, kind=kind, dim=dim, batch_size=batch_size, store=store, seed=seed,
                          normalize=normalize, show_progress=show_progress, **options).features


def _progress_bar(total: int, enabled: bool, kind: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="sample", desc=f"{kind} features (rank 0 share)",
                dynamic_ncols=True, smoothing=0.1)
