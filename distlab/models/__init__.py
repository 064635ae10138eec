"""Models by name. Plain ``nn.Module``s: they know nothing of distribution.

``build_model(name, input_shape, num_classes, options)``; names: ``mlp`` (``mlp_widths``),
``vgg11``, ``vgg11-bn``, ``vgg19``, ``vgg19-bn``, ``resnet18``, ``small-cnn-bn`` (two conv + BN
blocks, for fast checks) for images; ``gpt`` and ``gpt-moe`` (``n_layer``, ``n_head``, ``n_embd``,
``experts`` ...; the block size is the input shape) for text. Each is a family's
:class:`~distlab.models.spec.ModelSpec` -- a builder, an options dataclass whose fields are its flags,
whether it is a text model -- registered by the family's own module; :data:`FAMILIES` names that
module, loaded when a run first asks. Adding a family is its file plus one line there.

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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError, did_you_mean, first_line, with_article
from distlab.runtime import user_code
from distlab.models.contract import ModelContract, contract
from distlab.models.spec import ModelSpec, Options


# Each model's module loads when a run builds one (or asks for its class): importing the strategies
# and the trainer loads none of them (tests/test_architecture.py).
_CLASSES = {"GPT": "distlab.models.gpt", "MLP": "distlab.models.mlp", "ResNet18": "distlab.models.resnet",
            "SmallCNN": "distlab.models.small_cnn", "VGG": "distlab.models.vgg"}


def __getattr__(name: str):
    """``distlab.models.GPT`` and the other model classes, imported on first use (PEP 562)."""
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A registered name -> the module that defines its family (and registers its spec when loaded):
# adding a family is its file plus one line here.
FAMILIES = {
    "mlp": "distlab.models.mlp", "mlp-bn": "distlab.models.mlp",
    "vgg11": "distlab.models.vgg", "vgg11-bn": "distlab.models.vgg", "vgg19": "distlab.models.vgg",
    "vgg19-bn": "distlab.models.vgg",
    "resnet18": "distlab.models.resnet",
    "small-cnn-bn": "distlab.models.small_cnn",
    "gpt": "distlab.models.gpt", "gpt-moe": "distlab.models.gpt",
    "llama": "distlab.models.llama", "llama-moe": "distlab.models.llama",
    "gemma3": "distlab.models.gemma",
}
_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Make ``spec`` a model name of every command and API (a family's module calls it when loaded;
    a family of your own calls it before the run)."""
    _SPECS[spec.name] = spec
    return spec


def spec(name: str) -> ModelSpec:
    """The registered family ``name`` (its module loaded on first use); one line for an unknown name."""
    if name not in _SPECS and name in FAMILIES:
        importlib.import_module(FAMILIES[name])
    if name not in _SPECS:
        check_model_name(name)
        raise ConfigError(f"model {name} is your own builder, not a registered family")
    return _SPECS[name]


def specs() -> list[ModelSpec]:
    """Every registered family, built-in ones first."""
    return [spec(name) for name in model_names()]


def option_owners() -> dict[str, list[str]]:
    """``{option field: [model names that take it]}`` over every registered family."""
    owners: dict[str, list[str]] = {}
    for s in specs():
        for name in s.options.names():
            owners.setdefault(name, []).append(s.name)
    return owners


def options_from(model: str, given: dict) -> Options:
    """``model``'s options from the flags ``given``; one line naming a flag the model does not take."""
    from dataclasses import fields
    owners = option_owners()
    if is_user_model(model):
        name = sorted(given)[0]
        raise ConfigError(f"`{name}` is an option of model {', '.join(owners[name])}; your own model {model} takes "
                          f"its arguments as `model_args` key=value: drop `{name}`")
    family = spec(check_model_name(model))
    for name in sorted(given):
        if name not in family.options.names():
            meta = next(f.metadata for s in specs() if s.name == owners[name][0] for f in fields(s.options)
                        if f.name == name)
            what = f"for {meta['what']}" if meta.get("what") else "an option"
            raise ConfigError(f"`{name}` is {what} (--model {', '.join(owners[name])}); model {model} has no such "
                              f"option: drop `{name}`")
    return family.make_options(given)


def is_text_model(name: str) -> bool:
    """Whether ``name`` is a registered language model (your own builder's kind is read from its data)."""
    return not is_user_model(name) and spec(name).text


def snapshot_record(model: nn.Module) -> dict:
    """What a snapshot of ``model`` must agree on besides its name, arguments and parameter count: its
    own ``snapshot_record()`` (:mod:`distlab.models.plans`). Every record has an ``mlp_widths`` entry,
    None but for the MLP's, as every snapshot written so far has."""
    return {"mlp_widths": None, **contract(model).snapshot_record()}


def flops_per_token(model: nn.Module) -> float | None:
    """Training FLOPs per token of ``model`` as it counts them (its ``flops_per_token()``:
    :mod:`distlab.models.plans`); None where it declares none."""
    flops = contract(model).flops_per_token()
    return float(flops) if flops is not None else None


def model_names() -> list[str]:
    return [*FAMILIES, *(n for n in _SPECS if n not in FAMILIES)]


def is_user_model(name: str) -> bool:
    """Whether ``name`` names the user's own builder (``FILE.py:NAME`` or ``module:NAME``)."""
    return user_code.is_user_code(name)


def check_model_name(name: str) -> str:
    if is_user_model(name):
        load_builder(name)
    elif name not in FAMILIES and name not in _SPECS:
        raise ConfigError(f"unknown model {name!r}{did_you_mean(name, model_names())}; choose one of: "
                          f"{', '.join(model_names())}, or your own as path/to/file.py:build or package.module:build")
    return name


def load_builder(spec: str) -> Callable[..., nn.Module]:
    """The callable ``spec`` names: ``path/to/file.py:build`` (the file run as a module) or
    ``package.module:build`` (imported; the working directory is searched too): a function or an ``nn.Module``
    class (:func:`distlab.runtime.user_code.load`). One line naming the file on any failure."""
    builder = user_code.load(spec, "--model", "a model builder")
    if inspect.isclass(builder) and not issubclass(builder, nn.Module) or \
            not inspect.isclass(builder) and not inspect.isfunction(builder):
        what = "a class that is not an nn.Module" if inspect.isclass(builder) else with_article(type(builder).__name__)
        raise ConfigError(f"--model {spec}: {spec.rpartition(':')[2]} is {what}, not a model builder: name a "
                          f"function or nn.Module class that returns the model")
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


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, options: Options | None = None,
                **values) -> nn.Module:
    """The model ``name`` for samples of ``input_shape`` and ``num_classes`` classes (a text model's
    vocabulary): a family's with ``options`` (its :class:`~distlab.models.spec.Options`) or, without,
    the option ``values`` by field name (others ignored: ``widths`` is ``mlp_widths``); your own
    builder's with ``model_args``."""
    if not is_user_model(name):
        family = spec(check_model_name(name))
        if options is None:
            values.setdefault("mlp_widths", values.pop("widths", None))
            options = family.make_options({k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()
                                           if k in family.options.names() and v is not None})
        return contract(family.build(tuple(input_shape), num_classes, options))
    options = values
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
    return contract(model)


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


__all__ = ["IGNORE_INDEX", "GPT", "MLP", "ModelContract", "ResNet18", "ModelSpec", "contract", "Options", "SmallCNN", "VGG", "build_model", "check_model_name",
           "count_parameters", "flops_per_token", "is_text_model", "is_user_model", "load_builder", "model_names", "register", "spec", "specs", "parse_model_args",
           "task_correct", "task_loss"]
