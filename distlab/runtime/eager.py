"""Functions a compiled graph must call rather than trace -- collectives, hooks that swap parameters --
marked with :func:`eager`: ``torch.compiler.disable`` on them, applied when compilation is first asked for
(:func:`arm`, by :func:`distlab.parallel.compile.apply_compile`). Importing torch's compiler costs every
process over a second, and most runs never compile; until then a marked function is called as it is."""

from __future__ import annotations

import torch

_BOXES: list[tuple[list, object]] = []  # (the current version, the wrapper calling it)
_ARMED = False


def eager(fn):
    """``fn`` run as it is under ``torch.compile`` (a graph break around it, never traced) once :func:`arm` ran;
    a plain call before. A thin wrapper calls the current version, so references taken at import keep working."""
    box = [torch.compiler.disable(fn) if _ARMED else fn]

    def run(*args, **kwargs):
        return box[0](*args, **kwargs)
    run.__name__, run.__qualname__, run.__doc__, run.__module__ = fn.__name__, fn.__qualname__, fn.__doc__, \
        fn.__module__
    _BOXES.append((box, run))
    if _ARMED:
        _skip(run)
    return run


def _skip(run) -> None:
    # the thin wrapper itself: a call to it is a graph break where it stands, and a frame of its own is never
    # compiled (else dynamo compiles each call of it anew, a graph holding only the break, up to its recompile
    # limit, each compile for nothing)
    from torch._dynamo.decorators import skip
    skip(run)


def arm() -> None:
    """Make every :func:`eager` function a graph break for ``torch.compile`` (imports the compiler, once)."""
    global _ARMED
    if not _ARMED:
        for box, run in _BOXES:
            box[0] = torch.compiler.disable(box[0])
            _skip(run)
        _ARMED = True
