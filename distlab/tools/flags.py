"""Where field names meet flag names: the one map between the library's words and the CLI's.

Library code (``Strategy``, ``TrainConfig``, the parallel layers) names fields in its error
messages, in backquotes (`grad_accum`); the command line shows them as the flags a user typed
(``--grad-accum``). A field's flag is ``--`` plus its name with dashes, except where
:data:`SPECIAL` says otherwise.
"""

from __future__ import annotations

import re
from dataclasses import fields

from distlab.parallel import Strategy

SPECIAL = {"time_budget_s": "--time-budget", "model_args": "--model-arg"}


def flag(name: str) -> str:
    """``grad_accum`` -> ``--grad-accum``."""
    return SPECIAL.get(name, "--" + name.replace("_", "-"))


def flagify(message: str) -> str:
    """An error message with every `field` in backquotes written as its flag."""
    return re.sub(r"`([a-z_]+)`", lambda m: flag(m.group(1)), message)


def strategy_flags(strategy: Strategy) -> list[str]:
    """The ``distlab train`` flags that ask for ``strategy`` (every field, so defaults cannot drift)."""
    out: list[str] = []
    for f in fields(Strategy):
        value = getattr(strategy, f.name)
        if isinstance(value, bool):
            out += [flag(f.name)] if value else []
        elif value is None:
            continue
        elif f.name == "dims":
            out += [flag(f.name), ",".join(f"{name}={size}" for name, size in value)] if value else []
        elif isinstance(value, tuple):
            out += [flag(f.name), ",".join(map(str, value))]
        else:
            out += [flag(f.name), f"{value:g}" if isinstance(value, float) else str(value)]
    return out
