"""Install cockpit_like: ``pip install -c constraints.txt -e .``."""

import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "cockpit_like" / "__init__.py").read_text()).group(1)

setup(
    name="cockpit_like",
    version=version,
    description="A debugger for neural network training: a faster, drop-in Cockpit for PyTorch",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["cockpit_like", "cockpit_like.*"]),
    python_requires=">=3.10",
    install_requires=["torch", "backpack-for-pytorch>=1.6", "numpy", "matplotlib"],
    extras_require={
        "test": ["pytest", "scikit-learn", "scipy", "transformers"],
        "examples": ["scikit-learn"],
        # integrations (cockpit_like.integrations): each imported only when used
        "lightning": ["lightning"],
        "transformers": ["transformers", "accelerate"],
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "mlflow": ["mlflow-skinny"],
        "all": ["lightning", "transformers", "accelerate", "tensorboard", "wandb", "mlflow-skinny", "tqdm"],
    },
    entry_points={"console_scripts": ["cockpit-like=cockpit_like.cli:main"]},
)
