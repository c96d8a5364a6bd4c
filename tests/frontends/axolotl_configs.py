"""Reads axolotl YAMLs the way `axolotl train` does (axolotl.cli.config.load_cfg: plugins registered, the config
validated) and prints, as one JSON line, what each gave: "ok" or the error. Run in .venv-axolotl by
tests/test_axolotl.py: `python tests/frontends/axolotl_configs.py A.yml B.yml ...`."""
from __future__ import annotations

import sys

if __name__ == "__main__":
    from axolotl.cli.config import load_cfg

    from tests.frontends.outcomes import report_outcomes

    report_outcomes(sys.argv[1:], load_cfg)
