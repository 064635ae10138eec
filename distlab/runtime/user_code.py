"""Code of the user's own, named on the command line -- a model builder (``--model``), a collective
(``--collective``): ``path/to/file.py:NAME`` (the file run as a module) or ``package.module:NAME`` (imported; the
working directory is searched too). Only a flag names it: nothing is ever run from a data or checkpoint file."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from distlab.errors import ConfigError, first_line

_LOADED: dict[str, object] = {}


def is_user_code(spec: str) -> bool:
    """Whether ``spec`` names the user's own code (``FILE.py:NAME`` or ``module:NAME``)."""
    return ":" in spec


def load(spec: str, flag: str, what: str) -> object:
    """The object ``spec`` names (``flag``, and ``what`` it should be -- "a model builder" -- for the one-line error
    naming the file on any failure), loaded once per process."""
    if spec in _LOADED:
        return _LOADED[spec]
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ConfigError(f"{flag} {spec}: write it as path/to/file.py:NAME or package.module:NAME")
    from_file = where.endswith(".py") or os.sep in where
    if not from_file and where.split(".")[0] in (*sys.stdlib_module_names, "builtins"):
        raise ConfigError(f"{flag} {spec}: {where} is the standard library's, not {what}: name a function of your "
                          f"own (path/to/file.py:NAME)")
    try:
        if from_file:
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{flag} {spec}: there is no file {where}")
            name = f"distlab_user_{abs(hash(str(path.resolve()))):x}"
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module  # dataclasses and pickling look their module up here
            loader_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except SystemExit as exc:
        raise ConfigError(f"{flag} {spec}: {where} called sys.exit({exc.code!r}) while it was loaded") from None
    except Exception as exc:  # noqa: BLE001 - the user's code can fail any way: one line naming it
        raise ConfigError(f"{flag} {spec}: {where} failed to load: {type(exc).__name__}: {first_line(exc)}") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(f"{flag} {spec}: {where} has no callable {attr!r}")
    _LOADED[spec] = found
    return found
