"""The DeepSpeed hook: a cluster-balanced loader in the curriculum sampler's place.

`ds_cluster.install()` makes `deepspeed.initialize(..., training_data=ds,
config=cfg)` return a loader driven by the plan whenever the config's
`cluster_sampling` block is enabled. Everything else goes to DeepSpeed
untouched: a config without the block or with it disabled, and a config the
hook cannot read (DeepSpeed then raises its own error).
`ds_cluster.initialize(...)` does the same as a call.

Why not DeepSpeed's own data-sampling path: the engine only builds its
`DeepSpeedDataSampler` when curriculum learning is on, and then saves the
global numpy RNG instead of the sampler's position (DeepSpeed issue #8405).
We initialise the engine without training data and attach our own loader,
and we carry the loader's state through `client_state`, the public way to
put extra state in DeepSpeed checkpoints.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

from ds_cluster import distributed
from ds_cluster.batching import BatchShape
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.ds_config import cluster_block, config_in_call, read_ds_config
from ds_cluster.integrations.setup import ClusterSetup, TrainerAdapter
from ds_cluster.loader.figures import figure_events
from ds_cluster.loader.loss import SAMPLE_LOSSES, probe_losses
from ds_cluster.loader.sampler import ClusterDataLoader

logger = logging.getLogger(__name__)

TESTED_DEEPSPEED = ">=0.19.5,<0.20"
CHECKPOINT_KEY = "ds_cluster_sampler"
# What the hook uses of DeepSpeed: a version without one of these cannot work with it.
_REQUIRED_MODULE_NAMES = ("initialize", "init_distributed", "DeepSpeedEngine")
_REQUIRED_ENGINE_METHODS = ("save_checkpoint", "load_checkpoint", "train_micro_batch_size_per_gpu",
                            "gradient_accumulation_steps")


# ------------------------------------------------------------------ install
def install() -> None:
    """Route `deepspeed.initialize` through ds_cluster (idempotent). Call it before initialize."""
    import deepspeed

    check_deepspeed(deepspeed)
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

    check_deepspeed(deepspeed)
    original = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    return _initialize(original, *args, **kwargs)


def check_deepspeed(deepspeed_module: Any) -> None:
    """Raise if DeepSpeed lacks something the hook uses (naming it); warn once outside the tested versions."""
    missing = [f"deepspeed.{name}" for name in _REQUIRED_MODULE_NAMES if not hasattr(deepspeed_module, name)]
    engine = getattr(deepspeed_module, "DeepSpeedEngine", None)
    if engine is not None:
        missing += [f"DeepSpeedEngine.{name}" for name in _REQUIRED_ENGINE_METHODS if not hasattr(engine, name)]
    version = str(getattr(deepspeed_module, "__version__", "unknown"))
    if missing:
        raise RuntimeError(f"ds_cluster cannot hook this DeepSpeed ({version}): it has no {', '.join(missing)}. "
                           f"ds_cluster is tested with deepspeed{TESTED_DEEPSPEED}")
    _warn_if_untested(version)


@functools.lru_cache(maxsize=None)
def _warn_if_untested(version: str) -> None:
    # Cached: one warning per process and version, however often install() is called.
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        tested = Version(version.split("+")[0]) in SpecifierSet(TESTED_DEEPSPEED)
    except InvalidVersion:
        tested = False
    if not tested:
        logger.warning("ds_cluster is tested with deepspeed%s and found deepspeed %s; it should work, but if it "
                       "does not, install a tested version: pip install 'deepspeed%s'", TESTED_DEEPSPEED, version,
                       TESTED_DEEPSPEED)


# --------------------------------------------------------------- initialize
def _initialize_signature() -> inspect.Signature:
    """DeepSpeed's own `initialize` signature, to read a call's arguments however they were passed."""
    import deepspeed

    return inspect.signature(getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize))


def _initialize(original: Callable, *args: Any, **kwargs: Any):
    try:
        call = _initialize_signature().bind(*args, **kwargs)
        config_dict, source = read_ds_config(config_in_call(call.arguments))
    except (TypeError, ValueError, OSError):
        # Arguments or a config the hook cannot read: DeepSpeed gives its own answer.
        return original(*args, **kwargs)
    block = cluster_block(config_dict)
    if block is None or (isinstance(block, dict) and block.get("enabled") is not True):
        return original(*args, **kwargs)
    cluster_config = ClusterSamplingConfig.from_dict(block, source=f"{source}: cluster_sampling")
    if not cluster_config.enabled:
        return original(*args, **kwargs)
    arguments = dict(call.arguments)
    training_data = arguments.pop("training_data", None)
    collate_fn = arguments.pop("collate_fn", None)
    if arguments.get("dist_init_required") is not False:
        distributed.init_distributed()
    cluster_setup = ClusterSetup(cluster_config, training_data, everyone=distributed.collectives(),
                                 ds_config=config_dict, source=source)
    # Checked before the engine is built: a bad set-up fails in seconds, not after the model is sharded.
    # With model parallelism (an mpu) the data-parallel size is not the world size: DeepSpeed checks it.
    cluster_setup.check(world_size=None if arguments.get("mpu") is not None else distributed.get_world_size())
    if arguments.get("model") is not None:
        cluster_setup.check_model(arguments["model"])

    engine, optimizer, _, lr_scheduler = original(**arguments)
    adapter = hook_adapter(engine, collate_fn)
    loader = cluster_setup.build_loader(adapter)
    EnginePatches(engine, loader, cluster_setup, adapter.data_parallel.sum).apply()
    return engine, optimizer, loader, lr_scheduler


def hook_adapter(engine: Any, collate_fn: Any = None) -> TrainerAdapter:
    """The hook's place among the trainers: the engine's data-parallel group (the mpu's with model
    parallelism), its micro batch and accumulation steps, and the engine itself for a missing analysis."""
    mpu = getattr(engine, "mpu", None)
    group = mpu.get_data_parallel_group() if mpu is not None else engine.data_parallel_group
    data_parallel = distributed.collectives(group)
    shape = BatchShape(data_parallel.world_size, engine.train_micro_batch_size_per_gpu(),
                       engine.gradient_accumulation_steps())
    return TrainerAdapter(name="the training job (deepspeed.initialize)", data_parallel=data_parallel, shape=shape,
                          engine=engine, collate_fn=collate_fn, probe_losses=lambda batch: probe_losses(engine, batch))


class EnginePatches:
    """Everything the hook changes on the engine `deepspeed.initialize` built, in one place, so the training loop
    stays a plain DeepSpeed loop:

    - `training_dataloader`: the cluster loader, where DeepSpeed keeps its own;
    - `backward(loss)`: first hands the loader the per-sample losses `weighted_causal_lm_loss` put on the loss
      (the adaptive schedule's figures, the monitors' per-cluster losses);
    - `save_checkpoint` / `load_checkpoint`: carry the loader's state in `client_state` under `CHECKPOINT_KEY`, and
      restore it (checked against the plan and the step) on load;
    - `step()`, when the config turns a monitor on: writes the per-cluster figures to it at each optimizer step.

    `remove()` puts DeepSpeed's own methods back."""

    def __init__(self, engine: Any, loader: ClusterDataLoader, cluster_setup: ClusterSetup,
                 sum_over_ranks: Callable[[Any], Any]) -> None:
        self.engine, self.loader, self.cluster_setup = engine, loader, cluster_setup
        self.sum_over_ranks = sum_over_ranks
        self._originals: dict[str, Any] = {}

    def apply(self) -> None:
        engine = self.engine
        patched = {"training_dataloader": self.loader, "backward": self._backward(engine.backward),
                   "save_checkpoint": self._save(engine.save_checkpoint),
                   "load_checkpoint": self._load(engine.load_checkpoint)}
        if getattr(getattr(engine, "monitor", None), "enabled", False):
            patched["step"] = self._step(engine.step)
        for name, value in patched.items():
            self._originals[name] = engine.__dict__.get(name, _CLASS_ATTRIBUTE)
            setattr(engine, name, value)

    def remove(self) -> None:
        for name, original in self._originals.items():
            if original is _CLASS_ATTRIBUTE:
                delattr(self.engine, name)
            else:
                setattr(self.engine, name, original)
        self._originals.clear()

    def _backward(self, backward: Callable) -> Callable:
        loader = self.loader

        @functools.wraps(backward)
        def backward_recording(loss, *args, **kwargs):
            record = getattr(loss, SAMPLE_LOSSES, None)
            if record is not None:
                loader.record_losses(*record)
            return backward(loss, *args, **kwargs)

        return backward_recording

    def _step(self, step: Callable) -> Callable:
        """Per-cluster figures to the DeepSpeed config's monitors (TensorBoard, W&B, Comet, CSV) at each optimizer step,
        where DeepSpeed writes its own `Train/Samples/lr`, with the same step (`global_samples`). Summing the figures
        over the data-parallel ranks is one small collective per step."""
        engine, loader, sum_over_ranks = self.engine, self.loader, self.sum_over_ranks

        @functools.wraps(step)
        def step_with_figures(*args: Any, **kwargs: Any) -> Any:
            boundary = engine.is_gradient_accumulation_boundary()  # before the step moves the micro-step on
            result = step(*args, **kwargs)
            if boundary:
                figures = loader.figures.report(sum_over_ranks)
                if distributed.get_rank() == 0:
                    engine.monitor.write_events(figure_events(figures, loader.current_shares(), engine.global_samples))
            return result

        return step_with_figures

    def _save(self, save_checkpoint: Callable) -> Callable:
        engine, loader = self.engine, self.loader

        @functools.wraps(save_checkpoint)
        def save_with_sampler(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
            state = dict(client_state or {})
            state[CHECKPOINT_KEY] = loader.state_dict(engine.global_steps)
            return save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest, **kwargs)

        return save_with_sampler

    def _load(self, load_checkpoint: Callable) -> Callable:
        engine, loader, cluster_setup = self.engine, self.loader, self.cluster_setup

        @functools.wraps(load_checkpoint)
        def load_with_sampler(load_dir, tag=None, **kwargs):
            load_path, client_state = load_checkpoint(load_dir, tag=tag, **kwargs)
            if load_path is not None and client_state is not None:
                sampler_state = client_state.pop(CHECKPOINT_KEY, None)
                if sampler_state is None:
                    logger.warning("checkpoint %s holds no ds_cluster sampler state; starting the plan from epoch 0",
                                   load_path)
                else:
                    cluster_setup.restore_sampler(loader, sampler_state, engine.global_steps, where=str(load_path))
            return load_path, client_state

        return load_with_sampler


# An attribute the engine had from its class, not its own: `remove` deletes the instance's copy.
_CLASS_ATTRIBUTE = object()
