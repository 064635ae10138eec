"""Models by name. Plain ``nn.Module``s: they know nothing of distribution.

``build_model(name, input_shape, num_classes, **options)``; names: ``mlp`` (``widths``),
``vgg11``, ``vgg11-bn``, ``vgg19``, ``vgg19-bn``, ``resnet18``, ``small-cnn-bn`` (two conv + BN
blocks, for fast checks) for images; ``gpt`` (``n_layer``, ``n_head``, ``n_embd``; the block size
is the input shape) for text. Adding one is a builder plus a registry line.

**Your own model**: ``path/to/file.py:build`` or ``package.module:build`` names a function or an
``nn.Module`` class that returns the model (:func:`load_builder`; anything else -- a standard-library
module's, a built-in -- is refused before it is called); ``model_args`` (``key=value`` strings, values read
as Python literals where they are one) are passed to it as keyword arguments, and ``input_shape`` /
``num_classes`` too where its signature names them. The file is run as Python -- it is the user's
own code, named on their command line, never anything read from a data or snapshot file (a
``--config`` file's model runs only when the command line names it too or says ``--trust-config``). How a
model describes itself to the strategies (checkpoint blocks, pipeline layers, a tensor-parallel
plan): :mod:`distlab.models.plans`.

:func:`task_loss` and :func:`task_correct` score either kind of output: a classifier's ``(B, K)``
logits against ``(B,)`` labels, or a language model's ``(B, T, V)`` logits against the ``(B, T)``
next tokens (mean over tokens: nats per token).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError, did_you_mean, first_line, with_article

Builder = Callable[..., nn.Module]

# Each model's module loads when a run builds one (or asks for its class): importing the strategies
# and the trainer loads none of them (tests/test_architecture.py).
_CLASSES = {"GPT": "distlab.models.gpt", "MLP": "distlab.models.mlp", "ResNet18": "distlab.models.resnet",
            "SmallCNN": "distlab.models.small_cnn", "VGG": "distlab.models.vgg"}


def __getattr__(name: str):
    """``distlab.models.GPT`` and the other model classes, imported on first use (PEP 562)."""
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _mlp(shape, k, widths=(512, 256), batch_norm=False, **_):
    from distlab.models.mlp import MLP
    return MLP(shape, k, tuple(widths), batch_norm=batch_norm)


def _vgg(depth, batch_norm):
    def build(shape, k, **_):
        from distlab.models.vgg import VGG
        return VGG(depth, shape, k, batch_norm=batch_norm)
    return build


def _resnet18(shape, k, **_):
    from distlab.models.resnet import ResNet18
    return ResNet18(shape, k)


def _small_cnn_bn(shape, k, **_):
    from distlab.models.small_cnn import SmallCNN
    return SmallCNN(shape, k, batch_norm=True)


def _gpt(shape, k, n_layer=2, n_head=4, n_embd=128, **_):
    from distlab.models.gpt import GPT
    return GPT(k, shape[0], n_layer, n_head, n_embd)


def _gpt_moe(shape, k, n_layer=2, n_head=4, n_embd=128, experts=8, top_k=2, capacity_factor=None, aux_coef=0.01,
             drop_policy="position", **_):
    from distlab.models.gpt import GPT
    return GPT(k, shape[0], n_layer, n_head, n_embd, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
               aux_coef=aux_coef, drop_policy=drop_policy)


REGISTRY: dict[str, Builder] = {
    "mlp": _mlp,
    "mlp-bn": lambda shape, k, **options: _mlp(shape, k, **{**options, "batch_norm": True}),
    "vgg11": _vgg(11, False), "vgg11-bn": _vgg(11, True), "vgg19": _vgg(19, False), "vgg19-bn": _vgg(19, True),
    "resnet18": _resnet18,
    "small-cnn-bn": _small_cnn_bn,
    "gpt": _gpt,
    "gpt-moe": _gpt_moe,
}
TEXT_MODELS = ("gpt", "gpt-moe")
MOE_MODELS = ("gpt-moe",)


def snapshot_record(model: nn.Module) -> dict:
    """What a snapshot of ``model`` must agree on besides its name, arguments and parameter count: its
    own ``snapshot_record()`` (:mod:`distlab.models.plans`). Every record has an ``mlp_widths`` entry,
    None but for the MLP's, as every snapshot written so far has."""
    own = getattr(model, "snapshot_record", None)
    return {"mlp_widths": None, **(own() if callable(own) else {})}


def flops_per_token(model: nn.Module) -> float | None:
    """Training FLOPs per token of ``model`` as it counts them (its ``flops_per_token()``:
    :mod:`distlab.models.plans`); None where it declares none."""
    own = getattr(model, "flops_per_token", None)
    return float(own()) if callable(own) else None


def model_names() -> list[str]:
    return list(REGISTRY)


def is_user_model(name: str) -> bool:
    """Whether ``name`` names the user's own builder (``FILE.py:NAME`` or ``module:NAME``)."""
    return ":" in name


def check_model_name(name: str) -> str:
    if is_user_model(name):
        load_builder(name)
    elif name not in REGISTRY:
        raise ConfigError(f"unknown model {name!r}{did_you_mean(name, REGISTRY)}; choose one of: "
                          f"{', '.join(REGISTRY)}, or your own as path/to/file.py:build or package.module:build")
    return name


_LOADED: dict[str, Callable[..., nn.Module]] = {}


def load_builder(spec: str) -> Callable[..., nn.Module]:
    """The callable ``spec`` names: ``path/to/file.py:build`` (the file run as a module) or
    ``package.module:build`` (imported; the working directory is searched too). One line naming
    the file on any failure."""
    if spec in _LOADED:
        return _LOADED[spec]
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ConfigError(f"--model {spec}: write your model as path/to/file.py:build or package.module:build")
    from_file = where.endswith(".py") or os.sep in where
    if not from_file and where.split(".")[0] in (*sys.stdlib_module_names, "builtins"):
        raise ConfigError(f"--model {spec}: {where} is the standard library's, not a model builder: name a function "
                          f"or nn.Module class of your own that returns the model (path/to/file.py:build)")
    try:
        if from_file:
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"--model {spec}: there is no file {where}")
            name = f"distlab_user_model_{abs(hash(str(path.resolve()))):x}"
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
        raise ConfigError(f"--model {spec}: {where} called sys.exit({exc.code!r}) while it was loaded") from None
    except Exception as exc:  # noqa: BLE001 - the user's code can fail any way: one line naming it
        raise ConfigError(f"--model {spec}: {where} failed to load: {type(exc).__name__}: {first_line(exc)}") from None
    builder = getattr(module, attr, None)
    if not callable(builder):
        raise ConfigError(f"--model {spec}: {where} has no callable {attr!r}")
    if inspect.isclass(builder) and not issubclass(builder, nn.Module) or \
            not inspect.isclass(builder) and not inspect.isfunction(builder):
        what = "a class that is not an nn.Module" if inspect.isclass(builder) else with_article(type(builder).__name__)
        raise ConfigError(f"--model {spec}: {attr} is {what}, not a model builder: name a function or nn.Module "
                          f"class that returns the model")
    _LOADED[spec] = builder
    return builder


def parse_model_args(items) -> dict:
    """``("width=64", "name=small")`` -> ``{"width": 64, "name": "small"}`` (Python literals where
    the value is one, else the text)."""
    out = {}
    for item in items or ():
        key, eq, text = str(item).partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ConfigError(f"--model-arg {item!r}: write it as key=value (e.g. width=64)")
        try:
            out[key] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[key] = text.strip()
    return out


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options) -> nn.Module:
    if not is_user_model(name):
        return REGISTRY[check_model_name(name)](tuple(input_shape), num_classes, **options)
    builder = load_builder(name)
    kwargs = parse_model_args(options.get("model_args"))
    try:
        accepted = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        accepted = {}
    for key, value in (("input_shape", tuple(input_shape)), ("num_classes", num_classes)):
        if key in accepted and key not in kwargs:
            kwargs[key] = value
    try:
        model = builder(**kwargs)
    except SystemExit as exc:
        raise ConfigError(f"--model {name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) called "
                          f"sys.exit({exc.code!r}) instead of returning a model") from None
    except Exception as exc:  # noqa: BLE001 - the user's builder: one line naming it and its arguments
        raise ConfigError(f"--model {name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: "
                          f"{type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name} returned a {type(model).__name__}, not a torch nn.Module")
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


IGNORE_INDEX = -100  # a target that is not scored (a fine-tuning prompt's tokens): torch's default ignore_index


def task_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean",
              label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy per sample (classifier) or per token (language model); ``label_smoothing`` as
    ``F.cross_entropy``'s (the target is ``1 - s`` on the true class plus ``s / K`` on every class); a
    target of :data:`IGNORE_INDEX` scores nothing and the mean is over the others."""
    if out.dim() == 3:
        out, y = out.flatten(0, 1), y.flatten()
    return F.cross_entropy(out, y, reduction=reduction, label_smoothing=label_smoothing, ignore_index=IGNORE_INDEX)


def task_correct(out: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions scored): per sample, or per token for a language model; an
    :data:`IGNORE_INDEX` target is not scored."""
    return int((out.argmax(-1) == y).sum()), int((y != IGNORE_INDEX).sum())


__all__ = ["IGNORE_INDEX", "GPT", "MLP", "ResNet18", "SmallCNN", "TEXT_MODELS", "VGG", "build_model", "check_model_name",
           "count_parameters", "flops_per_token", "is_user_model", "load_builder", "model_names", "parse_model_args",
           "task_correct", "task_loss"]
