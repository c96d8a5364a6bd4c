"""The DeepSpeed hook: a cluster-balanced loader in the curriculum sampler's place.

`ds_cluster.install()` makes `deepspeed.initialize(..., training_data=ds,
config=cfg)` return a loader driven by the plan whenever the config's
`cluster_sampling` block is enabled; without the block DeepSpeed runs
exactly as before. `ds_cluster.initialize(...)` does the same as a call.

Why not DeepSpeed's own data-sampling path: the engine only builds its
`DeepSpeedDataSampler` when curriculum learning is on, and then saves the
global numpy RNG instead of the sampler's position (DeepSpeed issue #8405).
We initialise the engine without training data and attach our own loader,
and we carry the loader's state through `client_state`, the public way to
put extra state in DeepSpeed checkpoints.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ds_cluster import distributed
from ds_cluster.config import ClusterSamplingConfig, load_ds_config
from ds_cluster.plan import build_plan
from ds_cluster.sampler import ClusterDataLoader

logger = logging.getLogger(__name__)

SUPPORTED_DEEPSPEED = ((0, 19, 5), (0, 20, 0))  # tested range: >=0.19.5,<0.20
CHECKPOINT_KEY = "ds_cluster_sampler"


# ------------------------------------------------------------------ install
def install() -> None:
    """Route `deepspeed.initialize` through ds_cluster (idempotent). Call it before initialize."""
    import deepspeed

    check_deepspeed_version(deepspeed.__version__)
    if getattr(deepspeed.initialize, "_ds_cluster_hook", False):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def hooked_initialize(*args: Any, **kwargs: Any):
        return _initialize(original, *args, **kwargs)

    hooked_initialize._ds_cluster_hook = True  # type: ignore[attr-defined]
    deepspeed.initialize = hooked_initialize


def uninstall() -> None:
    """Put DeepSpeed's own `initialize` back."""
    import deepspeed

    if getattr(deepspeed.initialize, "_ds_cluster_hook", False):
        deepspeed.initialize = deepspeed.initialize.__wrapped__


def initialize(*args: Any, **kwargs: Any):
    """`deepspeed.initialize` with cluster-balanced sampling; same arguments, same return value."""
    import deepspeed

    check_deepspeed_version(deepspeed.__version__)
    original = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    return _initialize(original, *args, **kwargs)


def check_deepspeed_version(version: str) -> None:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    found = tuple(parts + [0] * (3 - len(parts)))
    low, high = SUPPORTED_DEEPSPEED
    if not low <= found < high:
        raise RuntimeError(
            f"ds_cluster is tested with deepspeed >=0.19.5,<0.20 and found deepspeed {version}; "
            "install a tested version: pip install 'deepspeed>=0.19.5,<0.20'"
        )


# --------------------------------------------------------------- initialize
def _config_from_call(args: Any, kwargs: dict) -> Any:
    """The DeepSpeed config as initialize sees it: `config`, `config_params`, or args.deepspeed_config."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    for name in ("deepspeed_config", "deepspeed"):
        value = getattr(args, name, None) if args is not None else None
        if isinstance(value, (str, os.PathLike)):
            return value
    return None


def _initialize(original, *args: Any, **kwargs: Any):
    call_args = kwargs.get("args", args[0] if args else None)
    ds_config = _config_from_call(call_args, kwargs)
    cluster_config = ClusterSamplingConfig.from_ds_config(ds_config) if ds_config is not None else None
    if cluster_config is None or not cluster_config.enabled:
        return original(*args, **kwargs)

    config_dict, source = load_ds_config(ds_config)
    if "training_data" in kwargs:
        training_data = kwargs.pop("training_data")
    else:
        raise ValueError("cluster_sampling is enabled but deepspeed.initialize got no training_data to sample from")
    collate_fn = kwargs.pop("collate_fn", None)
    if training_data is None:
        raise ValueError("cluster_sampling is enabled but training_data is None")

    if kwargs.get("dist_init_required", None) is not False:
        distributed.init_distributed()
    if cluster_config.analysis_path:
        # Ranks on other hosts read the analysis through a shared filesystem: a rank that cannot see
        # it fails the start on every rank, naming its host, instead of training on something else.
        distributed.check_shared_path(Path(cluster_config.analysis_path).absolute().parent,
                                      "folder holding cluster_sampling.analysis_path")
    # Everything that can be checked before the engine exists is checked on every rank, and a
    # failure on any rank becomes an error on all of them (no rank left waiting in a collective).
    error: Optional[BaseException] = None
    inputs = None
    try:
        check_no_curriculum(config_dict, source)
        if kwargs.get("mpu") is None:  # with model parallelism the data-parallel size is not the world size
            check_batch_arithmetic(config_dict, source, distributed.get_world_size())
        if not (hasattr(training_data, "__len__") and hasattr(training_data, "__getitem__")):
            raise ValueError(f"cluster_sampling picks samples by index, so training_data must be a map-style dataset "
                             f"(with len() and [i]); got {type(training_data).__name__}. Materialise an iterable "
                             "dataset first, or disable cluster_sampling")
        if len(training_data) == 0:
            raise ValueError("cluster_sampling is enabled but training_data is empty (0 samples): "
                             "pass the dataset to train on")
        inputs = load_plan_inputs(cluster_config, len(training_data), training_data)
    except (ValueError, FileNotFoundError) as err:
        error = err
    distributed.agree_on_error(error, "cluster_sampling set-up")
    # The plan depends only on the analysis, so a rank handed other data (same length) would build the
    # same plan and silently train on other samples: compare what the ranks were given.
    distributed.check_agreement(training_data_identity(training_data),
                                "training data (number of samples, content fingerprint)")

    engine, optimizer, _, lr_scheduler = original(*args, **kwargs)
    distributed.release_shared_memory_buffer()  # in case the process group was started by DeepSpeed itself
    rank = _data_parallel_rank(engine)
    error, plan = None, None
    try:
        plan = build_plan(
            inputs.features, cluster_config,
            world_size=engine.dp_world_size,
            micro_batch_size=engine.train_micro_batch_size_per_gpu(),
            gradient_accumulation_steps=engine.gradient_accumulation_steps(),
            labels=inputs.labels, exclude=inputs.exclude,
        )
    except ValueError as err:
        error = err
    distributed.agree_on_error(error, "building the cluster plan")
    assert plan is not None
    distributed.check_agreement(plan.fingerprint(), "cluster plan fingerprint")

    loader = ClusterDataLoader(training_data, plan, rank, collate_fn=collate_fn)
    engine.training_dataloader = loader
    attach_checkpoint_state(engine, loader)
    if rank == 0:
        summary = plan.summary()
        logger.info("ds_cluster: kept %d of %d samples in %d clusters; %d steps per epoch; plan %s",
                    summary["num_kept"], summary["num_samples"], summary["num_clusters"],
                    summary["steps_per_epoch"], summary["fingerprint"])
    return engine, optimizer, loader, lr_scheduler


def _data_parallel_rank(engine: Any) -> int:
    if getattr(engine, "mpu", None) is not None:
        return int(engine.mpu.get_data_parallel_rank())
    import torch.distributed as dist

    return int(dist.get_rank(group=engine.data_parallel_group)) if dist.is_initialized() else 0


def check_no_curriculum(config_dict: dict, source: str) -> None:
    """Cluster sampling replaces the curriculum sampler; both at once is an error."""
    efficiency = config_dict.get("data_efficiency", {}) or {}
    sampling = efficiency.get("data_sampling", {}) or {}
    curriculum = sampling.get("curriculum_learning", {}) or {}
    legacy = config_dict.get("curriculum_learning", {}) or {}
    if curriculum.get("enabled") or legacy.get("enabled"):
        where = ("data_efficiency.data_sampling.curriculum_learning" if curriculum.get("enabled")
                 else "curriculum_learning")
        raise ValueError(
            f"{source}: {where} and cluster_sampling are both enabled; cluster sampling takes the curriculum "
            f"sampler's place, so set {where}.enabled to false (or disable cluster_sampling)"
        )


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_batch_arithmetic(config_dict: dict, source: str, world_size: int) -> None:
    """train_batch_size = micro batch x accumulation x data-parallel world size, or a ValueError saying how to fix it.

    DeepSpeed asserts the same later, naming the numbers but not the keys or
    the fix; this runs before the engine is built, on every rank.
    """
    values = {key: config_dict.get(key) for key in BATCH_KEYS}
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in values.values() if value is not None):
        return  # "auto" and friends: left to DeepSpeed
    for key, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{source}: {key} must be >= 1, got {value}")
    train, micro, accumulation = values["train_batch_size"], values["train_micro_batch_size_per_gpu"], \
        values["gradient_accumulation_steps"]
    if train is None or (micro is None and accumulation is None):
        if train is not None and train % world_size:
            raise ValueError(f"{source}: train_batch_size {train} is not a multiple of the world size {world_size}; "
                             "set train_micro_batch_size_per_gpu (and gradient_accumulation_steps) instead")
        return
    # DeepSpeed derives a missing one of micro/accumulation by integer division, then checks the product.
    micro = micro if micro is not None else max(train // world_size // accumulation, 1)
    accumulation = accumulation if accumulation is not None else max(train // (micro * world_size), 1)
    product = micro * accumulation * world_size
    if train != product:
        raise ValueError(
            f"{source}: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accumulation} x data-parallel world size {world_size} (= {product}); "
            f"set train_batch_size to {product}, or remove it and DeepSpeed derives it from the other two"
        )


def training_data_identity(training_data: Any) -> tuple[int, Optional[str]]:
    """(length, content fingerprint where the dataset type has one): what every rank must agree on."""
    return len(training_data), _dataset_fingerprint(training_data)


def _dataset_fingerprint(training_data: Any) -> Optional[str]:
    from ds_cluster.data.instructions import InstructionDataset, dataset_fingerprint

    return dataset_fingerprint(training_data) if isinstance(training_data, InstructionDataset) else None


class PlanInputs:
    """What the plan is built from: features and/or labels of an analysis, and left-out samples."""

    def __init__(self, features: Optional[np.ndarray], labels: Optional[np.ndarray], exclude: Optional[np.ndarray]):
        self.features, self.labels, self.exclude = features, labels, exclude


def load_plan_inputs(config: ClusterSamplingConfig, dataset_size: int, training_data: Any = None) -> PlanInputs:
    """Read `features.npy` and/or `labels.npy` from analysis_path and check them against the dataset.

    When the folder has the `manifest.json` of `ds-cluster analyze` and the
    dataset can be fingerprinted (an InstructionDataset), the fingerprints must
    match: an analysis of other data with the same length is refused too.
    """
    if not config.analysis_path:
        raise ValueError(
            "cluster_sampling.analysis_path is not set: point it at the directory written by "
            "`ds-cluster analyze` (features.npy and/or labels.npy)"
        )
    folder = Path(config.analysis_path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"cluster_sampling.analysis_path {folder} does not exist (or is not a directory visible to this "
            "rank; the analysis directory must be on a filesystem every rank can read); run `ds-cluster analyze` first"
        )
    features = _load_array(folder / "features.npy", ndim=2)
    labels = _load_array(folder / "labels.npy", ndim=1)
    if features is None and labels is None:
        raise FileNotFoundError(f"{folder} holds neither features.npy nor labels.npy")
    for name, array in (("features.npy", features), ("labels.npy", labels)):
        if array is not None and array.shape[0] != dataset_size:
            raise ValueError(
                f"{folder / name} has {array.shape[0]} rows but the training dataset has {dataset_size} samples: "
                "the analysis was made for different data; rerun `ds-cluster analyze` on this dataset"
            )
    _check_manifest(folder, training_data)
    if features is not None and not np.isfinite(features).all():
        bad_rows = np.flatnonzero(~np.isfinite(features).all(axis=1))
        raise ValueError(
            f"{folder / 'features.npy'} has NaN or inf in {bad_rows.size} rows (first: row {int(bad_rows[0])}); "
            "rerun `ds-cluster analyze` (in fp32) to recompute the features"
        )
    exclude = None
    if features is not None:
        # All-zero rows are samples without response tokens: no gradient, so no cluster.
        exclude = ~np.any(features != 0, axis=1)
        if not exclude.any():
            exclude = None
    if labels is not None and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{folder / 'labels.npy'} must hold integers, got {labels.dtype}")
    return PlanInputs(features, labels, exclude)


def _check_manifest(folder: Path, training_data: Any) -> None:
    """Refuse an analysis whose manifest.json records another dataset than the one being trained on."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.exists():
        return  # a hand-made analysis (features.npy / labels.npy only): nothing recorded to compare
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{manifest_path}: unreadable or not valid JSON ({err}); rerun `ds-cluster analyze`") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_path}: expected a JSON object; rerun `ds-cluster analyze`")
    recorded = manifest.get("dataset_fingerprint")
    current = _dataset_fingerprint(training_data) if training_data is not None else None
    if recorded and current and recorded != current:
        raise ValueError(
            f"{folder} is an analysis of another dataset: its manifest.json records dataset_fingerprint {recorded} "
            f"(data {manifest.get('data')!r}, max_length {manifest.get('max_length')}), the training data has "
            f"{current}. Rerun `ds-cluster analyze` on the training data with the same --max-length, or point "
            "analysis_path at its analysis"
        )


def _load_array(path: Path, ndim: int) -> Optional[np.ndarray]:
    if not path.exists():
        return None
    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable or truncated .npy file ({err}); rerun `ds-cluster analyze`") from None
    if array.ndim != ndim:
        raise ValueError(f"{path}: expected a {ndim}-D array, got shape {array.shape}")
    return np.asarray(array)


# -------------------------------------------------------------- checkpoints
def attach_checkpoint_state(engine: Any, loader: ClusterDataLoader) -> None:
    """Make `engine.save_checkpoint`/`load_checkpoint` carry the loader's position."""
    save_checkpoint, load_checkpoint = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save_checkpoint)
    def save_with_sampler(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        state = dict(client_state or {})
        state[CHECKPOINT_KEY] = loader.state_dict()
        return save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest, **kwargs)

    @functools.wraps(load_checkpoint)
    def load_with_sampler(load_dir, tag=None, **kwargs):
        load_path, client_state = load_checkpoint(load_dir, tag=tag, **kwargs)
        if load_path is not None and client_state is not None:
            sampler_state = client_state.pop(CHECKPOINT_KEY, None)
            if sampler_state is None:
                logger.warning("checkpoint %s holds no ds_cluster sampler state; starting the plan from epoch 0",
                               load_path)
            else:
                loader.load_state_dict(sampler_state)
        return load_path, client_state

    engine.save_checkpoint = save_with_sampler
    engine.load_checkpoint = load_with_sampler
