"""Frozen dataclasses whose __init__ stores the fields straight into the instance __dict__.

The generated frozen __init__ sets each field through object.__setattr__ (about twice as slow); a
layout search builds a Layout (and a Grid) per layout, so the two share this one faster __init__.
"""
from __future__ import annotations

from dataclasses import MISSING, fields


def direct_init(cls):
    """Class decorator for a @dataclass(frozen=True, init=False): an __init__ with the dataclass's
    parameters (positional or keyword, its defaults) storing each into __dict__."""
    fs = fields(cls)
    params = ", ".join(f.name if f.default is MISSING else f"{f.name}={f.default!r}" for f in fs)
    body = "".join(f"\n    d[{f.name!r}] = {f.name}" for f in fs)
    ns: dict = {}
    exec(f"def __init__(self, {params}):\n    d = self.__dict__{body}", ns)
    ns["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = ns["__init__"]
    return cls
