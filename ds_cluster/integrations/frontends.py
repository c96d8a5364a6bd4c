"""What the integrations into fine-tuning frontends share: axolotl's plugin and LLaMA-Factory's launcher.

A frontend user writes a YAML, not a training script. The `cluster_sampling`
block comes from the DeepSpeed JSON the YAML names (`deepspeed:`) or from a
top-level `cluster_sampling:` key of the YAML with the same fields; both at
once is an error (`frontend_block`). The frontend builds its own trainer,
so ds_cluster gives it a class: `ClusterSamplingMixin` before the frontend's
trainer, with `FrontendRowsMixin` before both (the plan is of the frontend's
token rows, and their rendered text is kept for `ds-cluster report`), bound to
a YAML block by `bind_block`. The frontend options that would override the
plan (a sampler of their own, packing, another loss) are refused by name with
the reason (`Refusal`, `check_refusals`), before the model loads.

Neither axolotl nor LLaMA-Factory is imported here: their modules
(`ds_cluster.integrations.axolotl`, `ds_cluster.integrations.llamafactory`) are
the only ones that do.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

from ds_cluster import distributed
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.batching import TRAIN_BATCH
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.ds_config import BLOCK_PATH, cluster_block, read_ds_config
from ds_cluster.integrations.hf import ClusterSamplingMixin
from ds_cluster.integrations.rows import ROW_COLUMNS, RowsPlanMixin, missing_row_columns, rendered_record

logger = logging.getLogger(__name__)

# The YAML's top-level key, and the block's place in a DeepSpeed JSON.
BLOCK_KEY = "cluster_sampling"
JSON_BLOCK = ".".join(BLOCK_PATH)
# Beside the analysis folder: the rows the analysis was made of, as the frontend rendered them (one JSON per line).
RENDERED_RECORDS_SUFFIX = ".records.jsonl"


@dataclass(frozen=True)
class FrontendBlock:
    """The block a frontend run trains with, and where it was written."""

    config: ClusterSamplingConfig
    source: str  # the YAML's top-level key, or the DeepSpeed JSON's path and the block's place in it
    ds_config: Optional[dict]  # the DeepSpeed config the YAML names, read (None without one)
    top_level: bool  # the block is the YAML's top-level key (the trainer class is bound to it)


def frontend_block(top_level: Any, deepspeed: Any, frontend: str) -> FrontendBlock:
    """The block of a frontend's YAML: its top-level `cluster_sampling:` key or the JSON its `deepspeed:` names.

    ValueError when both hold a block, when neither does (the integration is
    on but has nothing to do: a block left out by mistake would train plainly),
    or when the block is not valid (unknown keys named, with the closest
    allowed one).
    """
    ds_config, ds_source = (None, None) if deepspeed in (None, "") else read_ds_config(deepspeed)
    in_json = None if ds_config is None else cluster_block(ds_config)
    if top_level is not None and in_json is not None:
        raise ValueError(f"{frontend}: the cluster_sampling block is given twice, as the YAML's top-level "
                         f"`{BLOCK_KEY}:` key and in {ds_source} ({JSON_BLOCK}); keep one of them")
    if top_level is not None or in_json is not None:
        source = f"{frontend} YAML: {BLOCK_KEY}" if top_level is not None else f"{ds_source}: {JSON_BLOCK}"
        config = ClusterSamplingConfig.from_dict(top_level if top_level is not None else in_json, source=source)
        if config.enabled and not config.analysis_path:
            raise ValueError(f"{source}: analysis_path is not set: point it at an analysis folder (written by "
                             "`ds-cluster analyze`), or at a folder for the training job to write one into")
        return FrontendBlock(config, source, ds_config, top_level is not None)
    where = f"the DeepSpeed JSON {ds_source} has no {JSON_BLOCK}" if ds_config is not None else "no `deepspeed:` JSON"
    raise ValueError(f"{frontend}: ds_cluster is on but there is no cluster_sampling block ({where}, and no "
                     f"top-level `{BLOCK_KEY}:` key in the YAML): add one (with \"enabled\": false to train plainly)")


@dataclass(frozen=True)
class Refusal:
    """A frontend option cluster sampling cannot follow: its name, when it is on, why, and what to set instead."""

    option: str
    reason: str
    fix: str
    is_on: Callable[[Any], bool] = bool


def check_refusals(options: Mapping[str, Any], refusals: Sequence[Refusal], frontend: str) -> None:
    """ValueError naming every option of `options` that a refusal says is on, each with its reason and fix."""
    found = [(refusal, options.get(refusal.option)) for refusal in refusals
             if refusal.option in options and refusal.is_on(options.get(refusal.option))]
    if found:
        lines = [f"- `{refusal.option}: {value}`: {refusal.reason}; set {refusal.fix}" for refusal, value in found]
        raise ValueError(f"{frontend}: cluster_sampling cannot follow {len(found)} option(s) of this YAML (or disable "
                         "cluster_sampling):\n" + "\n".join(lines))


def check_batch_size_not_auto_on_cpu(ds_config: Optional[Mapping[str, Any]], world_size: int, on_cpu: bool,
                                     frontend: str) -> None:
    """ValueError for `"train_batch_size": "auto"` under DeepSpeed on CPU with several ranks.

    Accelerate counts one process under DeepSpeed on a CPU, so the Hugging
    Face Trainer fills "auto" with micro x accumulation x 1 while every rank
    trains: DeepSpeed then stops on a batch size that does not add up.
    """
    if ds_config is None or not on_cpu or world_size <= 1 or ds_config.get(TRAIN_BATCH) != "auto":
        return
    raise ValueError(f"{frontend}: the DeepSpeed JSON says \"{TRAIN_BATCH}\": \"auto\", which the Trainer fills for "
                     f"one process under DeepSpeed on a CPU (Accelerate counts one) while {world_size} ranks train: "
                     f"remove {TRAIN_BATCH} from the JSON (DeepSpeed derives it from the micro batch, the accumulation "
                     "steps and the ranks) or write the number")


def deepspeed_on_cpu() -> bool:
    """Whether DeepSpeed will run on the CPU here (asked for, or no CUDA device)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def launched_world_size() -> int:
    """The number of ranks the launcher started (torchrun's and accelerate's WORLD_SIZE; 1 without)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class FrontendRowsMixin(RowsPlanMixin):
    """For a frontend's trainer: put it before `ClusterSamplingMixin` and the frontend's trainer class.

    The plan is of the frontend's prepared token rows (`RowsPlanMixin`). A
    class made by `bind_block` passes its YAML block as `cluster_config`.
    When the job computes the analysis, rank 0 first writes the rows as the
    frontend rendered them (prompt and trained tokens, decoded) beside the
    analysis folder, `<analysis_path>.records.jsonl`, so that `ds-cluster
    report` shows what each cluster holds and `ds-cluster export` writes the
    kept rows.
    """

    cluster_block: ClassVar[Optional[Mapping[str, Any]]] = None
    frontend: ClassVar[str] = "the frontend"

    def __init__(self, *args: Any, **kwargs: Any):
        if self.cluster_block is not None:
            kwargs.setdefault("cluster_config", dict(self.cluster_block))
        super().__init__(*args, **kwargs)
        rows = self.train_dataset  # type: ignore[attr-defined]
        if self.cluster_config.enabled and rows is not None and missing_row_columns(rows):  # type: ignore[attr-defined]
            columns = getattr(self.train_dataset, "column_names", None)  # type: ignore[attr-defined]
            raise ValueError(f"cluster_sampling needs {self.frontend}'s tokenized rows (columns {list(ROW_COLUMNS)}), "
                             f"but its train_dataset has columns {columns}")

    def rows_source(self) -> Optional[str]:
        analysis_path = self.cluster_config.analysis_path  # type: ignore[attr-defined]
        if not analysis_path:
            return None
        path = rendered_records_path(analysis_path)
        if distributed.get_rank() == 0 and not AnalysisDir(analysis_path).exists():
            write_rendered_records(self.train_dataset, self.processing_class, path)  # type: ignore[attr-defined]
        return str(path)


def rendered_records_path(analysis_path: str) -> Path:
    """Where the rendered rows of the analysis at `analysis_path` are written: `<analysis_path>.records.jsonl`."""
    folder = Path(analysis_path).absolute()
    return folder.with_name(folder.name + RENDERED_RECORDS_SUFFIX)


def write_rendered_records(rows: Any, tokenizer: Any, path: Path) -> None:
    """Every prepared row as {"prompt", "completion"} text, one JSON per line, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for index in range(len(rows)):
            handle.write(json.dumps(rendered_record(rows[index], tokenizer), ensure_ascii=False) + "\n")
    os.replace(partial, path)
    logger.info("ds_cluster: %d rows as rendered written to %s (what `ds-cluster report` reads)", len(rows), path)


def bind_block(trainer_class: type, block: Optional[Mapping[str, Any]]) -> type:
    """`trainer_class` (a FrontendRowsMixin trainer) as is without a block, else a subclass that trains with it."""
    if block is None:
        return trainer_class
    return type(trainer_class.__name__, (trainer_class,), {"cluster_block": dict(block),
                                                           "__module__": trainer_class.__module__})


def require_cluster_trainer(trainer: Any, frontend: str, why: str) -> None:
    """RuntimeError unless `trainer` is a ds_cluster trainer: training on without the plan would be silent."""
    if not isinstance(trainer, ClusterSamplingMixin):
        raise RuntimeError(f"{frontend}: the trainer is {type(trainer).__module__}.{type(trainer).__name__}, not "
                           f"ds_cluster's ({why}), so it would train without the cluster plan; stopping before "
                           "training")

