"""The Hugging Face layout of a family, as :mod:`distlab.models.hf` reads and writes a directory through it
(:class:`HFAdapter`): which architectures a family reads, its options from a ``config.json`` (refusing, in one
line, what would compute another model), the config it writes, and its tensors both ways -- renamed one to one
or converted as whole state dicts where the layouts differ. Each family's adapter lives beside its model
(``hf_llama``, ``hf_gpt2``, ``hf_mixtral``, ``hf_phi3``, ``hf_gemma3``); the families know nothing of
checkpoint formats, and a family of one's own joins with its adapter and
:func:`distlab.models.hf.register_adapter`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.errors import ConfigError


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` of a fused checkpoint tensor that are one of distlab's tensors (``mine``): Phi-3's
    ``qkv_proj`` holds q, k and v one after another, its ``gate_up_proj`` gate then up."""

    mine: str
    start: int
    stop: int
    transposed: bool = False  # rows of the checkpoint's tensor transposed (GPT-2's Conv1D (in, out) matrices)


class HFAdapter:
    """A family's Hugging Face layout. Override what is yours; the rest is the default:

    ``family``, ``architectures``       the distlab family it builds, the ``architectures`` it reads
    ``options_from(config, where)``     ``(option values, vocabulary)`` of a ``config.json`` (required)
    ``config_for(options, vocab, ctx)`` the ``config.json`` it writes (required)
    ``names(options)``                  their tensor names -> distlab's (None: read and dropped; a tuple of
                                        :class:`Rows`: a fused tensor, cut by rows); the default
                                        :meth:`to_mine` and :meth:`to_theirs` rename (and cut, or join) by it
    ``sliced``                          True: every tensor maps to one of distlab's whole or by rows, so a rank
                                        may read only its slices of each (False where tensors are transposed)
    ``to_mine(tensors, options, where)``  a checkpoint's tensors under distlab's names
    ``to_theirs(state, options)``       distlab's whole-model state under their names
    ``tied(options)``                   distlab's names a checkpoint leaves out, being another's (a tied head)
    """

    family = ""
    architectures: tuple[str, ...] = ()
    sliced = True

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        raise NotImplementedError(f"adapter {cls.__name__} does not read a config.json (options_from)")

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        raise NotImplementedError(f"adapter {cls.__name__} does not write a config.json (config_for)")

    @classmethod
    def names(cls, options) -> dict[str, str | None]:
        raise NotImplementedError(f"adapter {cls.__name__} does not name its tensors (names, or to_mine and to_theirs)")

    @classmethod
    def tied(cls, options) -> tuple[str, ...]:
        return (f"{options.n_layer + 1}.out.weight",) if options.tie_embeddings else ()

    @classmethod
    def to_mine(cls, tensors: dict, options, where: str) -> dict:
        names, state = cls.names(options), {}
        for key, tensor in tensors.items():
            mine = names.get(key)
            if mine is None and key in names:  # known, and another tensor's (a tied LM head)
                continue
            if mine is None:
                raise ConfigError(f"{where} holds {key}, which distlab's {cls.family} has no place for")
            if isinstance(mine, tuple):  # a fused tensor: each of its row ranges one of distlab's
                if tensor.shape[0] != mine[-1].stop:
                    raise ConfigError(f"{where}: {key} has {tensor.shape[0]} rows; its config's make {mine[-1].stop}")
                state |= {r.mine: tensor[r.start:r.stop] for r in mine}
            else:
                state[mine] = tensor
        return state

    @classmethod
    def to_theirs(cls, state: dict, options) -> dict:
        out, used = {}, set()
        for hf_name, mine in cls.names(options).items():
            if isinstance(mine, tuple) and all(r.mine in state for r in mine):
                out[hf_name] = torch.cat([state[r.mine] for r in mine])
                used |= {r.mine for r in mine}
            elif isinstance(mine, str) and mine in state:
                out[hf_name] = state[mine]
                used.add(mine)
        unknown = sorted(set(state) - used)
        if unknown:
            raise ConfigError(f"{unknown[0]} has no place in the Hugging Face layout of {cls.family}")
        return out
