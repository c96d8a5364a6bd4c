"""Checks LLaMA-Factory YAMLs as `python -m ds_cluster.integrations.llamafactory` does before anything loads (the
block taken out, LLaMA-Factory's own parser, the refusals) and prints, as one JSON object, what each gave: "ok" or
the error. Run in .venv-llamafactory by tests/test_llamafactory.py: `python tests/frontends/llamafactory_options.py
A.yaml B.yaml ...`."""
from __future__ import annotations

import json
import sys

import yaml


def main(paths: list[str]) -> None:
    from ds_cluster.integrations.llamafactory import BLOCK_KEY, check_llamafactory_args

    outcomes = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            args = yaml.safe_load(handle)
        try:
            check_llamafactory_args(args, args.pop(BLOCK_KEY, None))
            outcomes[path] = "ok"
        except Exception as err:  # noqa: BLE001 - every outcome is reported, the test reads them
            outcomes[path] = f"{type(err).__name__}: {err}"
    print("OUTCOMES " + json.dumps(outcomes))


if __name__ == "__main__":
    main(sys.argv[1:])
