"""LLaMA-Factory as a later release might have it, then ds_cluster's launcher on a YAML (.venv-llamafactory only).

`python tests/frontends/llamafactory_changed_workflow.py VARIANT cfg.yaml`, run by tests/test_llamafactory.py:
- `bound`: the SFT workflow builds its trainer from a class it was given at import, not from the module's
  `CustomSeq2SeqTrainer` (ds_cluster's check of the workflow must stop the run before anything loads);
- `local`: the workflow imports `CustomSeq2SeqTrainer` inside the function, from the trainer module (the check
  passes, and the trainer built is LLaMA-Factory's own: the guard must stop it before its first step).
Both run LLaMA-Factory's own SFT code; only where it reads its trainer class from changes.
"""
from __future__ import annotations

import sys
import types

from llamafactory.train import tuner
from llamafactory.train.sft import workflow

from ds_cluster.integrations import llamafactory as integration

ORIGINAL = workflow.run_sft


def run_sft_bound(*args, _trainer_class=workflow.CustomSeq2SeqTrainer, **kwargs):
    namespace = dict(ORIGINAL.__globals__)
    namespace[integration.TRAINER_NAME] = _trainer_class
    return types.FunctionType(ORIGINAL.__code__, namespace)(*args, **kwargs)


def run_sft_local(*args, **kwargs):
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

    namespace = dict(ORIGINAL.__globals__)
    namespace[integration.TRAINER_NAME] = CustomSeq2SeqTrainer
    return types.FunctionType(ORIGINAL.__code__, namespace)(*args, **kwargs)


if __name__ == "__main__":
    variant, *argv = sys.argv[1:]
    workflow.run_sft = tuner.run_sft = {"bound": run_sft_bound, "local": run_sft_local}[variant]
    integration.main(argv)
