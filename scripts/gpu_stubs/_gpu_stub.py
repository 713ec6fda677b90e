"""What every stub of the GPU check's kit is (scripts/gpu_kit.sh copies scripts/gpu_stubs/ into the kit's
site_stubs/, which scripts/gpu_check.sh puts on PYTHONPATH on the GPU machine, where only torch is
installed).

A stub stands for a package that the check's jobs import but never use on the check's path (each
stub's docstring names the import that pulls it in). Importing it succeeds, and so does taking a name
from it (`from pandas import DataFrame` at import time: the name is a placeholder class, counted in
ACCESSES). Using a placeholder (calling it, instantiating it, reading its attributes) raises StubUsed,
an ImportError naming the package, counted in USES: a path that does need the package fails loudly,
naming it, instead of running on something fake.
"""
from __future__ import annotations

import sys
from collections import Counter

ACCESSES: Counter = Counter()  # "package.name" -> times a name was taken from a stub
USES: Counter = Counter()      # "package.name..." -> times a placeholder was used (each one raised)


class StubUsed(ImportError):
    pass


def _used(what: str, package: str):
    USES[what] += 1
    raise StubUsed(f"{what}: {package} is a stub in the GPU check's kit (scripts/gpu_stubs/{package}): imported "
                   f"but not expected to be used on the check's path; this path uses it, so carry the real "
                   f"package (scripts/gpu_kit.sh)", name=package)


def _dunder(attr: str) -> bool:
    return attr.startswith("__") and attr.endswith("__")


class _Placeholder(type):
    """The metaclass of a stub's names: a class that raises on any use."""

    def __call__(cls, *args, **kwargs):
        _used(f"{cls.__qualname__}()", cls.__stub_package__)

    def __getattr__(cls, attr: str):
        if _dunder(attr):
            raise AttributeError(attr)
        _used(f"{cls.__qualname__}.{attr}", cls.__stub_package__)


def install(name: str) -> None:
    """Make the module `name` a stub (a stub's own __init__ calls this at its end)."""
    mod = sys.modules[name]
    names: dict[str, type] = {}

    def __getattr__(attr: str):
        if _dunder(attr):  # import machinery, inspect, copy, pickle probing
            raise AttributeError(attr)
        ACCESSES[f"{name}.{attr}"] += 1
        if attr not in names:
            names[attr] = _Placeholder(attr, (), {"__stub_package__": name, "__module__": name,
                                                  "__qualname__": f"{name}.{attr}"})
        return names[attr]

    mod.__getattr__ = __getattr__
    mod.__gpu_kit_stub__ = True
