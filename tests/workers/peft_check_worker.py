"""deepspeed.initialize, through ds_cluster's hook, handed PEFT models that cannot train as asked: one case after
another in one 2-rank job (tests/test_peft.py). Every case must raise on every rank, and none may hang.

    frozen               every rank's adapters frozen (no parameter has requires_grad)
    frozen on rank 1     rank 1's adapters frozen, rank 0's trainable
    rank 8 on rank 1     rank 1 wraps the model with LoRA of rank 8, rank 0 with rank 4

Each rank writes OUT/rank<R>.json: {case: "<exception type>: <message>", or null when initialize raised nothing}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402

import ds_cluster  # noqa: E402
from ds_cluster import distributed  # noqa: E402
from ds_cluster.data.dataset import load_instruction_dataset  # noqa: E402
from ds_cluster.data.models import load_model, load_tokenizer, with_lora  # noqa: E402
from ds_cluster.ds_config import read_ds_config  # noqa: E402

# case -> (rank of the process -> (its LoRA rank, whether its adapters are frozen))
CASES: dict[str, Callable[[int], tuple[int, bool]]] = {
    "frozen": lambda rank: (4, True),
    "frozen on rank 1": lambda rank: (4, rank == 1),
    "rank 8 on rank 1": lambda rank: (8 if rank == 1 else 4, False),
}


def initialize_error(model_path: str, config: dict, dataset, lora_rank: int, frozen: bool) -> Optional[str]:
    """What deepspeed.initialize raised for this model, as "<type>: <message>"; None when it raised nothing."""
    model = with_lora(load_model(model_path), lora_rank)
    if frozen:
        for param in model.parameters():
            param.requires_grad_(False)
    try:
        deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                             training_data=dataset, config=config)
    except Exception as err:  # noqa: BLE001 - the test reads which error, on which rank
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    distributed.init_distributed()
    rank = distributed.get_rank()
    ds_cluster.install()
    config, _ = read_ds_config(args.deepspeed)
    dataset = load_instruction_dataset(args.data, load_tokenizer(args.model), max_length=64)
    outcomes = {case: initialize_error(args.model, config, dataset, *settings(rank))
                for case, settings in CASES.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(outcomes))
    distributed.shutdown()


if __name__ == "__main__":
    main()
