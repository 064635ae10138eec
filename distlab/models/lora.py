"""Low-rank adapters (LoRA, Hu et al. 2021): a frozen linear layer ``W`` plus a trained low-rank update,
``y = x W^T + b + (dropout(x) A^T B^T) * alpha / r`` -- ``A`` ``(r, in)``, ``B`` ``(out, r)``, ``B``
starting at zero so the adapted model starts as the base one. The arithmetic and its order are PEFT's
(``result + lora_B(lora_A(dropout(x))) * scaling``), so an adapter means the same in both.

:func:`apply` turns a model's target layers into :class:`LoRALinear` in place and freezes everything
else: only the adapters need gradients, optimizer state and a gradient sync. A :class:`LoRALinear` keeps
its base layer's ``weight`` and ``bias`` under their own names (a checkpoint of the base model loads into
it unchanged) and adds ``lora_a`` and ``lora_b``. Tensor parallel splits ``B`` with a column-parallel
layer's rows and ``A`` with a row-parallel layer's columns (:mod:`distlab.parallel.tensor_parallel.layers`).

Targets are named as PEFT's ``target_modules`` name them -- ``q_proj``, ``o_proj``, ``gate_proj`` ... or
their short forms ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down`` -- or by the model's own layer
names (the last part of a linear layer's name); ``all`` is every linear layer but the LM head.
``A`` is drawn per layer from its own generator (the run's seed and the layer's name), so the adapters
start the same on every layout and whether the model was built whole or on the meta device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError

# PEFT's (Hugging Face) names of a decoder's projections -> distlab's
ALIASES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "proj", "o": "proj", "gate_proj": "gate",
           "up_proj": "up", "down_proj": "down"}
SHORT = ("q", "k", "v", "o", "gate", "up", "down")  # the projections' names the docs use
KEYS = ("lora_a", "lora_b")
EVERY = {"all", "all-linear"}  # every linear layer but the LM head (PEFT's "all-linear")
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]*|all-linear")  # a layer's name as a target
MAX_SCALE = 1024.0  # alpha / r: an update scaled more than this is refused (1e308 diverged at the first step)
SUFFIXES = tuple(f".{key}" for key in KEYS)  # of an adapter tensor's state key


@dataclass(frozen=True)
class LoRASpec:
    """``r=16,alpha=32,dropout=0.0,targets=q,k,v,o`` (``--lora``): rank, scale numerator, dropout on the
    adapter's input, the layers adapted."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def parse(cls, text: str) -> "LoRASpec":
        """The spec of ``text``: ``KEY=VALUE`` pairs split by commas, each key once; ``targets`` takes every
        name after it."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("`lora` is r=R,alpha=A,dropout=P,targets=NAME,NAME,... (e.g. r=16,alpha=32,targets=q,v)")
        values: dict = {}
        targets: list[str] = []
        for piece in (p.strip() for p in text.split(",")):
            key, eq, value = piece.partition("=")
            if not eq:
                if "targets" not in values:
                    raise ConfigError(f"`lora` {text!r}: {piece!r} is not KEY=VALUE (names of layers follow targets=)")
                targets.append(piece)
                continue
            if key not in ("r", "alpha", "dropout", "targets"):
                raise ConfigError(f"`lora` {text!r}: unknown key {key!r} (r, alpha, dropout, targets)")
            if key in values:
                raise ConfigError(f"`lora` {text!r}: {key} is given twice")
            if key == "targets":
                values["targets"] = True
                targets.append(value)
                continue
            try:
                values[key] = int(value) if key == "r" else float(value)
            except ValueError:
                raise ConfigError(f"`lora` {text!r}: {key} is a number, not {value!r}") from None
        return cls.checked(values.get("r", cls.r), values.get("alpha", cls.alpha), values.get("dropout", cls.dropout),
                           tuple(t for t in targets if t) if "targets" in values else cls.targets, "`lora`")

    @classmethod
    def checked(cls, r, alpha, dropout, targets, where: str, names: tuple[str, ...] = ("r", "alpha", "dropout",
                                                                                       "targets")) -> "LoRASpec":
        """The spec of these values, each checked as the type and range it must be (``where`` names their
        source, ``names`` their keys there, in the message): ``r`` a whole number of at least 1, ``alpha`` a
        finite positive number whose scale ``alpha / r`` is at most :data:`MAX_SCALE`, ``dropout`` a
        probability below 1, ``targets`` layer names (``all`` or ``all-linear`` alone)."""
        number = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        r_, alpha_, dropout_, targets_ = names
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
            raise ConfigError(f"{where} {r_} is the adapters' rank, a whole number of at least 1, not {r!r}")
        if not 0.0 <= (dropout if number(dropout) else -1.0) < 1.0:
            raise ConfigError(f"{where} {dropout_} is a probability below 1, not {dropout!r}")
        if not (number(alpha) and math.isfinite(alpha) and alpha > 0):
            raise ConfigError(f"{where} {alpha_} is a finite positive number, not {alpha!r}")
        if alpha / r > MAX_SCALE:
            raise ConfigError(f"{where} {alpha_} {alpha:g} over {r_} {r} scales the adapters' update "
                              f"{alpha / r:g}-fold, past the {MAX_SCALE:g} allowed (alpha is usually r to 2r: a "
                              f"scale of 1 to 2)")
        if not (isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)):
            raise ConfigError(f"{where} {targets_} names the layers to adapt (e.g. targets=q,k,v,o)")
        bad = next((t for t in targets if not NAME.fullmatch(t)), None)
        if bad is not None:
            raise ConfigError(f"{where} target {bad!r} is not a layer's name (letters, digits, _ and .)")
        if len(targets) > 1 and set(targets) & EVERY:
            raise ConfigError(f"{where} {targets_} {','.join(targets)}: {next(iter(set(targets) & EVERY))} is "
                              f"every linear layer already; give it alone, or name the layers")
        return cls(r=r, alpha=float(alpha), dropout=float(dropout), targets=tuple(targets))

    def text(self) -> str:
        """The spec as ``--lora`` writes it (how a run records it and prints it)."""
        return f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g},targets={','.join(self.targets)}"

    __str__ = text

    @classmethod
    def of(cls, value: "LoRASpec | str | None") -> "LoRASpec | None":
        """``value`` as a spec: a spec as it is, ``--lora``'s text (or a run's record of it) parsed, None as
        None -- where a spec enters distlab (a config, a run's metadata, ``plan``'s flag)."""
        return value if value is None or isinstance(value, cls) else cls.parse(value)


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` (its own ``weight`` and ``bias``) with a trained low-rank update (module
    docstring). ``lora_a`` ``(r, in)``, ``lora_b`` ``(out, r)``."""

    def __init__(self, linear: nn.Linear, r: int, scale: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the base layer's own tensors, frozen
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        kw = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.lora_a = nn.Parameter(torch.zeros(r, self.in_features, **kw))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, r, **kw))
        self.r, self.adapter = r, Update(scale, dropout)

    @property
    def scale(self) -> float:
        return self.adapter.scale

    @property
    def dropout(self) -> float:
        return self.adapter.dropout

    def forward(self, x):
        return self.adapter(F.linear(x, self.weight, self.bias), x, self.lora_a, self.lora_b, self.training)

    def merged(self) -> torch.Tensor:
        """``W + (B A) * scale``: the weight of the plain layer that computes the same function."""
        return self.weight + (self.lora_b @ self.lora_a) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora r={self.r}, scale={self.scale:g}, dropout={self.dropout:g}"


@dataclass(frozen=True)
class Update:
    """The arithmetic of a low-rank update, apart from its factors: ``update(result, x, A, B, training)`` is
    ``result + B(A(dropout(x))) * scale`` (PEFT's order of operations). A layer that holds one as ``adapter``
    beside ``lora_a`` and ``lora_b`` is :class:`~distlab.parallel.protocols.LowRankAdapted`: tensor parallel
    splits the factors and computes the update on its part with the same object."""

    scale: float
    dropout: float = 0.0

    def __call__(self, result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 training: bool) -> torch.Tensor:
        if self.dropout and training:
            x = F.dropout(x, self.dropout, True)
        return result + F.linear(F.linear(x, a), b) * self.scale


def initial(name: str, shape: tuple[int, int], seed: int, which: str = "lora_a") -> torch.Tensor:
    """The starting value of adapter tensor ``which`` of layer ``name``: ``A`` uniform in
    ``+-1/sqrt(in)`` (PEFT's ``kaiming_uniform_(a=sqrt(5))``), from a generator of its own (``seed`` and
    the layer's name); ``B`` zeros."""
    if which == "lora_b":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def _resolve(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The names of ``model``'s linear layers the targets name (module docstring)."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    if not linears:
        raise ConfigError(f"`lora` adapts linear layers: {type(model).__name__} has none")
    head = linears[-1]  # the LM head (a classifier's output): never adapted by "all"
    if set(targets) & EVERY:
        return [n for n in linears if n != head]
    out = []
    for target in targets:
        mine = ALIASES.get(target, target)
        found = [n for n in linears if n == mine or n.endswith("." + mine)]
        if head in found:
            raise ConfigError(f"`lora` target {target!r} names the LM head ({head}), which keeps its weights: "
                              f"adapt the blocks' layers")
        if not found:
            raise ConfigError(f"`lora` target {target!r} names no linear layer of the model (its layers: "
                              f"{', '.join(_names(linears, head))}; or all, PEFT's all-linear)")
        out += [n for n in found if n not in out]
    return [n for n in linears if n in out]


def _names(linears: list[str], head: str) -> list[str]:
    """The names a target can give for ``linears`` (the head aside): the short and PEFT names of a decoder's
    projections where the model has them (q, k, v, o, gate, up, down; q_proj ...), its own names otherwise."""
    own = {n.rsplit(".", 1)[-1] for n in linears if n != head}
    short = [n for n in SHORT if ALIASES.get(n, n) in own]
    peft = [n for n, mine in ALIASES.items() if n.endswith("_proj") and mine in own]
    rest = sorted(n for n in own - {ALIASES.get(n, n) for n in SHORT} if not n.isdigit())
    return short + peft + rest


def apply(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Freeze ``model`` and put adapters on its target layers, in place (on the model's device: the meta
    device too); returns the adapted layers' names. The adapters' values are :func:`initial`'s (see
    :func:`initial_state`): set them with the model's state."""
    names = _resolve(model, spec.targets)
    for name in names:  # before anything of that rank is made
        layer = model.get_submodule(name)
        if spec.r > min(layer.in_features, layer.out_features):
            raise ConfigError(f"`lora` r {spec.r} is more than layer {name} can hold ({layer.out_features} x "
                              f"{layer.in_features}: a rank of at most {min(layer.in_features, layer.out_features)})")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), spec.r, spec.scale, spec.dropout))
    return names


def initial_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter tensor of ``model`` (whole, on the CPU) at its starting value, under its state key."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            for which in KEYS:
                key = f"{name}.{which}" if name else which
                out[key] = initial(name, tuple(getattr(m, which).shape), seed, which)
    return out


def fill(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give a model built on a real device its adapters' values (:func:`initial_state`'s, or saved ones)."""
    with torch.no_grad():
        for key, value in state.items():
            model.get_parameter(key).copy_(value)


def merge(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A whole state with adapters -> the plain model's (each adapted weight ``W + (B A) * scale``)."""
    out = {k: v for k, v in state.items() if not k.endswith(SUFFIXES)}
    for key in state:
        if key.endswith(".lora_a"):
            layer = key[:-len(".lora_a")]
            out[f"{layer}.weight"] = state[f"{layer}.weight"] + (state[f"{layer}.lora_b"] @ state[key]) * scale
    return out


def adapter_keys(state) -> list[str]:
    return [k for k in state if k.endswith(SUFFIXES)]


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Inside: ``model`` computes as its base does -- every adapter's scale 0 (each :class:`Update` a layer
    holds: a :class:`LoRALinear`'s, or the one tensor parallel gave a split layer), so ``result + update * 0``
    is ``result`` exactly -- the reference model of preference tuning without a second copy of the model.
    Restored after."""
    held = [(m, m.adapter) for m in model.modules() if isinstance(getattr(m, "adapter", None), Update)]
    try:
        for m, update in held:
            m.adapter = dataclasses.replace(update, scale=0.0)
        yield
    finally:
        for m, update in held:
            m.adapter = update
