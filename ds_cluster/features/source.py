"""Where the features come from: the one choice between the trained model's own engine and a separate feature
model, made in one place for the hook's set-up, the Trainers, `ds-cluster analyze` and the benchmark.

`feature_source(...)` is a context manager that yields a `FeatureSource`: the engine whose forward computes the
features, and the dataset it reads (the training data, or its re-encoding with a separate feature model's
tokenizer). Whatever it built (a forward-only DeepSpeed engine) is destroyed when the block ends, so its ZeRO-3
hooks are gone before the trainer's own engine comes next. `forward_only_engine` is the one way such an engine is
built.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch

from ds_cluster.data.models import load_model, load_tokenizer
from ds_cluster.ds_config import forward_only_config
from ds_cluster.features.feature_model import feature_dataset
from ds_cluster.settings import FeatureSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeatureSource:
    """The engine (or module) whose forward computes the features, and the dataset it reads."""

    engine: Any
    dataset: Any
    feature_model: Optional[str] = None  # the separate feature model's checkpoint; None: the trained model's own
    # How other data of the training data's kind (target examples) is encoded for the engine: None, as it is.
    encoder: Optional[Callable[[Any], Any]] = None

    def encode(self, data: Any) -> Any:
        """`data` (tokenized like the training data, with its records) as this engine reads it: re-encoded with the
        feature model's tokenizer, exactly as the training data is, or as it is."""
        return data if self.encoder is None else self.encoder(data)


def forward_only_engine(model: Any, ds_config: Mapping[str, Any]) -> Any:
    """A DeepSpeed engine of `model` that only runs forward passes, under `ds_config`'s ZeRO stage (1 and 2 run as
    0: they shard nothing a forward reads). No optimizer, scheduler or data sampler; a batch size of its own, so a
    training config's batch arithmetic (or Hugging Face's "auto" values) does not get in the way. Collective."""
    import deepspeed

    config = forward_only_config({key: value for key, value in ds_config.items() if value != "auto"})
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config.setdefault("gradient_accumulation_steps", 1)
    config.pop("train_batch_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


@contextlib.contextmanager
def feature_source(settings: FeatureSettings, training_data: Any, *, ds_config: Optional[Mapping[str, Any]] = None,
                   engine: Any = None, model: Union[None, str, os.PathLike, torch.nn.Module] = None
                   ) -> Iterator[FeatureSource]:
    """The engine and dataset the features of `training_data` are computed with (collective under DeepSpeed).

    - `settings.model` set (the block's `feature_model`): that checkpoint in its own forward-only engine under
      `ds_config`'s ZeRO stage, reading the data re-encoded with its tokenizer (`feature_dataset`);
    - else `engine`: the job's own engine, used as it is (the hook's);
    - else `model`: a module, or a checkpoint folder, in a forward-only engine under `ds_config` (a Trainer's,
      `ds-cluster analyze`'s); without `ds_config`, the module itself (one process, no DeepSpeed).
    What was built is destroyed on leaving the block.
    """
    built = None
    try:
        if settings.model:
            built = _checkpoint_engine(settings.model, ds_config, beside_a_job=True)
            tokenizer = load_tokenizer(settings.model)

            def encode(data: Any) -> Any:
                return feature_dataset(data, tokenizer, settings.max_length)

            yield FeatureSource(built, encode(training_data), settings.model, encoder=encode)
        elif engine is not None:
            yield FeatureSource(engine, training_data)
        elif model is not None:
            module = model if isinstance(model, torch.nn.Module) else None
            if ds_config is None:
                if module is None:
                    module = load_model(model)  # type: ignore[arg-type]
                yield FeatureSource(module, training_data)
            else:
                built = forward_only_engine(module, ds_config) if module is not None else \
                    _checkpoint_engine(model, ds_config, beside_a_job=False)  # type: ignore[arg-type]
                yield FeatureSource(built, training_data)
        else:
            raise ValueError("feature_source needs an engine, a model, or a feature_model in the settings")
    finally:
        if built is not None and hasattr(built, "destroy"):
            built.destroy()  # removes its ZeRO-3 hooks: the trainer's own engine comes next
        del built
        gc.collect()


def _checkpoint_engine(path: Union[str, os.PathLike], ds_config: Optional[Mapping[str, Any]], beside_a_job: bool
                       ) -> Any:
    """A checkpoint folder in a forward-only engine; `beside_a_job`: loaded without touching the training job's own
    ZeRO-3 switch (a separate feature model)."""
    config = forward_only_config(dict(ds_config or {}))
    with _own_zero3_context() if beside_a_job else contextlib.nullcontext():
        module = load_model(path, ds_config=config)
        engine = forward_only_engine(module, config)
    logger.info("feature model %s loaded in a forward-only engine (ZeRO stage %s)", os.fspath(path),
                (config.get("zero_optimization") or {}).get("stage", 0))
    return engine


@contextlib.contextmanager
def _own_zero3_context() -> Iterator[None]:
    """Keep transformers' ZeRO-3 switch as the training job set it while another model is loaded."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
