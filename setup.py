"""Package metadata for ds_cluster: cluster-balanced sampling for DeepSpeed fine-tuning."""
from setuptools import find_packages, setup

setup(
    name="ds_cluster",
    version="0.3.0",
    description="CluSTER cluster-aware balanced sampling as a DeepSpeed data-efficiency hook",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_cluster", "ds_cluster.*"]),
    package_data={"ds_cluster": ["toy/data/default/*.jsonl", "toy/data/default/*.md", "toy/base_model/*",
                              "real/stories260k/*", "real/data/*/*"]},
    install_requires=[
        # torch is installed first by launch/setup_env.sh, pinned to the CPU build on disk.
        "torch>=2.4",
        # Tested with >=0.19.5,<0.20; a newer DeepSpeed gets a warning from install(), not an error.
        "deepspeed>=0.19.5",
        "hjson>=3.0",
        "packaging>=23",
        "psutil>=5.9",
        "transformers>=4.45,<6",
        "datasets>=3.0",
        "scikit-learn>=1.4",
        "numpy>=1.26",
        "pydantic>=2.5,<3",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "accelerate>=1.0",
        # ClusterSFTTrainer: SFTTrainer builds the labels while preparing the data from 1.16 on.
        "trl>=1.16,<2",
    ],
    extras_require={
        "faiss": ["faiss-cpu>=1.8"],
        "mpi": ["mpi4py>=3.1"],
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
    },
    entry_points={"console_scripts": ["ds-cluster=ds_cluster.cli:main"]},
)
