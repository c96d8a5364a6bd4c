"""The quality benchmark's one DeepSpeed job: every arm trained and evaluated in one launch.

    deepspeed --num_gpus 2 bench/quality_job.py --spec WORK/spec.json      (bench/quality.py starts it)

What it does is bench/harness/job.py's (the analyses, each arm's training and evaluation, the gate); this is the
script the deepspeed launcher starts.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

PROCESS_STARTED = time.time()  # the job's start-up is charged from here, before any import
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(PROCESS_STARTED))
