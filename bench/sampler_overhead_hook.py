"""The sampler's overhead measured in the hook: a real 2-rank DeepSpeed job, our loader against DeepSpeed's own.

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 bench/sampler_overhead_hook.py
        # writes bench/results/sampler_overhead_hook.{json,md}

One job, the shipped base model and mixture, ZeRO-2, micro batch 8, no accumulation, the same collate
(`trim_padding_collate`) for both. Two engines train side by side, epoch about: one from
`ds_cluster.initialize` with the recommended block keeping everything (its `ClusterDataLoader`), one
from `deepspeed.initialize` without the block (DeepSpeed's `DeepSpeedDataLoader` and its distributed
sampler). Timed per micro-batch on every rank: the wait for the next batch (the loader's whole cost,
the epoch set-up and the token normaliser's all-reduce included) and the training step (forward,
backward, optimizer step). The sampler's overhead is the difference of the two loaders' waits,
divided by a training step.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed_epoch(engine, loader) -> tuple[list[float], list[float]]:
    """Seconds waiting for each micro-batch and seconds of each training step, over one epoch."""
    from ds_cluster.loader.loss import token_loss_sums, weighted_causal_lm_loss

    waits, steps = [], []
    iterator = iter(loader)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        waits.append(time.perf_counter() - started)
        started = time.perf_counter()
        outputs = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        if "sample_weight" in batch:
            loss = weighted_causal_lm_loss(outputs, batch)
        else:  # DeepSpeed's own loader: the plain mean of each sample's mean response-token loss
            sums, counts = token_loss_sums(outputs.logits, batch["labels"])
            loss = (sums / counts.clamp_min(1)).mean()
        engine.backward(loss)
        engine.step()
        steps.append(time.perf_counter() - started)
    return waits, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="epochs of each loader, alternating")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    import deepspeed
    import numpy as np
    import torch

    import ds_cluster
    from ds_cluster import distributed
    from ds_cluster.data.dataset import load_instruction_dataset, trim_padding_collate
    from ds_cluster.data.models import load_model_and_tokenizer
    from bench.toy.models import base_model_path
    from bench.toy.tasks import DEFAULT_DATA

    distributed.init_distributed()
    rank = distributed.get_rank()
    work = REPO / "runs" / "sampler_overhead_hook"
    if rank == 0:
        (work / "analysis").mkdir(parents=True, exist_ok=True)
    dataset = load_instruction_dataset(DEFAULT_DATA / "train.jsonl", load_model_and_tokenizer(base_model_path())[1],
                                       max_length=96)
    families = sorted(set(dataset.categories))
    if rank == 0:  # family labels stand in for an analysis: the loader's cost does not depend on them
        np.save(work / "analysis" / "labels.npy", np.array([families.index(f) for f in dataset.categories]))
    distributed.all_gather_object(None)  # the labels exist before any rank reads them
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    hooked = copy.deepcopy(base)
    block = {"enabled": True, "preset": "recommended", "budget_ratio": 1.0, "analysis_path": str(work / "analysis")}
    hooked["data_efficiency"] = {"enabled": True, "data_sampling": {"enabled": True, "num_workers": 0,
                                                                    "cluster_sampling": block}}
    engines = {}
    for name, config, initialize in (("ds_cluster", hooked, ds_cluster.initialize),
                                     ("deepspeed", base, deepspeed.initialize)):
        model = load_model_and_tokenizer(base_model_path())[0]
        engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(), training_data=dataset,
                                          config=config, collate_fn=trim_padding_collate)
        engines[name] = (engine, loader)
    torch.manual_seed(0)
    timings = {name: {"waits": [], "steps": []} for name in engines}
    for round_index in range(args.rounds):
        for name, (engine, loader) in engines.items():
            if hasattr(loader, "data_sampler") and hasattr(loader.data_sampler, "set_epoch"):
                loader.data_sampler.set_epoch(round_index)
            waits, steps = timed_epoch(engine, loader)
            if round_index > 0:  # the first epoch of each warms caches and allocators
                timings[name]["waits"] += waits
                timings[name]["steps"] += steps
    every = distributed.all_gather_object(timings)
    if rank == 0:
        write_results(every, type(engines["ds_cluster"][1]).__name__, type(engines["deepspeed"][1]).__name__,
                      len(dataset), args.rounds)
    distributed.shutdown()
    return 0


def write_results(every: list[dict], ours: str, theirs: str, num_samples: int, rounds: int) -> None:
    import numpy as np

    def mean_ms(name: str, key: str) -> float:
        return float(np.mean([value for timing in every for value in timing[name][key]]) * 1e3)

    wait_ours, wait_theirs = mean_ms("ds_cluster", "waits"), mean_ms("deepspeed", "waits")
    step_ms = mean_ms("deepspeed", "steps")
    overhead = wait_ours - wait_theirs
    result = {"loader_wait_ms": {"ds_cluster": wait_ours, "deepspeed": wait_theirs},
              "step_ms": {"ds_cluster": mean_ms("ds_cluster", "steps"), "deepspeed": step_ms},
              "sampler_overhead_ms": overhead, "sampler_overhead_share_of_step": overhead / step_ms,
              "cluster_loader_share_of_loop": wait_ours / (wait_ours + mean_ms("ds_cluster", "steps")),
              "loaders": {"ds_cluster": ours, "deepspeed": theirs}, "ranks": len(every), "num_samples": num_samples,
              "timed_epochs_each": rounds - 1, "load_average": list(__import__("os").getloadavg())}
    text = "\n".join([
        "# The sampler's overhead in the hook", "",
        "`deepspeed --num_gpus 2 --master_addr 127.0.0.1 bench/sampler_overhead_hook.py`: the shipped base model "
        f"and mixture ({num_samples} samples), 2 ranks, ZeRO-2, micro batch 8, the same collate; "
        f"{rounds - 1} timed epochs of each loader, alternating, after one warm-up epoch each; means over "
        "every micro-batch of both ranks.", "",
        "| loader | wait for a micro-batch, ms | training step, ms |", "|---|---|---|",
        f"| ds_cluster `{ours}` (recommended, everything kept) | {wait_ours:.3f} | "
        f"{result['step_ms']['ds_cluster']:.1f} |",
        f"| DeepSpeed `{theirs}` | {wait_theirs:.3f} | {step_ms:.1f} |", "",
        (f"The sampler adds {overhead:.3f} ms per micro-batch: {overhead / step_ms:.2%} of a training step "
         if overhead > 0 else
         f"The sampler adds nothing: our loader waits {-overhead:.3f} ms less per micro-batch than DeepSpeed's "
         f"({-overhead / step_ms:.2%} of a training step) ")
        + f"(goal: an overhead under 1%). Our loader's whole wait is {result['cluster_loader_share_of_loop']:.2%} "
        f"of the loop. Load average during the run: {result['load_average'][0]:.2f}."])
    out = REPO / "bench" / "results" / "sampler_overhead_hook"
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(text)


if __name__ == "__main__":
    sys.exit(main())
