"""The value rules every config check uses: each raises ConfigError naming the field and the rule
(`framework.clip_grad=-1 must be >= 0`). conf/validate.py checks the groups with them, each framework's
rules (ledger/faithful/<name>/rules.py) its own knobs."""
from __future__ import annotations

from ledger.errors import ConfigError


def at_least(group: str, cfg, names, least: int | float) -> None:
    for n in names:
        v = cfg[n]
        if v is None or isinstance(v, bool) or not v >= least:
            raise ConfigError(f"{group}.{n}={v} must be >= {least}")


def at_most(group: str, cfg, bounds: dict) -> None:
    """Each field of bounds (name -> largest value, ledger/limits.py) within its bound."""
    from ledger.limits import too_large

    for n, bound in bounds.items():
        v = cfg[n] if n in cfg else None
        why = too_large(f"{group}.{n}", v, bound) if isinstance(v, int) and not isinstance(v, bool) else None
        if why:
            raise ConfigError(why)


def positive(group: str, cfg, names) -> None:
    for n in names:
        v = cfg[n]
        if v is None or not v > 0:
            raise ConfigError(f"{group}.{n}={v} must be > 0")


def one_of(group: str, cfg, name: str, allowed) -> None:
    v = cfg[name]
    if v not in allowed:
        raise ConfigError(f"{group}.{name}={v!r} must be one of {', '.join(map(str, allowed))}")


def knob(fw_cfg, name: str):
    """A framework knob's value; None for a config without it (textbook mode needs none)."""
    try:
        return getattr(fw_cfg, name)
    except (AttributeError, KeyError):
        return None


def check_sizes(fw_cfg, rules) -> None:
    """Sizes and budgets a framework takes in elements: rules are (field, least value, what it is)."""
    for name, least, what in rules:
        v = knob(fw_cfg, name)
        if v is not None and v < least:
            raise ConfigError(f"framework.{name}={v} must be >= {least} ({what})")
