"""What a model family is to distlab: a :class:`ModelSpec` (builder, options, what it reads) and its
options, a frozen dataclass whose fields are the family's command-line flags.

A family's module defines its options and registers its spec (:func:`distlab.models.register`); the
name-to-module table in :mod:`distlab.models` loads that module when a run first asks for the name,
so adding a family is its file plus one line there -- or one ``register(ModelSpec(...))`` call
anywhere before the run (a test's own family does that).

How the built model describes itself to the strategies -- its checkpoint blocks, pipeline layers,
tensor-, context- and expert-parallel plans, FLOPs per token, snapshot record -- is the model's own
methods (:mod:`distlab.models.plans`): the spec names the family, the model answers for itself.

An option field's ``metadata`` may give ``help`` (the flag's help text), ``what`` (the feature the option
belongs to, for the refusal when a model without it is given it) and ``csv`` (a tuple of integers
written comma-separated on the command line).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from torch import nn

from distlab.errors import ConfigError


@dataclass(frozen=True)
class Options:
    """A family's options: no fields here; subclasses add theirs (each a flag: ``n_layer`` ->
    ``--n-layer``) with defaults, :meth:`check` their limits and :meth:`describe` the shape."""

    def check(self) -> None:
        """Raise :class:`~distlab.errors.ConfigError` naming the fields and numbers that do not fit."""

    def describe(self) -> str:
        """The model's shape in a few words for the run's header (``2 blocks, 4 heads, width 128``);
        empty where there is nothing to say beyond its name."""
        return ""

    def to_dict(self) -> dict:
        """The options as plain JSON values (tuples as lists), by field name."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class ModelSpec:
    """One registered model name: ``build(input_shape, classes, options)`` returns the ``nn.Module``
    (``classes`` is the vocabulary of a text model); ``options`` is its :class:`Options` class;
    ``text``: it maps ``(B, T)`` token ids to ``(B, T, vocab)`` logits (a language model) rather than
    classifying images. An outside checkpoint format's adapter is registered beside it, by the format's
    module (:func:`distlab.models.hf.register_adapter`): a family imports no checkpoint format."""

    name: str
    build: Callable[[tuple[int, ...], int, Any], nn.Module]
    options: type = Options
    text: bool = False
    summary: str = ""  # a few words for the flag's help (``the transformer``)

    def make_options(self, values: dict | None = None) -> Options:
        """The options from ``values`` by field name (the rest default), checked; one line naming what
        this model does not take."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(self.options.names()))
        if unknown:
            raise ConfigError(f"model {self.name} takes no `{unknown[0]}`"
                              + (f" (its options: {', '.join(self.options.names())})" if self.options.names()
                                 else " (it has no options)"))
        options = self.options(**values)
        options.check()
        return options


def option_help(cls: type) -> dict[str, dict]:
    """``{field: metadata}`` of an options class (help, what, csv), with each field's default."""
    return {f.name: {**f.metadata, "default": f.default} for f in fields(cls)}


def option(default, help: str = "", what: str = "", csv: bool = False):  # noqa: A002 - click's own word
    """An options field with its flag's help (``what``: the feature it belongs to)."""
    return field(default=default, metadata={"help": help, "what": what, "csv": csv})


__all__ = ["ModelSpec", "Options", "option", "option_help"]
