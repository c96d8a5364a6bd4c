#!/usr/bin/env bash
# Run the linter, then the test suite (unit + 2-rank integration tests on CPU). Benchmarks marked slow are left out:
# run them with `bash launch/test.sh -m slow`. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
# The tests run on the CPU, GPU or not: their jobs are sized for it and compare CPU-side results.
export DS_ACCELERATOR=cpu
# The linter first (ruff.toml: pyflakes, pycodestyle, bugbear): a finding fails the command before the tests run.
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
