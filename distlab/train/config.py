"""Training configuration: one dataclass, validated once, with the numbers in the messages.

The layout lives in one :class:`~distlab.parallel.Strategy` field; everything else (model, data,
optimizer, schedule, snapshots, outputs) is a plain field here. Messages name fields in
backquotes (`global_batch_size`): the command line shows them as its flags. The model family's own
settings are its options object (:mod:`distlab.models.spec`), checked by the family; the settings
file, ``--config``, is :mod:`distlab.train.config_file`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from distlab.data import canonical_name, dataset_shape, is_text, load_dataset
from distlab.data.tokenizer import vocab_size as tokenizer_vocab
from distlab.errors import ConfigError
from distlab.models import (check_model_name, is_text_model, is_user_model, option_owners, options_from,
                            parse_model_args, spec)
from distlab.models.lora import LoRASpec, apply as apply_lora
from distlab.models.spec import Options
from distlab.parallel import Strategy
from distlab.parallel.offload import check_offload
from distlab.parallel.step_ahead import check_overlap
from distlab.train import pretrained as init_checks
from distlab.train.fine_tuning import check_fine_tuning, spec_of_source as lora_from_spec
from distlab.train.durations import parse_duration  # noqa: F401 - where the settings readers take it from
from distlab.train.model_fit import check_fit

OPTIMIZERS = ("sgd", "adam", "adamw", "muon")  # muon: distlab.train.muon (AdamW beside it)
LR_SCHEDULES = ("constant", "cosine", "linear")
LR_SCALINGS = ("none", "linear", "sqrt")
@dataclass
class TrainConfig:
    model: str = "mlp"      # a registered name, or your own: path/to/file.py:build, package.module:build
    model_args: tuple[str, ...] = ()  # your model's builder arguments, key=value
    options: Options | None = None  # the model family's (distlab.models.spec): None is its defaults
    block_size: int = 64    # text: tokens per sample (context length)
    dataset: str = "fashion-mnist"
    tokenizer: str = "bytes"  # text: bytes, or bpe:N learned from the training split (distlab.data.tokenizer)
    vocab_size: int | None = None  # text: the model's vocabulary (a bare corpus's; else at least the data's)
    data_dir: str | None = None
    data_on_device: str = "auto"  # auto | on | off: the data set in GPU memory (distlab.data.resident)
    epochs: int | None = None  # None: one epoch, or as many as `max_steps` takes when that is given
    max_steps: int | None = None
    global_batch_size: int = 64
    lr: float = 0.05
    optimizer: str = "sgd"
    optimizer_state: str = "fp32"  # adam/adamw: the moments' dtype (bf16: low_precision_optim.Adam16)
    offload: str = "none"  # optimizer | params: the optimizer's state (and ZeRO-3's shards) off the device
    offload_dir: str | None = None  # where offloaded state goes: a file a rank (parallel.offload; on a CPU, needed)
    offload_overlap: bool = False  # the offloaded step on a thread, overlapped with the next forward (step_ahead)
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None  # scale each step's gradients to this global norm at most (None: never)
    lr_schedule: str = "cosine"
    seed: int = 0
    log_every: int = 20
    eval_batch_size: int | None = None  # per rank (None: a language model's micro-batch, else 1000 samples)
    eval_every_epoch: bool = True
    eval_every: int | None = None  # evaluate every N steps (and at the end) instead of every epoch
    eval_batches: int | None = None  # evaluate on the first N x eval_batch_size samples only (None: all of them)
    peak_tflops: float | None = None  # per device, for MFU (None: a GPU's data-sheet peak; none on a CPU)
    label_smoothing: float = 0.0  # the training loss's, as F.cross_entropy's (evaluations report plain cross-entropy)
    sample_every: int | None = None  # gpt: print (and log in metrics.jsonl) a short generated text every N steps
    strategy: Strategy = field(default_factory=Strategy)
    lr_scaling: str = "none"
    base_batch_size: int | None = None
    warmup_steps: int = 0
    val_fraction: float = 0.0
    snapshot_dir: str | None = None
    snapshot_every: int | None = None
    snapshot_async: bool = False  # copy the state to host memory at the step, write it in the background
    keep_snapshots: int = 3
    resume: str | None = None  # "auto" or a snapshot directory
    init_from: str | None = None  # a whole-model state_dict file to start from (a resumed snapshot wins)
    lora: LoRASpec | None = None  # low-rank adapters, the rest frozen (given as "r=16,alpha=32,targets=q,k,v,o")
    lora_from: str | None = None  # peft:DIR: start the adapters at PEFT's (for the init_from hf:DIR base)
    base_dtype: str = "float32"  # with lora: the frozen base held (and gathered) in bf16
    pack: bool = False  # sft: records packed into windows, each attending to itself only
    chat_turns: str = "all"  # sft chats: which assistant replies are targets (all, last)
    dpo_beta: float | None = None  # dpo: DPO's beta (None: 0.1), how far the trained model may stray from its start
    reward: str | None = None  # rl: the rewards a completion earns, comma-separated (None: exact; train.rewards)
    reward_weights: str | None = None  # rl: one weight per reward (None: 1 each)
    group_size: int = 4  # rl: completions sampled per prompt (GRPO's G; distlab.train.grpo)
    max_new_tokens: int | None = None  # rl: a completion's longest (None: to the window's end)
    temperature: float = 1.0  # rl: sampling's
    top_p: float = 1.0  # rl: sampling's nucleus
    ppo_epochs: int = 1  # rl: optimizer steps each rollout batch trains
    kl_beta: float = 0.0  # rl: the KL penalty's weight (0: no reference scored)
    clip_epsilon: float = 0.2  # rl: the importance ratio clipped to [1 - eps, 1 + eps_high]
    clip_epsilon_high: float | None = None  # rl: None: clip_epsilon (DAPO's clip-higher: larger)
    grpo_loss: str = "grpo"  # rl: the loss normalisation: grpo, dapo or dr_grpo
    scale_rewards: bool = True  # rl: advantages divided by the group's std
    time_budget_s: float | None = None
    out: str | None = None
    tensorboard: str | None = None  # also write TensorBoard event files here (distlab.train.tensorboard)
    trace: str | None = None  # "A:B": every rank's timeline of optimizer steps A to B into OUT/trace.json
    profile: str | None = None  # "A:B": torch.profiler over optimizer steps A to B, OUT/profile/rank-N.json
    progress: bool | None = None  # None: on when stderr is a terminal
    verbose: bool = True  # rank 0 prints a line per log step and evaluation
    timing_warmup_steps: int = 5

    def __post_init__(self) -> None:
        self.lora = LoRASpec.of(self.lora)  # the spec parsed once, here: the rest of distlab reads it typed
        if self.options is None and not is_user_model(self.model):
            try:
                self.options = spec(self.model).options()
            except ConfigError:
                pass  # an unknown name: validate() says so

    @classmethod
    def from_flags(cls, **values) -> "TrainConfig":
        """A config from one flat mapping of field names: the strategy's fields (``dp_sync``, ``zero``,
        ``tp`` ...) go into :attr:`strategy`, the model family's options (``n_layer``, ``mlp_widths`` ...)
        into :attr:`options` (None: the family's default), the rest are this class's own. Unknown names,
        and options the model does not take, are refused."""
        own = {f.name for f in fields(cls)}
        theirs = {f.name for f in fields(Strategy)}
        owners = option_owners()
        unknown = set(values) - own - theirs - set(owners)
        if unknown:
            raise ConfigError(f"unknown training setting(s): {', '.join(sorted(unknown))}")
        changes = {k: values.pop(k) for k in list(values) if k in theirs}
        given = {k: values.pop(k) for k in list(values) if k in owners}
        given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
        base = values.pop("strategy", None)
        strategy = base.replace(**changes) if base is not None else Strategy(**changes)
        model = values.get("model", cls.model)
        if given and str(values.get("init_from") or "").startswith("hf:"):
            from distlab.models import hf
            named = values.get("model") not in (None, cls.model)  # the default model is no model named
            model = values["model"] = hf.check_flags(values["init_from"][3:], model if named else None, given)
        if given and not values.get("options"):
            values["options"] = options_from(model, given)
        return cls(strategy=strategy, **values)

    def total_steps(self, steps_per_epoch: int) -> int:
        """How many optimizer steps the run takes: ``epochs`` epochs, cut at ``max_steps``; without
        ``epochs``, ``max_steps`` alone (as many epochs as that takes), else one epoch."""
        if self.epochs is None:
            return self.max_steps or steps_per_epoch
        total = self.epochs * steps_per_epoch
        return min(total, self.max_steps) if self.max_steps else total

    def trace_steps(self, field: str = "trace") -> tuple[int, int]:
        """``trace`` (or ``profile``) "A:B" as (A, B): the first and last optimizer step it covers
        (1-based, inclusive)."""
        text = str(getattr(self, field))
        first, colon, last = text.partition(":")
        try:
            a, b = int(first), int(last if colon else first)
        except ValueError:
            raise ConfigError(f"`{field}` {text!r}: give the optimizer steps as A:B (e.g. 10:12)") from None
        if not 1 <= a <= b:
            raise ConfigError(f"`{field}` {text!r}: steps count from 1 and A:B needs A <= B (e.g. 10:12)")
        if not self.out:
            where = "OUT/trace.json" if field == "trace" else "OUT/profile/"
            raise ConfigError(f"`{field}` writes {where}: give `out` (the run's directory)")
        target = Path(self.out) / ("trace.json" if field == "trace" else "profile")
        if target.exists() and target.is_dir() == (field == "trace"):  # found only after training, otherwise
            raise ConfigError(f"`{field}` writes {target}, which is a {'directory' if field == 'trace' else 'file'}: "
                              f"move it, or give another `out`")
        return a, b

    def validate(self, world_size: int) -> "TrainConfig":
        """Check every field against the others and the world size; raise ConfigError naming numbers."""
        for owner in (self, self.strategy, *([self.options] if self.options is not None else [])):
            for f in fields(owner):  # nan and inf pass every comparison below: refuse them first
                value = getattr(owner, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConfigError(f"`{f.name}` must be a finite number, not {value}")
        check_model_name(self.model)
        self.dataset = canonical_name(self.dataset)
        tokenizer_vocab(self.tokenizer)  # a tokenizer spec it cannot read is refused here
        if self.tokenizer != "bytes" and not is_text(self.dataset):
            raise ConfigError(f"`tokenizer` {self.tokenizer} is for text; dataset {self.dataset} is images "
                              f"(drop `tokenizer`)")
        if self.tokenizer != "bytes" and self.dataset.startswith("tokens:"):
            raise ConfigError(f"{self.dataset} was tokenized when it was prepared (its manifest names the tokenizer): "
                              f"drop `tokenizer`")
        pretrained = self.tokenizer.startswith("hf:")
        if pretrained and not self.dataset.startswith(("sft:", "dpo:", "rl:")):
            raise ConfigError(f"`tokenizer` {self.tokenizer} reads fine-tuning records (sft: or dpo:FILE.jsonl); tokenize a "
                              f"corpus once with `distlab prepare-text SRC OUT --tokenizer {self.tokenizer}` and train on "
                              f"tokens:OUT")
        if self.dataset.startswith(("sft:", "dpo:", "rl:")) and self.tokenizer != "bytes" and not pretrained:
            raise ConfigError(f"{self.dataset}: fine-tuning records are read with bytes or a pretrained model's "
                              f"tokenizer (hf:DIR), not {self.tokenizer}")
        if self.tokenizer != "bytes" and self.dataset.startswith("synthetic-text"):
            raise ConfigError(f"{self.dataset} is random bytes, not text a tokenizer can learn from: keep `tokenizer` "
                              f"bytes")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("optimizer_state", self.optimizer_state, ("fp32", "bf16"))
        if self.optimizer_state != "fp32" and self.optimizer == "sgd":
            raise ConfigError(f"`optimizer_state` {self.optimizer_state} holds Adam's moments in it; sgd keeps "
                              f"{'a momentum buffer' if self.momentum else 'no state'}: use --optimizer adamw or drop "
                              f"--optimizer-state")
        check_offload(self.offload, self.offload_dir, self.strategy.zero, None)  # (the device's part: at launch)
        check_overlap(self.offload_overlap, self.offload, self.strategy, self.optimizer)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        _choice("data_on_device", self.data_on_device, ("auto", "on", "off"))
        if self.global_batch_size < 1:
            raise ConfigError(f"`global_batch_size` must be positive, not {self.global_batch_size}")
        self.strategy.check(world_size)
        self.strategy.check_batch(self.global_batch_size, world_size)
        for name in ("log_every", "keep_snapshots"):
            _at_least(name, getattr(self, name), 1)
        for name in ("eval_batch_size", "epochs", "max_steps", "snapshot_every", "base_batch_size", "sample_every", "eval_every", "eval_batches"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("timing_warmup_steps", self.timing_warmup_steps, 0)
        if not self.lr > 0:
            raise ConfigError(f"`lr` must be positive, not {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"`momentum` must be in [0, 1), not {self.momentum} (0.9 is usual; 0 turns it off)")
        if not self.weight_decay >= 0:
            raise ConfigError(f"`weight_decay` must be at least 0, not {self.weight_decay}")
        lr = self.effective_lr if self.lr_scaling == "none" or self.base_batch_size else self.lr
        for name, value in (("lr", lr), ("weight_decay", self.weight_decay)):
            if not value <= FLOAT32_MAX:  # the optimizer scales float32 tensors by it
                raise ConfigError(f"`{name}` {value:g}{' (after lr_scaling)' if value != getattr(self, name) else ''} "
                                  f"is beyond float32's range ({FLOAT32_MAX:.3g}): the optimizer multiplies float32 "
                                  f"tensors by it ({'0.05' if name == 'lr' else '0 to 0.1'} is usual)")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"`clip_grad_norm` must be positive, not {self.clip_grad_norm:g} (leave it out not to "
                              f"clip; 1.0 is usual for transformers)")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"`peak_tflops` must be positive, not {self.peak_tflops:g} (a device's dense peak, "
                              f"e.g. 989 for an H100's bf16)")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"`label_smoothing` must be in [0, 1), not {self.label_smoothing:g} (0.1 is usual; 0 "
                              f"turns it off)")
        if self.lr_scaling != "none" and not self.base_batch_size:
            raise ConfigError(f"`lr_scaling` {self.lr_scaling} scales `lr` from the batch size it was tuned for: "
                              f"give that as `base_batch_size` (e.g. {self.global_batch_size})")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"`val_fraction` must be in [0, 1), not {self.val_fraction}")
        if self.snapshot_every and not self.snapshot_dir:
            raise ConfigError("`snapshot_every` needs `snapshot_dir` (where to write the snapshots)")
        if self.trace is not None:
            self.trace_steps()
        if self.profile is not None:
            self.trace_steps("profile")
        if self.snapshot_async and not self.snapshot_dir:
            raise ConfigError("`snapshot_async` writes snapshots in the background: give `snapshot_dir` (where)")
        if self.tensorboard is not None:
            if not str(self.tensorboard).strip():
                raise ConfigError("`tensorboard` is empty: give the directory for TensorBoard's event files")
            from distlab.train.tensorboard import check_available
            check_available()
        if self.resume == "auto" and not self.snapshot_dir:
            raise ConfigError("`resume` auto picks the newest snapshot in `snapshot_dir`: give `snapshot_dir`")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"`time_budget` must be positive, not {self.time_budget_s:g}s")
        _at_least("block_size", self.block_size, 1)
        self._check_options()
        init_checks.check(self)
        context = self.options.to_dict().get("context") if self.options is not None else None
        if context and self.block_size > context:
            raise ConfigError(f"`block_size` {self.block_size} is longer than the model's `context` {context}: "
                              f"train on windows of at most {context} tokens, or give the model a longer context")
        if self.vocab_size is not None:
            self._check_vocab_size()
        if self.sample_every and not is_text(self.dataset):
            raise ConfigError(f"`sample_every` prints text a language model generates; model {self.model} on "
                              f"{self.dataset} does not generate text (drop `sample_every`)")
        parse_model_args(self.model_args)
        if self.model_args and not is_user_model(self.model):
            raise ConfigError(f"`model_args` are for your own model's builder (--model file.py:build); model "
                              f"{self.model} takes its own flags")
        if self.lora_from is not None:
            self.lora = lora_from_spec(self)
        if self.lora is not None:
            self._meta_model()  # the spec parsed, its targets naming layers of the model
        check_fine_tuning(self)
        self._check_components()
        if is_user_model(self.model):
            check_fit(self, self._meta_model())
        if self.strategy.activation_checkpointing:
            from distlab.parallel.checkpointing import checkpoint_blocks
            checkpoint_blocks(self._meta_model())
        if self.strategy.pp > 1:
            self._check_pipeline()
        if self.strategy.sync_bn != "off":
            self._check_batch_norm()
        text_model, text_data = is_text_model(self.model), is_text(self.dataset)
        if text_model != text_data and not is_user_model(self.model):
            raise ConfigError(f"model {self.model} {'predicts tokens' if text_model else 'classifies images'} but "
                              f"dataset {self.dataset} is {'text' if text_data else 'images'}: use "
                              + ("--model gpt" if text_data else "a text dataset (fortunes, synthetic-text, text:PATH)"))
        return self

    def _meta_model(self):
        """This config's model built on the meta device (no memory, no arithmetic)."""
        from distlab.models import build_model
        from distlab.runtime.meta import on_meta_device
        shape, classes = self.data_shape()
        with on_meta_device():
            net = build_model(self.model, shape, self.vocab(classes), **self.model_options())
        if self.lora is not None:  # the model as the run trains it: adapters on its target layers
            apply_lora(net, self.lora)
        return net

    def _check_components(self) -> None:
        """Every model-sharding component the strategy turns on checks the model (built on the meta
        device) and the data's sample shape: the model declares a plan for the layout, and its own limits
        hold -- heads, widths, the vocabulary, experts, a context: the model's declaration says which."""
        from distlab.parallel import components
        wanted = components.wanted(self.strategy)
        if not wanted:
            return
        net = self._meta_model()
        shape, _ = self.data_shape()
        for kind in wanted:
            kind.check(net, self.strategy, shape)

    def _check_vocab_size(self) -> None:
        """`vocab_size`: a text data set's, at least its tokenizer's; not beside a checkpoint's own."""
        from distlab.data import tokens
        if not is_text(self.dataset):
            raise ConfigError(f"`vocab_size` is a language model's vocabulary; {self.dataset} is images (drop it)")
        if self.init_from and self.init_from.startswith("hf:"):
            raise ConfigError(f"`vocab_size` is {self.init_from}'s own (its config.json): drop `vocab_size`")
        _at_least("vocab_size", self.vocab_size, 1)
        data_vocab = self.data_shape()[1]
        if data_vocab > self.vocab_size:
            raise ConfigError(f"`vocab_size` {self.vocab_size:,} is smaller than {self.dataset}'s vocabulary of "
                              f"{data_vocab:,} tokens: give at least {data_vocab:,} (or drop it)")
        if self.sample_every and self.dataset.startswith(tokens.PREFIX) and tokens.is_bare(self.dataset):
            raise ConfigError(f"`sample_every` prints generated text, and {self.dataset} is token ids without their "
                              f"tokenizer: drop `sample_every` (or prepare the text with distlab prepare-text)")

    def _check_options(self) -> None:
        """The options are the model family's and within its limits; your own model takes `model_args`."""
        if is_user_model(self.model):
            if self.options is not None:
                raise ConfigError(f"model {self.model} is your own builder: give its arguments as `model_args` "
                                  f"key=value, not a family's options")
            return
        family = spec(self.model)
        if type(self.options) is not family.options:
            raise ConfigError(f"model {self.model} takes {family.options.__name__}, not "
                              f"{type(self.options).__name__}")
        self.options.check()

    def pretrained(self) -> tuple[str, object, int, int] | None:
        """``--init-from hf:DIR``'s family, options, vocabulary and positions (:func:`distlab.train.pretrained.found`)."""
        return init_checks.found(self)

    def kept(self) -> dict | None:
        """What a resumed snapshot kept of a gone ``init_from`` hf:DIR (:func:`distlab.train.pretrained.kept`)."""
        return init_checks.kept(self)

    def weights_from(self) -> str | None:
        """Where the starting weights are read (:func:`distlab.train.pretrained.weights_from`)."""
        return init_checks.weights_from(self)

    def vocab(self, data_classes: int) -> int:
        """The classes (a text model's vocabulary) the model is built with: a pretrained checkpoint's, else
        `vocab_size`'s, else the data's."""
        found = self.pretrained()
        return found[2] if found else self.vocab_size or data_classes

    def _check_pipeline(self) -> None:
        """The model must cut into `pp` stages, each with parameters (cut on a model built without memory)."""
        from distlab.parallel.pipeline import partition
        net = self._meta_model()
        s = self.strategy
        try:
            partition(net, s.pp * s.pp_virtual, s.pp_balance)
        except ConfigError as exc:
            if s.pp_virtual == 1:
                raise ConfigError(f"model {self.model}: {exc}") from None
            reason = str(exc).split(": ", 1)[-1].replace(" stages", " chunks")
            raise ConfigError(f"model {self.model}: `pp` {s.pp} x `pp_virtual` {s.pp_virtual} = {s.pp * s.pp_virtual} "
                              f"chunks, each of at least one layer: {reason}; lower `pp_virtual`") from None

    def _check_batch_norm(self) -> None:
        """`sync_bn` needs BatchNorm layers to synchronise (the model built without memory)."""
        from torch import nn
        net = self._meta_model()
        if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules()):
            raise ConfigError(f"`sync_bn` {self.strategy.sync_bn}: model {self.model} has no BatchNorm layer, so there "
                              f"is nothing to synchronise; drop `sync_bn` (or train a model with BatchNorm, e.g. "
                              f"small-cnn-bn, mlp-bn, resnet18)")

    def model_options(self) -> dict:
        """The keyword arguments of :func:`distlab.models.build_model` for this config's model."""
        return {"options": self.options, "model_args": self.model_args}

    def load(self, split: str):
        """This config's dataset, ``split`` "train" or "test"."""
        return load_dataset(self.dataset, split, self.data_dir, seed=self.seed, block_size=self.block_size,
                            tokenizer=self.tokenizer, vocab_size=self.vocab_size, pack=self.pack,
                            chat_turns=self.chat_turns)

    def data_shape(self) -> tuple[tuple[int, ...], int]:
        """``(sample shape, classes)`` of this config's dataset, without reading it."""
        return dataset_shape(self.dataset, self.block_size, self.tokenizer, self.vocab_size)

    def lr_factor(self) -> float:
        """``lr_scaling``: the multiplier of ``lr`` for this global batch (1 with ``none``)."""
        if self.lr_scaling == "none":
            return 1.0
        ratio = self.global_batch_size / self.base_batch_size
        return ratio if self.lr_scaling == "linear" else ratio ** 0.5

    @property
    def effective_lr(self) -> float:
        return self.lr * self.lr_factor()

    def to_dict(self) -> dict:
        """Every field by name, flat: the options' fields beside the others (as the flags are), the
        strategy as its own dict."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("strategy", "options")}
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        d["lora"] = self.lora.text() if self.lora is not None else None
        if self.options is not None:
            d |= self.options.to_dict()
        d["strategy"] = self.strategy.to_dict()
        return d


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max

def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown `{name}` {value!r}; choose one of: {', '.join(allowed)}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"`{name}` must be at least {low}, not {value}")

