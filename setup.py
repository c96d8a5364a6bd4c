"""Package metadata for ds_cluster: cluster-balanced sampling for DeepSpeed fine-tuning.

The wheel is the library only: what a training job imports. The benchmark, its data and models, and the
toy world of the tests live beside it in the repository (bench/, tests/), not in the package.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
# The one place the version is written: ds_cluster/__init__.py.
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "ds_cluster" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="ds_cluster",
    version=VERSION,
    description="CluSTER cluster-aware balanced sampling as a DeepSpeed data-efficiency hook",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_cluster", "ds_cluster.*"]),
    install_requires=[
        # torch is installed first by launch/setup_env.sh, pinned to the CPU build on disk.
        "torch>=2.4",
        # Tested with >=0.19.5,<0.20; a newer DeepSpeed gets a warning from install(), not an error.
        "deepspeed>=0.19.5",
        "transformers>=4.45,<6",
        # transformers builds ZeRO-3-partitioned models through accelerate.
        "accelerate>=1.0",
        "datasets>=3.0",
        "scikit-learn>=1.4",
        "numpy>=1.26",
        "hjson>=3.0",
        "packaging>=23",
        "psutil>=5.9",
        "pydantic>=2.5,<3",
        "tqdm>=4.66",
    ],
    extras_require={
        # ClusterSFTTrainer: SFTTrainer builds the labels while preparing the data from 1.16 on.
        "trl": ["trl>=1.16,<2"],
        # LoRA and other PEFT models (`python -m ds_cluster.train --lora R`, a PeftModel in any trainer).
        "peft": ["peft>=0.21,<0.22"],
        # `ds-cluster report`: the plots.
        "report": ["matplotlib>=3.8"],
        "faiss": ["faiss-cpu>=1.8"],
        # mpirun discovery; needs an MPI library to build.
        "mpi": ["mpi4py>=3.1"],
        # The test command's: pytest, and the linter it runs first (ruff.toml).
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "ruff>=0.17,<0.18"],
    },
    entry_points={"console_scripts": ["ds-cluster=ds_cluster.cli:main"]},
)
