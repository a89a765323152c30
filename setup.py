"""megatron-ext: pipeline features for megatron-core 0.19.2, as a plugin."""

import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(
    r'^__version__ = "([^"]+)"', Path("megatron_ext/__init__.py").read_text(), re.M
).group(1)

setup(
    name="megatron-ext",
    version=VERSION,
    description="mHC, mHC under pipeline parallelism and multi-module pipelines for megatron-core",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    # The recipes and their golden values ship as package data (megatron_ext/_recipes), so
    # `megatron-ext recipes --copy NAME` works after a plain pip install.
    packages=[*find_packages(include=["megatron_ext", "megatron_ext.*"]), "megatron_ext._recipes"],
    package_dir={"megatron_ext._recipes": "recipes"},
    package_data={
        # PEP 561: the package's own annotations are what type checkers should read.
        "megatron_ext": ["py.typed"],
        "megatron_ext._recipes": ["*.yaml", "README.md", "golden/*/*.json"],
    },
    install_requires=[
        # Ranges, not pins: pip keeps the megatron-core (a wheel or an editable Megatron-LM
        # checkout) and torch the user already has. The registry refuses megatron-core code it
        # was not verified on, with a message, at install() time.
        "megatron-core>=0.19.2,<0.21",
        "torch>=2.6,<2.15",
        "numpy",
        "psutil",  # megatron's torch_dist checkpoint writer imports it
        "pyyaml",
        "matplotlib",  # schedule timelines and loss plots
    ],
    extras_require={
        "test": ["pytest", "hypothesis"],  # hypothesis: fuzzing (tests/unit_tests/recipes, cli)
        # GPU only; the Dockerfile's NVIDIA PyTorch base image brings it (and apex).
        "te": ["transformer-engine[pytorch]"],
        # Logging back-ends behind Megatron's --tensorboard-dir / --wandb-project flags. Recipe
        # runs read their metrics from TensorBoard files (requirements.txt, CI and the Docker
        # image install it); without it they fall back to the log lines. An extra, not a hard
        # dependency: tensorboard + grpcio + its data server are ~20 MiB, which the offline GPU
        # wheelhouse (64 MiB limit, 43 MiB without them) cannot carry.
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        # prepare-data's example tokenizers, and megatron's HuggingFace/SentencePiece tokenizers.
        "data": ["tokenizers", "sentencepiece", "transformers"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:console_main"]},
)
