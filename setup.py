"""Installs the top-level folders under one `borrowd` namespace.

`controller/`, `adapters/` and `models/` stay where they are in the repository and install as
`borrowd.controller`, `borrowd.adapters` and `borrowd.models`, so no top-level import name of
ours meets another distribution's (PyPI's `adapters`, for one) in the vLLM engine's
environment, where the scheduler plugin must import. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("controller", "adapters", "models")

setup(
    packages=[f"borrowd.{name}" for name in find_packages(include=[f"{f}*" for f in FOLDERS])],
    package_dir={f"borrowd.{folder}": folder for folder in FOLDERS},
)
