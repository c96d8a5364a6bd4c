"""Fine-tune a Hugging Face causal LM with DeepSpeed and cluster-balanced sampling.

    deepspeed --num_gpus 2 --module ds_cluster.train --deepspeed ds_configs/zero3.json \\
        --model MODEL_DIR --data data/train.jsonl \\
        --analysis runs/demo/analysis --output-dir runs/demo/train --epochs 1

Works the same under `mpirun -np N python -m ds_cluster.train ...` (rank 0's
address from MPI or MASTER_ADDR), and is what `ds-cluster train` runs. The one ds_cluster line is
`ds_cluster.install()`; everything else is a plain DeepSpeed loop with the
weighted loss. With `--resume`, training continues from the latest
checkpoint in `--output-dir/checkpoints`, on exactly the sample sequence an
uninterrupted run would have seen.
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch

import ds_cluster
from ds_cluster import distributed
from ds_cluster.data.dataset import DEFAULT_MAX_LENGTH, load_instruction_dataset, trim_padding_collate
from ds_cluster.data.models import load_model_and_tokenizer, with_lora
from ds_cluster.ds_config import BLOCK_PATH, read_ds_config
from ds_cluster.fileio import write_json_atomic
from ds_cluster.integrations.loop import LoopHooks, LoopResult, MicroStep, train_loop
from ds_cluster.integrations.saving import save_gathered_model
from ds_cluster.loader.lr_schedules import LateLRSchedule
from ds_cluster.loader.sampler import ClusterDataLoader, cluster_loader

logger = logging.getLogger("ds_cluster.train")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", required=True,
                        help="DeepSpeed config (JSON or HJSON) with a cluster_sampling block")
    parser.add_argument("--model", required=True, help="a local Hugging Face causal-LM checkpoint folder")
    parser.add_argument("--data", required=True,
                        help="records as JSONL (.jsonl or .jsonl.gz) or a datasets save_to_disk folder: Alpaca "
                             "(instruction/input/output), chat (messages, or ShareGPT conversations) or "
                             "prompt/completion; docs/data.md")
    parser.add_argument("--analysis", help="analysis directory (overrides cluster_sampling.analysis_path)")
    parser.add_argument("--output-dir", default="runs/train", help="checkpoints, plan, trace and summary go here")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH)
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="cosine: linear warm-up over --warmup-fraction of the steps, then cosine to 0 at the "
                             "run's own last step (its length comes from the plan); with budget_ratio \"auto\" and "
                             "auto_cooldown > 0, constant after the warm-up, then linear to 0 over the cool-down the "
                             "adaptive schedule announces (docs/adaptive.md)")
    parser.add_argument("--warmup-fraction", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=0,
                        help="checkpoint every N optimizer steps (0: no checkpoints)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    parser.add_argument("--bf16", action="store_true", help="turn on bf16 in the DeepSpeed config")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="train LoRA adapters of rank R on every linear layer of the transformer blocks instead "
                             "of the whole model (peft: pip install 'ds_cluster[peft]'; 0, the default: every "
                             "parameter trains)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA scaling alpha (default 2 x R)")
    parser.add_argument("--lora-seed", type=int, default=0,
                        help="seed of the LoRA adapters' random start (peft draws lora_A at random): the same in "
                             "every launch, so a job and its rerun train the same model")
    parser.add_argument("--trace", action="store_true", help="write every micro-step's indices and loss per rank")
    parser.add_argument("--save-model", default=None, metavar="DIR",
                        help="at the end, save the trained model and tokenizer as a Hugging Face folder (rank 0; "
                             "ZeRO-3 parameters gathered), loadable with from_pretrained or --model DIR")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def prepare_config(args: argparse.Namespace) -> dict:
    config, _ = read_ds_config(args.deepspeed)
    config = copy.deepcopy(config)
    block = config
    for key in BLOCK_PATH:
        block = block.setdefault(key, {})
    if args.analysis:
        block["analysis_path"] = args.analysis
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if config.get("bf16", {}).get("enabled") and distributed.get_rank() == 0 and bf16_is_slow_here():
        logger.warning("bf16 on a CPU without bf16 instructions (no AVX-512 BF16, no AMX): torch's bf16 matrix "
                       "multiplies run far slower than float32 here (0.3 against 90 GFLOPS measured on an AVX2 "
                       "CPU); leave out --bf16 on this machine")
    return config


def bf16_is_slow_here() -> bool:
    """True on DeepSpeed's CPU accelerator when the CPU has neither AVX-512 BF16 nor AMX: torch's bf16 matrix
    multiplies then take a slow path, two orders of magnitude slower than float32 (measured, docs/features.md)."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is None for check in checks):  # a torch without the checks: nothing known, nothing said
        return False
    return not any(check() for check in checks)


def parameter_digest(engine) -> str:
    """A hash of the full parameters (gathered under ZeRO-3), to compare ranks."""
    import deepspeed

    digest = hashlib.sha256()
    for param in engine.module.parameters():  # one at a time: no rank holds the whole model
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None,
                                               enabled=engine.zero_optimization_stage() == 3):
            digest.update(param.detach().float().cpu().numpy().round(5).tobytes())
    return digest.hexdigest()[:16]


def save_hf_model(engine, tokenizer, folder: Path, rank: int) -> None:
    """Write the trained weights as a Hugging Face model folder (rank 0), gathering ZeRO-3 shards one parameter at a
    time (`integrations.saving`: no rank holds the whole model). Collective under ZeRO-3."""
    save_gathered_model(engine.module, tokenizer, folder, rank)


def output_dir_problem(output: Path) -> Optional[str]:
    """Why `output` cannot hold the run's files, or None. Creates nothing.

    access(2) is asked about the nearest folder that exists: it reports a
    read-only filesystem (EROFS) even to root, who ignores permission bits.
    """
    existing = output
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return (f"--output-dir {output} cannot be created: {existing} is a file, not a folder; "
                "choose another --output-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == output else f"its parent {existing}"
        return (f"--output-dir {output} is not writable: {where} is on a read-only filesystem or not writable "
                "by this user; choose a writable --output-dir (checkpoints, plan and summaries go there)")
    return None


def loop_hooks(args: argparse.Namespace, engine: Any, output: Path, rank: int) -> tuple[LoopHooks, Any]:
    """The script's additions to the library's loop: checkpoints every --save-every steps, and
    with --trace every micro-step's indices and loss (one JSONL file per rank). Returns the hooks and the trace file
    to close (None without --trace)."""
    checkpoints = output / "checkpoints"
    trace = None
    if args.trace:
        (output / "trace").mkdir(parents=True, exist_ok=True)
        trace = open(output / "trace" / f"rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def traced(micro: MicroStep) -> None:
        assert trace is not None
        indices = micro.batch["sample_index"].tolist() if "sample_index" in micro.batch else None
        record = {"epoch": micro.epoch, "micro": micro.micro, "step": micro.step, "indices": indices,
                  "loss": micro.loss}
        trace.write(json.dumps(record) + "\n")
        trace.flush()

    def checkpoint(step: int) -> None:
        if args.save_every and step % args.save_every == 0:
            engine.save_checkpoint(str(checkpoints))

    return LoopHooks(after_micro_step=traced if trace is not None else None, after_step=checkpoint), trace


def write_summary(result: LoopResult, engine: Any, loader: Optional[ClusterDataLoader], output: Path,
                  rank: int) -> None:
    """This rank's summary_rank<R>.json (steps, time, first and last losses, a digest of the parameters: collective
    under ZeRO-3), and rank 0's closing log line. `loader`: ds_cluster's, or None for DeepSpeed's own."""
    losses = result.losses
    summary = {"rank": rank, "steps": engine.global_steps, "micro_steps": len(losses), "train_seconds": result.wall,
               "train_cpu_seconds": result.cpu,
               "analysis_timings": loader.analysis.to_json() if loader is not None and loader.analysis else {},
               "first_losses": losses[:4], "last_losses": losses[-4:], "parameter_digest": parameter_digest(engine),
               "learning_rate": engine.get_lr()[0] if engine.get_lr() else None}
    write_json_atomic(output / f"summary_rank{rank}.json", summary)
    if rank == 0:
        plan_summary = loader.plan.summary() if loader is not None else {}
        logger.info("done: %d steps in %.1f s, final loss %.4f, kept %s of %s samples", engine.global_steps,
                    result.wall, losses[-1] if losses else float("nan"), plan_summary.get("num_kept"),
                    plan_summary.get("num_samples"))


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    distributed.init_distributed()
    rank = distributed.get_rank()
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    import deepspeed

    # Checked on every rank before the model is built: a run that cannot save its checkpoints should not
    # train for hours first, and a rank that cannot write must not leave the others waiting.
    problem = output_dir_problem(Path(args.output_dir))
    distributed.agree_on_error(ValueError(problem) if problem else None, "checking --output-dir")
    config = prepare_config(args)
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, ds_config=config, dtype=dtype)
    if args.lora:
        model = with_lora(model, args.lora, args.lora_alpha, seed=args.lora_seed)
    dataset = load_instruction_dataset(args.data, tokenizer, max_length=args.max_length)

    ds_cluster.install()  # the one line: deepspeed.initialize now returns the cluster-balanced loader
    # cosine: the run's length and the loader exist only once initialize has returned.
    late_lr = LateLRSchedule(args.warmup_fraction) if args.lr_schedule == "cosine" else None
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                                training_data=dataset, config=config,
                                                lr_scheduler=late_lr.scheduler if late_lr else None,
                                                collate_fn=trim_padding_collate)
    planned = cluster_loader(loader)  # None: the block is disabled or absent, and this is plain DeepSpeed
    steps_per_epoch = (planned.plan.steps_per_epoch if planned is not None
                       else len(loader) // engine.gradient_accumulation_steps())
    total_steps = args.epochs * steps_per_epoch
    if late_lr is not None:
        late_lr.start(loader, min(total_steps, args.max_steps) if args.max_steps else total_steps)
    output = Path(args.output_dir)
    checkpoints = output / "checkpoints"
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        if planned is not None:
            planned.plan.save(output / "plan")
    if args.resume and (checkpoints / "latest").exists():
        engine.load_checkpoint(str(checkpoints))
        logger.info("resumed at step %d", engine.global_steps)

    hooks, trace = loop_hooks(args, engine, output, rank)
    try:
        result = train_loop(engine, loader, epochs=args.epochs, max_steps=args.max_steps, hooks=hooks)
    finally:
        if trace is not None:
            trace.close()
    if args.save_model:
        save_hf_model(engine, tokenizer, Path(args.save_model), rank)
    write_summary(result, engine, planned, output, rank)
    del engine, loader, planned
    gc.collect()
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
