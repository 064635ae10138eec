"""Your model against the data, before any work: a model of the user's own (``file.py:build``) is run
once on two samples of the data set's shape -- on the meta device (no memory, no arithmetic), or on
real zeros where its forward reads a value -- and a misfit is one line saying what the data gives, what
the model returned and what it should return."""

from __future__ import annotations

import torch

from distlab.data import is_text
from distlab.errors import ConfigError, first_line, with_article

REAL_CHECK_PARAMETERS = 1 << 26  # a model this small is built for real when the meta device cannot run it


def check_fit(cfg, net) -> None:
    """Your model against the data, before any work: it has parameters, takes a batch of the data
    set's inputs and returns ``(B, classes)`` logits (a classifier) or ``(B, T, vocab)`` (a language
    model) -- one forward of 2 samples on the meta device, or, for a model that cannot run there
    (``.item()`` in its forward), on real zeros (:func:`_forward_for_real`). ``net``: the model built on
    the meta device."""
    if next(net.parameters(), None) is None:
        raise ConfigError(f"model {cfg.model} has no parameters: there is nothing to train (its builder returned "
                          f"{with_article(type(net).__name__)} without weights)")
    shape, classes = cfg.data_shape()
    text = is_text(cfg.dataset)
    x = torch.zeros((2, *shape), dtype=torch.long if text else torch.float32, device="meta")
    gives = f"(B, {', '.join(map(str, shape))}){' token ids' if text else ''}"
    should = f"(B, {shape[0]}, {classes}): a score per token of the vocabulary" if text else \
        f"(B, {classes}): a score per class"
    try:
        with torch.no_grad():
            out = net(x)
    except Exception as exc:  # noqa: BLE001 - the user's forward: one line naming what it was given
        if isinstance(exc, NotImplementedError) or "meta" in str(exc).lower():
            out = _forward_for_real(cfg, net, x)  # a forward that reads values (.item()): on real zeros
            if out is None:
                return
        else:
            raise ConfigError(f"model {cfg.model} does not fit dataset {cfg.dataset}: the data set gives inputs "
                              f"{gives}, and the model's forward failed on them: {type(exc).__name__}: "
                              f"{first_line(exc, 200)}") from None
    want = (2, shape[0], classes) if text else (2, classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = f"(B, {', '.join(map(str, out.shape[1:]))})" if isinstance(out, torch.Tensor) and out.dim() \
            else with_article(type(out).__name__) if not isinstance(out, torch.Tensor) else "a scalar"
        raise ConfigError(f"model {cfg.model} does not fit dataset {cfg.dataset}: given inputs {gives}, it "
                          f"returned {got}; it should return {should}")


def _forward_for_real(cfg, meta_net, x):
    """The forward of 2 zero samples on the CPU, where the meta device cannot run the model (its forward
    reads a value: ``.item()``, data-dependent shapes): built for real when it has at most
    :data:`REAL_CHECK_PARAMETERS` parameters, the random streams put back after (the run's own
    initialisation is untouched); None for a larger model (left to the run)."""
    from distlab.models import build_model
    if sum(p.numel() for p in meta_net.parameters()) > REAL_CHECK_PARAMETERS:
        return None
    shape, classes = cfg.data_shape()
    gives = f"(B, {', '.join(map(str, shape))})"
    with torch.random.fork_rng(devices=[]):
        try:
            net = build_model(cfg.model, shape, classes, **cfg.model_options())
            with torch.no_grad():
                return net(torch.zeros(x.shape, dtype=x.dtype))
        except Exception as exc:  # noqa: BLE001 - the user's code: one line naming what it was given
            raise ConfigError(f"model {cfg.model} does not fit dataset {cfg.dataset}: the data set gives "
                              f"inputs {gives}, and the model's forward failed on them: {type(exc).__name__}: "
                              f"{first_line(exc, 200)}") from None
