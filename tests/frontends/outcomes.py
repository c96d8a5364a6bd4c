"""What a frontend's configuration checks gave for each of several YAMLs, printed by a worker in the frontend's
environment (tests/frontends/axolotl_configs.py, llamafactory_options.py) and read back by the test."""
from __future__ import annotations

import json
import re
from typing import Callable, Sequence

MARK = "OUTCOMES "


def report_outcomes(paths: Sequence[str], check: Callable[[str], object]) -> None:
    """Print {path: "ok" or "<error type>: <message>"} of `check(path)` for every path, as one line."""
    outcomes = {}
    for path in paths:
        try:
            check(path)
            outcomes[path] = "ok"
        except Exception as err:  # noqa: BLE001 - every outcome is reported, the test reads them
            outcomes[path] = f"{type(err).__name__}: {err}"
    print(MARK + json.dumps(outcomes))


def read_outcomes(stdout: str) -> dict[str, str]:
    match = re.search(rf"^{MARK}(.*)$", stdout, re.M)
    assert match, stdout[-3000:]
    return json.loads(match.group(1))
