#!/usr/bin/env bash
# The frontend tests: ds_cluster inside axolotl and LLaMA-Factory, each run by its own command line in its own
# environment. Builds .venv (launch/setup_env.sh), .venv-axolotl and .venv-llamafactory (launch/frontend_env.sh;
# each is skipped when up to date), then runs the tests marked `frontends` (left out of launch/test.sh). Extra
# arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
# The tests run on the CPU, GPU or not, as launch/test.sh's do.
export DS_ACCELERATOR=cpu
bash launch/frontend_env.sh axolotl >/dev/null
bash launch/frontend_env.sh llamafactory >/dev/null
exec .venv/bin/python -m pytest -ra --durations=25 -m frontends tests/test_axolotl.py tests/test_llamafactory.py "$@"
