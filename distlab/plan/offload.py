"""What ``--offload`` holds off the device and moves each step (:mod:`distlab.parallel.offload`), priced.

Held, per rank: the optimizer's state tensors of the parameters it steps (its shards under ZeRO) -- exactly the
bytes they would have held on the device; with ``params``, ZeRO-3's shards and their reduced gradients too (an
expert shard, held whole, stays). Moved, per step: each state tensor read and written once by its step (``2 x``);
with ``params`` each shard read at every gather (forward and backward of each micro-batch, a recomputed block's
forward once more) and read and written by its step, each gradient shard written once and read once. On a GPU cluster those bytes cross the host link (PCIe, the machine file's ``[host] pcie_gbps`` each
way) and nothing hides them -- the step waits (the optimizer's host arithmetic is left unpriced; the link is its
floor) -- but, with ``--offload-overlap``, what the next step's first forward hides. On the calibrated CPU host they go through the page cache to the file: counted, not timed.
"""

from __future__ import annotations

import dataclasses


def held(t_rank, lay, sync, optim, parts_of) -> dict:
    """``offload`` block of a plan: the bytes held off the device per rank, those moved per step, and the basis.
    ``parts_of(optim)``: the rank's textbook state split with that optimizer
    (:func:`~distlab.plan.predict.state_parts`)."""
    on_device = parts_of(optim)
    whole = parts_of(dataclasses.replace(optim, offload="none", matrix=optim.matrix and dataclasses.replace(
        optim.matrix, offload="none")))
    state = whole["optimizer_bytes_per_rank"] - on_device["optimizer_bytes_per_rank"]
    shards = grads = 0
    if lay.offload == "params":  # ZeRO-3's shards of the dense units and their gradients (experts stay whole)
        experts = set(t_rank.expert_names) if lay.ep > 1 else set()
        dense = [u for u, name in enumerate(t_rank.names) if name not in experts]
        shards = sum(-(-k // lay.zero_shard) * b for u in dense for k, b in t_rank.tensors(u))
        grads = sum(-(-t_rank.numels[u] // lay.zero_shard) * t_rank.element_size for u in dense if t_rank.trains(u))
    st = lay.strategy
    gathers = st.micro_steps * (2 + bool(st.activation_checkpointing))
    moved = 2 * state + (gathers + 2) * shards + 2 * grads
    return {"mode": lay.offload, "bytes_per_rank": int(state + shards + grads), "state_bytes_per_rank": int(state),
            "shard_bytes_per_rank": int(shards), "gradient_bytes_per_rank": int(grads),
            "moved_bytes_per_step": int(moved),
            "basis": "the optimizer's state tensors" + (" and ZeRO-3's parameter and gradient shards" if shards else "")
                     + " held off the device; moved: the state read and written by each step"
                     + (f", each shard read at its {gathers} gathers and by the step, each gradient shard written "
                        f"once and read by the step" if shards else "")}


def timed(out: dict, t, lay, cluster) -> None:
    """A GPU cluster's step with the offloaded bytes over the host link added: all of them, or with
    ``offload_overlap`` what the next step's first forward (its first micro-batch, which reads every parameter)
    does not hide."""
    off = out["offload"]
    seconds = off["moved_bytes_per_step"] / cluster.machine.host_Bps
    hidden = min(seconds, out["first_forward_s"]) if lay.offload_overlap else 0.0
    off.update(host_link_Bps=cluster.machine.host_Bps, seconds_per_step=seconds, hidden_s=hidden)
    step = out["step_s"] + seconds - hidden
    out.update(step_s=step, exposed_comm_s=out["exposed_comm_s"] + seconds - hidden,
               samples_per_s=lay.global_batch / step, scaling_efficiency=out["compute_s"] / step, **cluster.rates(t, lay, step))
