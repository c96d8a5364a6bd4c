"""Every `deepspeed.initialize` call shape of the table, without and with ds_cluster's hook; started by
tests/test_call_shapes.py in one process (RANK=0, WORLD_SIZE=1).

Writes OUT/outcomes.json: for each row, what the call returned (engine, optimizer, loader and scheduler
types) or raised (type and message), once with DeepSpeed's own initialize and once through the hook.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

NUM_SAMPLES = 32
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0}}
# The same config as HJSON: comments, unquoted keys and strings, no commas at line ends.
HJSON = """{
  # a DeepSpeed config in HJSON, as DeepSpeed accepts it
  train_micro_batch_size_per_gpu: 2
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  optimizer: {
    type: AdamW
    params: {lr: 0.001, "torch_adam": true}
  }
  zero_optimization: {stage: 0}
  %s
}
"""


class SingleProcessMpu:
    """A model-parallel unit for one process: data parallel over the whole (one-rank) world."""

    def _group(self) -> Any:
        return torch.distributed.group.WORLD

    get_data_parallel_group = get_model_parallel_group = _group

    def get_data_parallel_rank(self) -> int:
        return 0

    get_model_parallel_rank = get_data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return 1

    get_model_parallel_world_size = get_data_parallel_world_size


def block_of(kind: str, analysis: Path) -> dict:
    if kind == "absent":
        return {}
    block = {"enabled": kind == "enabled", "analysis_path": str(analysis), "allocation": "stratified"}
    return {"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "cluster_sampling": block}}}


def write_configs(root: Path, analysis: Path) -> dict[str, dict[str, Any]]:
    """Per block kind: the config as a dict, a JSON path and an HJSON path."""
    forms: dict[str, dict[str, Any]] = {}
    for kind in ("absent", "disabled", "enabled"):
        config = {**BASE, **block_of(kind, analysis)}
        json_path = root / f"{kind}.json"
        json_path.write_text(json.dumps(config))
        hjson_path = root / f"{kind}.hjson"
        extra = ("" if kind == "absent"
                 else "data_efficiency: " + json.dumps(block_of(kind, analysis)["data_efficiency"]))
        hjson_path.write_text(HJSON % extra)
        forms[kind] = {"dict": config, "json": str(json_path), "hjson": str(hjson_path)}
    return forms


def rows(forms: dict[str, dict[str, Any]], root: Path) -> list[tuple[str, str, Callable[[], dict]]]:
    """(name, block kind, keyword arguments of initialize apart from the model) for every row of the table."""
    def collate(items: list[dict]) -> dict:
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    table = []
    for kind, form in forms.items():
        for name, config in (("config dict", form["dict"]), ("JSON path", form["json"]), ("HJSON path", form["hjson"])):
            table.append((f"{kind}: {name}", kind, lambda c=config: {"config": c, "training_data": DATA}))
        table += [
            (f"{kind}: args.deepspeed_config", kind,
             lambda f=form: {"args": argparse.Namespace(deepspeed_config=f["json"], local_rank=0),
                             "training_data": DATA}),
            (f"{kind}: config_params", kind, lambda f=form: {"config_params": f["dict"], "training_data": DATA}),
            (f"{kind}: no training_data", kind, lambda f=form: {"config": f["dict"]}),
            (f"{kind}: collate_fn", kind, lambda f=form: {"config": f["dict"], "training_data": DATA,
                                                          "collate_fn": collate}),
            (f"{kind}: dist_init_required=False", kind, lambda f=form: {"config": f["dict"], "training_data": DATA,
                                                                        "dist_init_required": False}),
            (f"{kind}: parameter groups", kind, lambda f=form: {"config": f["dict"], "training_data": DATA,
                                                                "groups": True}),
            (f"{kind}: mpu", kind, lambda f=form: {"config": f["dict"], "training_data": DATA,
                                                   "mpu": SingleProcessMpu()}),
            (f"{kind}: args and config both (ambiguous)", kind,
             lambda f=form: {"args": argparse.Namespace(deepspeed_config=f["json"], local_rank=0),
                             "config": f["dict"], "training_data": DATA}),
        ]
    duplicate = root / "duplicate.json"
    duplicate.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    table += [
        ("no config at all", "absent", lambda: {"training_data": DATA}),
        ("config path that does not exist", "absent", lambda: {"config": str(root / "nowhere.json")}),
        ("duplicate keys in the JSON", "absent", lambda: {"config": str(duplicate), "training_data": DATA}),
    ]
    return table


DATA = [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i)), "y": torch.tensor(i % 2)}
        for i in range(NUM_SAMPLES)]


def call(initialize: Callable, options: dict) -> dict:
    """One initialize call: what came back, or what was raised."""
    options = dict(options)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if options.pop("groups", False):
        parameters: Any = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}]
    else:
        parameters = model.parameters()
    try:
        engine, optimizer, loader, scheduler = initialize(model=model, model_parameters=parameters, **options)
    except BaseException as err:  # noqa: BLE001 - the error itself is the outcome being compared
        return {"error": f"{type(err).__name__}: {err}"}
    outcome = {"engine": type(engine).__name__, "optimizer": type(optimizer).__name__,
               "loader": type(loader).__name__, "scheduler": type(scheduler).__name__, "error": None}
    del engine, optimizer, loader, scheduler
    gc.collect()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root = Path(args.out)
    analysis = root / "analysis"
    analysis.mkdir(parents=True, exist_ok=True)
    np.save(analysis / "labels.npy", np.arange(NUM_SAMPLES, dtype=np.int64) % 2)

    import deepspeed

    import ds_cluster

    deepspeed.init_distributed(dist_backend="gloo")
    plain = deepspeed.initialize
    outcomes = {}
    for name, kind, options in rows(write_configs(root, analysis), root):
        without = call(plain, options())
        ds_cluster.install()
        try:
            with_hook = call(deepspeed.initialize, options())
        finally:
            ds_cluster.uninstall()
        outcomes[name] = {"block": kind, "without": without, "with": with_hook}
    (root / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
