"""The benchmark's instrument: the base model an arm fine-tunes, the data files of a mixture folder, and the
environment of the jobs it starts (bench/harness/instrument.py holds them with the rest of the instrument; the
other bench scripts import them from here)."""
from __future__ import annotations

from bench.harness.instrument import data_file, default_base_model, job_env

__all__ = ["data_file", "default_base_model", "job_env"]
