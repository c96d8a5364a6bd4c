"""Checks LLaMA-Factory YAMLs as `python -m ds_cluster.integrations.llamafactory` does before anything loads (the
block taken out, LLaMA-Factory's own parser, the refusals) and prints, as one JSON line, what each gave: "ok" or
the error. Run in .venv-llamafactory by tests/test_llamafactory.py: `python tests/frontends/llamafactory_options.py
A.yaml B.yaml ...`."""
from __future__ import annotations

import sys

import yaml


def check(path: str) -> None:
    from ds_cluster.integrations.llamafactory import BLOCK_KEY, check_llamafactory_args

    with open(path, encoding="utf-8") as handle:
        args = yaml.safe_load(handle)
    check_llamafactory_args(args, args.pop(BLOCK_KEY, None))


if __name__ == "__main__":
    from tests.frontends.outcomes import report_outcomes

    report_outcomes(sys.argv[1:], check)
