"""The model flags of ``distlab train``, from the registered families' options: a flag per field
(``n_layer`` -> ``--n-layer``), its help and default from the field (:mod:`distlab.models.spec`)."""

from __future__ import annotations

import click


def model_options() -> tuple[list[tuple[str, dict]], set[str]]:
    """A flag per field of every registered family's options (``n_layer`` -> ``--n-layer``), its help
    from the field, no default of its own: an option not given is the family's default (the help
    says which). A tuple field is written comma-separated."""
    from dataclasses import fields

    from distlab.models import specs
    rows: dict[str, dict] = {}
    defaults: dict[str, dict] = {}
    csv = set()
    for family in specs():
        for f in fields(family.options):
            annotation = str(f.type)
            kind = str if "tuple" in annotation else float if "float" in annotation else \
                int if "int" in annotation else click.BOOL if "bool" in annotation else str
            rows.setdefault(f.name, dict(default=None, type=kind, help=f.metadata.get("help", "")))
            if "tuple" in annotation:
                csv.add(f.name)
            value = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            defaults.setdefault(f.name, {})[family.name] = value
    for name, row in rows.items():  # click puts a text default in parentheses: the help says it as click would
        values = defaults[name]
        shown = {str(v) for v in values.values()}
        if shown != {"None"}:
            text = shown.pop() if len(shown) == 1 else "; ".join(f"{m} {v}" for m, v in values.items())
            row["help"] += f"  [default: {text}]"
    return list(rows.items()), csv


def model_help() -> str:
    """``--model``'s help: the registered names, images first, then text."""
    from distlab.models import specs
    images = [s.name for s in specs() if not s.text]
    text = [s.name + (f" ({s.summary})" if s.summary else "") for s in specs() if s.text]
    return (f"Images: {', '.join(images)}; text: {', '.join(text)}; or your own: path/to/file.py:build or "
            f"package.module:build (a callable returning an nn.Module).")
