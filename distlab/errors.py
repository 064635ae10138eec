"""Errors that the CLI prints as one line (``distlab: error: ...``) instead of a traceback.

Anything that is the user's to fix (a flag, a path, a port, a peer that never came) raises one
of these with a message that says what was wrong and what to do. A plain exception is a bug.
"""

from __future__ import annotations


class DistlabError(Exception):
    """Base class: a problem the user can fix. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(DistlabError):
    """Invalid flags or an invalid combination of flags; found before any work is done."""

    exit_code = 2


class RankConfigError(ConfigError):
    """A configuration problem of one rank alone (say, its device): every rank that has it says so.

    Plain :class:`ConfigError`s are the same on every rank, so only rank 0 prints them.
    """


class DataNotFoundError(ConfigError):
    """A dataset that is not on disk where we looked."""


class DistributedError(DistlabError):
    """Start-up or communication failed: a peer is missing or dead, a port is taken."""
