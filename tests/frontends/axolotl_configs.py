"""Reads axolotl YAMLs the way `axolotl train` does (axolotl.cli.config.load_cfg: plugins registered, the config
validated) and prints, as one JSON object, what each gave: "ok" or the error. Run in .venv-axolotl by
tests/test_axolotl.py: `python tests/frontends/axolotl_configs.py A.yml B.yml ...`."""
from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    from axolotl.cli.config import load_cfg

    outcomes = {}
    for path in paths:
        try:
            load_cfg(path)
            outcomes[path] = "ok"
        except Exception as err:  # noqa: BLE001 - every outcome is reported, the test reads them
            outcomes[path] = f"{type(err).__name__}: {err}"
    print("OUTCOMES " + json.dumps(outcomes))


if __name__ == "__main__":
    main(sys.argv[1:])
