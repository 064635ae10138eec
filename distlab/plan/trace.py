"""A model's sizes, traced without running it: its parameters in the order ZeRO's hooks meet them, its
FLOPs, the bytes autograd saves for backward, each pipeline layer's share, and what the model-sharding
plans name (attention's keys and values, the experts) -- one forward and backward on the ``meta``
device (no memory, no arithmetic, any model size). :func:`trace` returns the :class:`Trace` every
strategy's cost model and ``distlab plan`` read; :func:`generic_trace` a model known only by its size.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from distlab.errors import ConfigError
from distlab.models import build_model, is_user_model, nf4, task_loss
from distlab.models.contract import contract
from distlab.models.parameter_roles import matrix_names
from distlab.models.plans import declared_plan, tied_names
from distlab.parallel.checkpointing import block_names
from distlab.parallel.cost import ModuleIO, under
from distlab.parallel.tensor_parallel import STYLES as TENSOR_STYLES
from distlab.parallel.tensor_parallel.plan import plan_of as tp_plan_of
from distlab.parallel.tensor_parallel.styles import TP_STYLES
from distlab.parallel.zero.units import sharded_linear
from distlab.plan.kernels import FlashAttention
from distlab.plan.layer_profile import Layer, profile_layers
from distlab.runtime.meta import on_meta_device


@dataclass
class Trace:
    """A model's parameter tensors and the order ZeRO's hooks fire in one training step."""
    names: list[str]                 # unit (parameter) names, in ZeRO's unit order
    numels: list[int]
    element_size: int
    module_of: list[int]             # unit -> index of the module that owns it directly
    events: list[tuple[str, int]] = field(default_factory=list)  # (fwd|fwd_done|bwd, module) / (grad, unit)
    flops_per_sample: float = 0.0    # forward + backward, from torch's FLOP counter
    forward_flops_per_sample: float = 0.0
    activation_bytes_per_sample: float = 0.0  # tensors autograd saves for backward (an upper bound)
    linear_shapes: list[tuple[int, int]] = field(default_factory=list)  # (in, out) of each nn.Linear, in order
    layers: list[Layer] = field(default_factory=list)  # the pipeline's view (empty: the model cannot be cut)
    sharded_linear: list[bool] = field(default_factory=list)  # module -> ZeRO-3 runs it as its sharded Linear
    input_grad: list[bool] = field(default_factory=list)  # module -> its input needs a gradient
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # unit -> parameter shape (PowerSGD's matrices)
    attention_kv_bytes_per_sample: float = 0.0  # keys + values of every attention a context_parallel_plan names
    attention_causal: bool = True  # every such attention masks later keys (False: an encoder's, over every key)
    expert_names: list[str] = field(default_factory=list)  # units of the experts an expert_parallel_plan names
    expert_slot_bytes_per_sample: float = 0.0  # token-slots entering those experts, every layer (balanced routing)
    blocks: list[list[str]] = field(default_factory=list)  # activation checkpointing's blocks, as layer names
    input_bytes_per_sample: float = 0.0  # the model's input (what a checkpointed first layer keeps)
    batch_norms: list[tuple[str, int, bool]] = field(default_factory=list)  # (name, channels, input needs a gradient)
    # (style, sp, tp) -> the model's plan, the units it shards, the layers ending inside a parallel region; tp 1
    # stands for every tp whose plan is the same (:meth:`tensor_key`)
    tensor_plans: dict[tuple[str, bool, int], dict[str, str]] = field(default_factory=dict)
    tensor_split: dict[tuple[str, bool, int], set[str]] = field(default_factory=dict)
    tensor_open: dict[tuple[str, bool, int], set[str]] = field(default_factory=dict)
    attention_kv: dict[str, float] = field(default_factory=dict)  # attention -> its keys and values per sample
    attention_scores: dict[str, float] = field(default_factory=dict)  # attention -> what the math kernel saves
    # beyond a fused one's per sample: its scores, less the output and row log-sum-exp a fused kernel keeps instead
    attention_flops: dict[str, float] = field(default_factory=dict)  # attention -> its scores' and weighted sum's
    # FLOPs per sample, forward, every query against every key (4 x queries x keys x head size)
    attention_q: dict[str, float] = field(default_factory=dict)  # attention -> its queries per sample (as many
    # bytes as its output; more than a key's under grouped-query attention)
    expert_slots: dict[str, float] = field(default_factory=dict)  # experts -> the token-slots entering them per sample
    module_io: dict[str, ModuleIO] = field(default_factory=dict)  # what each module those plans name takes and gives
    tied: dict[str, str] = field(default_factory=dict)  # a parameter's second name (a tied LM head) -> its unit's
    shared: dict[int, list[int]] = field(default_factory=dict)  # module -> units another module holds (the head's)
    kv_share: dict[int, float] = field(default_factory=dict)  # tp -> a rank's share of the keys and values, where
    # not 1/tp (key/value heads kept whole: kv_heads_per_rank(tp) / kv_heads)
    trainable: list[bool] = field(default_factory=list)  # unit -> it needs a gradient (False: frozen, a base under
    # low-rank adapters); empty: every unit does
    base: list[str] = field(default_factory=list)  # unit -> how a frozen base holds it ("": in the trace's dtype,
    # "bf16", "nf4": 4-bit, :mod:`distlab.models.nf4`); empty: every unit in the trace's dtype
    splits: dict[int, tuple[int, int]] = field(default_factory=dict)  # a 4-bit unit a rank holds a part of ->
    # (dimension, parts) of the cut (tensor parallel's)
    loss_bytes_per_sample: float = 0.0  # what the loss saves (a language model's float32 log-probabilities), in the
    # last layer's saved_bytes too
    loss_grad_bytes_per_sample: float = 0.0  # what its backward holds beside them at once: the gradient arriving
    # at the log-probabilities and the one leaving the softmax, each as large as the largest tensor it saved
    tokens_per_sample: int = 0  # a language model's window (0: not a language model)
    model_flops_per_sample: float = 0.0  # forward + backward as the model counts them (its flops_per_token(): PaLM's
    # count, what MFU divides by); 0 where it declares none
    attention: str = "math"  # how scaled_dot_product_attention was traced: math (what a CPU runs, the scores kept)
    # or flash (a GPU's fused kernel: queries, keys, values, output and the row log-sum-exp kept)
    matrices: frozenset = frozenset()  # units Muon steps (its momentum alone), by name; the rest AdamW's
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # what was derived from it (its
    # stages' parts, ZeRO's replayed peaks), kept: a trace is not changed once traced; a search asks again and again

    def matrix(self, u: int) -> bool:
        """Whether unit ``u`` is a matrix Muon steps (:func:`~distlab.models.parameter_roles.matrix_names`)."""
        return self.names[u] in self.matrices

    def trains(self, u: int) -> bool:
        return not self.trainable or self.trainable[u]

    def tensors(self, u: int) -> list[tuple[int, int]]:
        """(elements, bytes per element) of each tensor a rank holds unit ``u`` as: one in the trace's dtype, a
        frozen base's in bf16, or a 4-bit weight's codes and scales (whole, or the part :attr:`splits` says)."""
        kind = self.base[u] if self.base else ""
        if kind == "nf4":
            return nf4.tensors(self.shapes[u], *self.splits.get(u, (None, 1)))
        return [(self.numels[u], 2 if kind == "bf16" else self.element_size)]

    def unit_bytes(self, u: int) -> int:
        """Bytes of unit ``u``'s parameter as a rank holds it (:meth:`tensors`)."""
        return sum(n * e for n, e in self.tensors(u))

    @property
    def num_parameters(self) -> int:
        return sum(self.numels)

    def tensor_key(self, strategy, tp: int) -> tuple[str, bool, int]:
        """The key of the traced tensor plan a layout with ``tp`` ranks runs (the plan at ``tp`` where it
        differs from the plan at 1, e.g. key/value heads kept whole where ``tp`` does not divide them)."""
        key = (strategy.tp_style, strategy.sequence_parallel, tp)
        return key if key in self.tensor_plans else key[:2] + (1,)

    def stage(self, names: list[str]) -> "Trace":
        """The part a pipeline stage holding the layers ``names`` holds (:func:`stage_trace`), cut once."""
        if (key := ("stage", *names)) not in self.memo:
            self.memo[key] = stage_trace(self, names)
        return self.memo[key]


TRACED_TP = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # the tensor-parallel sizes whose plans a trace keeps
_TRACED: dict[str, Trace] = {}  # a family's model by its sizes -> its trace, kept in this process (the last few)
_KEEP = 8


def trace(model: nn.Module | str, input_shape: tuple[int, ...] = (1, 28, 28), num_classes: int = 10,
          batch: int = 2, lora=None, attention: str = "math", base_dtype: str = "float32", **options) -> Trace:
    """Run one forward + backward of ``model`` (an ``nn.Module`` or a registered name) on the meta
    device, recording the events ZeRO reacts to and the FLOPs per sample; ``lora`` (a
    :class:`~distlab.models.lora.LoRASpec`): with those adapters, the rest frozen, held in ``base_dtype`` (bf16, or
    nf4: each adapted weight 4-bit, the rest bf16 -- as ``distlab train --base-dtype``); ``attention="flash"``:
    attention as a GPU runs it (:class:`FlashAttention`), what it saves for backward and its FLOPs.

    A family's model named by its sizes is traced once per process (tens of seconds at 70B): a second call
    with the same arguments returns a copy of the first's trace. A module, or a user's model from a file
    (which may change between calls), is traced every time."""
    key = None
    if isinstance(model, str) and not is_user_model(model):
        key = repr((model, tuple(input_shape), num_classes, batch, lora, attention, base_dtype, sorted(options.items()),
                    torch.get_default_dtype()))
        if key in _TRACED:
            return copy.deepcopy(_TRACED[key])
    if attention == "flash":
        with FlashAttention():
            out = replace(_trace(model, input_shape, num_classes, batch, lora, base_dtype, **options), attention="flash")
    else:
        out = _trace(model, input_shape, num_classes, batch, lora, base_dtype, **options)
    if key is not None:
        while len(_TRACED) >= _KEEP:
            _TRACED.pop(next(iter(_TRACED)))
        _TRACED[key] = copy.deepcopy(out)
    return out


def _trace(model: nn.Module | str, input_shape: tuple[int, ...], num_classes: int, batch: int, lora,
           base_dtype: str = "float32", **options) -> Trace:
    if isinstance(model, str):
        with on_meta_device():
            model = build_model(model, input_shape, num_classes, **options)
    else:
        model = model.to("meta")
    if lora is not None:
        from distlab.models import lora as adapters
        adapters.apply(model, lora)
    modules, names, numels, module_of, shapes, trainable = [], [], [], [], [], []
    seen: dict[int, int] = {}  # a parameter two modules share (a tied embedding and LM head): its first module's
    shared: dict[int, list[int]] = {}  # module -> the units it uses that another module holds
    for name, m in model.named_modules():
        params = list(m.named_parameters(recurse=False))
        own = [(n, p) for n, p in params if id(p) not in seen]
        if params:
            modules.append(m)
        for pname, p in own:
            seen[id(p)] = len(names)
            names.append(f"{name}.{pname}" if name else pname)
            numels.append(p.numel())
            shapes.append(tuple(p.shape))
            trainable.append(p.requires_grad)
            module_of.append(len(modules) - 1)
        if len(own) < len(params):
            mine = {id(p) for _, p in own}
            shared[len(modules) - 1] = [seen[id(p)] for _, p in params if id(p) not in mine]
    if not names:
        raise ConfigError("the model has no parameters: nothing to plan")
    params = list(dict.fromkeys(p for m in modules for _, p in m.named_parameters(recurse=False)))
    out = Trace(names, numels, params[0].element_size(), module_of, shapes=shapes,
                trainable=trainable if not all(trainable) else [])
    out.tied = {name: group[0] for group in tied_names(model) for name in group[1:]}
    out.shared = shared
    out.matrices = frozenset(matrix_names(model))
    if lora is not None and base_dtype != "float32":
        out.base = _base(model, params, base_dtype)
    handles = []
    index = {id(m): i for i, m in enumerate(modules)}

    def after_forward(m, args, result):
        out.events.append(("fwd_done", index[id(m)]))
        tensors = result if isinstance(result, (list, tuple)) else [result]
        nodes = {t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes:
            handles.append(node.register_prehook(lambda grads, i=index[id(m)]: out.events.append(("bwd", i))))
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if nodes and inputs and not all(p.requires_grad for p in m.parameters(recurse=False)):
            # frozen parameters: ZeRO-3 releases them once the module's inputs have their gradients
            torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda grads, i=index[id(m)]: out.events.append(("release", i)))

    out.sharded_linear = [sharded_linear(m, [p for _, p in m.named_parameters(recurse=False)]) and i not in shared
                          and all(p.requires_grad for p in m.parameters(recurse=False))
                          for i, m in enumerate(modules)]  # (ZeRO-3 runs a module sharing a parameter, or a
    # frozen one, by hooks)
    out.input_grad = [True] * len(modules)

    def before_forward(m, args):
        out.events.append(("fwd", index[id(m)]))
        out.input_grad[index[id(m)]] = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    for m in modules:
        handles.append(m.register_forward_pre_hook(before_forward))
        handles.append(m.register_forward_hook(after_forward))
    for u, p in enumerate(params):
        if p.requires_grad:  # (a frozen one never gets a gradient)
            handles.append(p.register_post_accumulate_grad_hook(lambda p, u=u: out.events.append(("grad", u))))
    for name, kind in declared_plan(model, "context", cp=1, style="ring", tp=1).items():  # what CP would pass around

        def kv(m, args, result, name=name):
            nbytes = sum(a.numel() * a.element_size() for a in args[1:3]) / batch
            out.attention_kv_bytes_per_sample += nbytes
            out.attention_kv[name] = out.attention_kv.get(name, 0.0) + nbytes
            out.attention_q[name] = out.attention_q.get(name, 0.0) + args[0].numel() * args[0].element_size() / batch
            q, k = args[0], args[1]
            rows = q.numel() // q.shape[-1]  # (batch, heads, queries)
            scores = rows * k.shape[-2] * q.element_size()
            out.attention_scores[name] = out.attention_scores.get(name, 0.0) + \
                (scores - q.numel() * q.element_size() - rows * 4) / batch
            out.attention_flops[name] = out.attention_flops.get(name, 0.0) + 4 * rows * k.shape[-2] * q.shape[-1] / batch

        if kind == "context_attention":
            handles.append(model.get_submodule(name).register_forward_hook(kv))
            out.attention_causal = out.attention_causal and contract(model.get_submodule(name)).causal
    for style in TENSOR_STYLES:  # the model's own tensor plans, and what each module they name takes and gives
        for sp in (False, True):
            for tp in TRACED_TP:
                try:
                    plan = tp_plan_of(model, tp, style, sp)
                except ConfigError:
                    continue
                if tp > 1 and plan == out.tensor_plans.get((style, sp, 1)):
                    continue
                out.tensor_plans[(style, sp, tp)] = plan
                share = contract(model).kv_share(tp)
                if share is not None:
                    out.kv_share[tp] = share
                out.tensor_split[(style, sp, tp)] = {f"{name}.{leaf}" for name, kind in plan.items()
                                                     for leaf in TP_STYLES[kind].splits}
    for name in dict.fromkeys(n for plan in out.tensor_plans.values() for n in plan):

        def io(m, args, result, name=name):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            y = result if isinstance(result, torch.Tensor) else None
            numels = tuple(p.numel() for p in m.parameters())
            grads = tuple((n, p.numel()) for n, p in m.named_parameters() if p.requires_grad)
            out.module_io[name] = ModuleIO(grads=grads,
                input_bytes=x.numel() * out.element_size / batch if x is not None else 0.0,
                output_bytes=y.numel() * y.element_size() / batch if y is not None else 0.0,
                output_rows=y.numel() / y.shape[-1] / batch if y is not None and y.dim() else 0.0,
                input_grad=bool(x is not None and x.requires_grad), element_size=out.element_size, parameters=numels)

        handles.append(model.get_submodule(name).register_forward_hook(io))
    for name in declared_plan(model, "expert", ep=1):  # what expert parallel would shard and send

        def slots(m, args, result, name=name):
            nbytes = args[0].numel() * args[0].element_size() / batch
            out.expert_slot_bytes_per_sample += nbytes
            out.expert_slots[name] = out.expert_slots.get(name, 0.0) + nbytes

        out.expert_names += [f"{name}.{p}" for p, _ in model.get_submodule(name).named_parameters()]
        handles.append(model.get_submodule(name).register_forward_hook(slots))
    model.train()
    if contract(model).block_size:  # a language model: token ids in, the next tokens as targets
        x = torch.zeros((batch, *input_shape), dtype=torch.long, device="meta")
        y = torch.zeros((batch, *input_shape), dtype=torch.long, device="meta")
    else:
        x = torch.empty((batch, *input_shape), device="meta")
        y = torch.zeros(batch, dtype=torch.long, device="meta")
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with FlopCounterMode(display=False) as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task_loss(model(x), y)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    out.forward_flops_per_sample = fwd.get_total_flops() / batch
    out.flops_per_sample = (fwd.get_total_flops() + bwd.get_total_flops()) / batch
    out.activation_bytes_per_sample = sum(saved) / batch
    out.linear_shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    named = {id(m): n for n, m in model.named_modules()}
    out.batch_norms = [(named[id(m)], m.num_features, out.input_grad[index[id(m)]]) for m in modules
                       if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for h in handles:
        h.remove()
    regions = {name for (_, sp, _), plan in out.tensor_plans.items() if sp for name, kind in plan.items()
               if kind == "sequence"}  # the norms sequence parallel splits: replicated over TP without it
    out.layers = profile_layers(model, x, y, out, regions)
    for key, plan in out.tensor_plans.items():  # a layer whose output is still split (a column-parallel region open)
        open_, ends = False, set()
        for layer in out.layers:
            for name, kind in plan.items():
                if name == layer.name or name.startswith(layer.name + "."):
                    open_ = kind in ("colwise", "colwise_entered") or (open_ and kind not in (
                        "rowwise", "colwise_gather", "vocab_output"))
            if open_:
                ends.add(layer.name)
        out.tensor_open[key] = ends
    out.input_bytes_per_sample = x.numel() * x.element_size() / batch
    out.tokens_per_sample = int(x[0].numel()) if contract(model).block_size else 0
    per_token = contract(model).flops_per_token() if out.tokens_per_sample else None
    out.model_flops_per_sample = float(per_token) * out.tokens_per_sample if per_token else 0.0
    try:
        out.blocks = block_names(model)
    except ConfigError:  # nothing to checkpoint: a plan with `activation_checkpointing` is refused by the config
        out.blocks = []
    return out


def _base(model: nn.Module, params: list[nn.Parameter], base_dtype: str) -> list[str]:
    """Per unit, how ``base_dtype`` holds it: a trained one as it is, a frozen one in bf16, an adapted layer's
    weight (:class:`~distlab.parallel.protocols.LowRankAdapted`) in 4-bit under nf4."""
    from distlab.parallel.protocols import LowRankAdapted
    four_bit = {id(m.weight) for m in model.modules() if isinstance(m, LowRankAdapted)} if base_dtype == "nf4" \
        else set()
    return ["" if p.requires_grad else "nf4" if id(p) in four_bit else "bf16" for p in params]


def stage_trace(t: Trace, names: list[str]) -> Trace:
    """The part of ``t`` a pipeline stage holds: the parameters under the layers ``names``, and the
    events of their modules (ZeRO's bookkeeping over a stage)."""
    layers = set(names)
    mine = [u for u, unit in enumerate(t.names) if under(unit, layers, strict=True)]
    # a tied parameter's second name on this stage (the LM head, the embedding on the first): a copy of its unit
    mine += [t.names.index(first) for second, first in t.tied.items()
             if under(second, layers, strict=True) and t.names.index(first) not in mine]
    return units_trace(t, sorted(mine), [layer for layer in t.layers if layer.name in layers])


def units_trace(t: Trace, mine: list[int], layers: list[Layer] | None = None) -> Trace:
    """``t`` restricted to the parameter units ``mine`` (their modules, events and shapes): a pipeline
    stage's part, or what data parallel synchronises beside expert parallel's shards."""
    modules = sorted({t.module_of[u] for u in mine})
    unit_of, module_index = {u: i for i, u in enumerate(mine)}, {m: i for i, m in enumerate(modules)}
    events = [(kind, unit_of[k] if kind == "grad" else module_index[k]) for kind, k in t.events
              if (kind == "grad" and k in unit_of) or (kind != "grad" and k in module_index)]
    pick = (lambda flags: [flags[m] for m in modules] if flags else [])
    names = {t.names[u] for u in mine}
    return Trace([t.names[u] for u in mine], [t.numels[u] for u in mine], t.element_size,
                 [module_index[t.module_of[u]] for u in mine], events,
                 linear_shapes=t.linear_shapes, layers=t.layers if layers is None else layers,
                 sharded_linear=pick(t.sharded_linear), input_grad=pick(t.input_grad),
                 shapes=[t.shapes[u] for u in mine] if t.shapes else [],
                 expert_names=[n for n in t.expert_names if n in names],
                 trainable=[t.trainable[u] for u in mine] if t.trainable else [], blocks=t.blocks,
                 base=[t.base[u] for u in mine] if t.base else [],
                 splits={unit_of[u]: cut for u, cut in t.splits.items() if u in unit_of}, matrices=t.matrices)


def generic_trace(num_parameters: int, activation_bytes_per_sample: float, layers: int = 24,
                  element_size: int = 4) -> Trace:
    """A model known only by its size: ``layers`` equal blocks, each one square weight matrix (plus
    a bias of 1/1000 of it), run in order; FLOPs 2 per parameter per sample forward, 4 backward
    (dense layers); activations between blocks as wide as the square's side (for tensor parallel).
    For "what about a 7B-parameter model" questions; memory is exact for *this* layer structure."""
    if num_parameters < layers or layers < 1:
        raise ConfigError(f"--params {num_parameters} over --layers {layers}: need at least one parameter per layer")
    per = num_parameters // layers
    bias = max(1, per // 1000)
    weight = per - bias
    t = Trace([], [], element_size, [], flops_per_sample=6.0 * num_parameters,
              forward_flops_per_sample=2.0 * num_parameters, activation_bytes_per_sample=activation_bytes_per_sample)
    for i in range(layers):
        t.names += [f"{i}.weight", f"{i}.bias"]
        t.numels += [weight + (num_parameters - per * layers if i == layers - 1 else 0), bias]
        t.module_of += [i, i]
    width = max(1, math.isqrt(weight))  # each layer a square dense block, for tensor parallel's activations
    t.linear_shapes = [(width, width)] * layers
    t.layers = [Layer(str(i), t.numels[2 * i] + bias, 2.0 * (t.numels[2 * i] + bias),
                      activation_bytes_per_sample / layers, 0.0, width * element_size) for i in range(layers)]
    t.sharded_linear = [True] * layers  # dense layers: ZeRO-3 runs them as its sharded Linear
    t.blocks = [[str(i)] for i in range(layers)]  # each layer a block for activation checkpointing
    t.input_bytes_per_sample = width * element_size
    t.input_grad = [i > 0 for i in range(layers)]
    t.events = [(k, i) for i in range(layers) for k in ("fwd", "fwd_done")]
    for i in reversed(range(layers)):
        t.events += [("bwd", i), ("grad", 2 * i + 1), ("grad", 2 * i)]
    return t
