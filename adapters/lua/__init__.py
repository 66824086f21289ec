"""The Lua scripts of the budget store and the gate, loaded as text.

Each script is `common.lua` (shared helpers) followed by the script's own file, so every
script stays one atomic EVALSHA that touches only the keys of one pool's hash tag.
"""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def script_text(name: str) -> str:
    """The full Lua source of script `name` (e.g. "admit"), with the shared helpers first."""
    folder = resources.files(__package__)
    common = folder.joinpath("common.lua").read_text(encoding="utf-8")
    body = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return f"{common}\n{body}"
