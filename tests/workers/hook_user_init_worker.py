"""A user's own DeepSpeed script: it starts DeepSpeed's process group itself, then the hook's initialize.

Run by tests/test_one_setup.py (2 ranks, deepspeed launcher) with a config whose plan cannot be built:
the job must fail on every rank with the planner's error and leave nothing in /dev/shm, although the
process group (and DeepSpeed's CPU shared-memory buffers) came from `deepspeed.init_distributed`, not
from ds_cluster.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402

import ds_cluster  # noqa: E402
from ds_cluster.data.dataset import load_instruction_dataset  # noqa: E402
from ds_cluster.data.models import load_model_and_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    config = json.loads(Path(args.deepspeed).read_text())
    model, tokenizer = load_model_and_tokenizer(args.model)
    dataset = load_instruction_dataset(args.data, tokenizer, max_length=64)
    ds_cluster.initialize(model=model, model_parameters=model.parameters(), training_data=dataset, config=config)


if __name__ == "__main__":
    main()
