"""Package discovery (everything else is in pyproject.toml): every package under asyncflow/ is
found, not listed, plus dsl/ at the top of the repository installed as asyncflow.dsl."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["asyncflow", "asyncflow.*"]), "asyncflow.dsl"])
