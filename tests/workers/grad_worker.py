"""One optimizer step with the weighted loss through real DeepSpeed; saves parameters before and after.

Run by tests/test_hook.py under mpirun (2 ranks). The global batch is the whole
kept subset, so the step's gradient is the stratified estimate of the full-data
mean gradient, which the test recomputes by hand. Each --out folder (one per loss
reduction) gets its own engine, one after the other, in one launch.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ds_cluster  # noqa: E402
from ds_cluster import distributed  # noqa: E402
from ds_cluster.loader.loss import weighted_causal_lm_loss  # noqa: E402
from tests.workers.feature_fixtures import tiny_llama, token_dataset  # noqa: E402


def one_step(out: Path, stage: int) -> None:
    """One optimizer step of the job in `out` (its ds_config.json and analysis); rank 0 saves out/delta.npz."""
    import deepspeed

    config = json.loads((out / "ds_config.json").read_text())
    config["zero_optimization"] = {"stage": stage}
    model = tiny_llama(seed=0)
    dataset = token_dataset(int(np.load(out / "analysis" / "labels.npy").shape[0]), seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # The config's optimizer (torch SGD at lr 1), as ClusterTrainer's run of the same config uses it.
    engine, _, loader, _ = ds_cluster.initialize(model=model, model_parameters=model.parameters(),
                                                 training_data=dataset, config=config)
    engine.train()
    for batch in loader:
        outputs = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        engine.backward(weighted_causal_lm_loss(outputs, batch))
        engine.step()
        if engine.global_steps == 1:
            break
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        if distributed.get_rank() == 0:
            delta = {name: (before[name] - params[name].detach()).numpy() for name in before}
            np.savez(out / "delta.npz", **delta)
    engine.destroy()
    del engine
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, action="append", help="a job folder; repeat for several")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    distributed.init_distributed()
    for out in args.out:
        one_step(Path(out), args.stage)
    distributed.shutdown()


if __name__ == "__main__":
    main()
