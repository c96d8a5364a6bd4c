"""Records what every rank of a frontend's run trains on, from inside the run (tests only).

The frontend tests put this folder on PYTHONPATH, so Python imports this file at start-up in every process the
frontend's own command line starts (the launcher, torchrun's ranks). With DS_CLUSTER_TEST_TRACE=<folder> set, it
wraps `ClusterSamplingMixin` once ds_cluster.integrations.hf is imported:
- `compute_loss`: each weighted micro-batch appends {"step", "indices", "weights", "loss"} to
  <folder>/rank<R>.jsonl, i.e. what the model really saw after the frontend's, Trainer's and Accelerate's data
  handling;
- `train`: at its end rank 0 writes <folder>/run.json (the plan's fingerprint and summary, what computing the
  analysis cost, Trainer's log history, the model's class and trainable parameters).
Nothing else changes: the wrapped methods are called as they are.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys

TRACED_MODULE = "ds_cluster.integrations.hf"


def _instrument(module) -> None:
    mixin = module.ClusterSamplingMixin
    folder = os.environ["DS_CLUSTER_TEST_TRACE"]
    compute_loss, train = mixin.compute_loss, mixin.train

    def rank() -> int:
        from ds_cluster import distributed

        return distributed.get_rank()

    def traced_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = compute_loss(self, model, inputs, return_outputs=return_outputs,
                              num_items_in_batch=num_items_in_batch)
        if model.training and "sample_weight" in inputs:
            loss = result[0] if return_outputs else result
            record = {"step": self.state.global_step, "indices": inputs["sample_index"].tolist(),
                      "weights": inputs["sample_weight"].tolist(), "loss": float(loss.detach().float()),
                      "normalizers": inputs["loss_normalizer"].tolist() if "loss_normalizer" in inputs else None}
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"rank{rank()}.jsonl"), "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        return result

    def traced_train(self, *args, **kwargs):
        output = train(self, *args, **kwargs)
        if rank() == 0 and self.plan is not None:
            run = {"plan_fingerprint": self.plan.fingerprint(), "plan": self.plan.summary(),
                   "num_rows": len(self.train_dataset),
                   "analysis_timings": (self.cluster_loader.analysis.to_json() if self.cluster_loader.analysis
                                        else {}),
                   "log_history": self.state.log_history, "trainer_class": type(self).__name__,
                   "model_class": type(self.model).__name__,
                   "trainable": [name for name, param in self.model.named_parameters() if param.requires_grad]}
            with open(os.path.join(folder, "run.json"), "w", encoding="utf-8") as handle:
                json.dump(run, handle, default=str)
        return output

    mixin.compute_loss, mixin.train = traced_compute_loss, traced_train


class _InstrumentOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ds_cluster.integrations.hf as Python would, then instruments it right after it runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRACED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _instrument(module)


if os.environ.get("DS_CLUSTER_TEST_TRACE"):
    sys.meta_path.insert(0, _InstrumentOnImport())
