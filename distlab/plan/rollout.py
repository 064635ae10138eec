"""What a GRPO step's rollout costs, beside the update :func:`~distlab.plan.predict.predict` prices as training.

A rollout runs as :mod:`distlab.train.rollout` runs it: every rank gathers the whole policy from its layout (one
all-gather of the parameters over the dimensions that split them) into a float32 generation copy -- and, with a KL
penalty and no adapters, a second copy of the starting weights, the reference -- then its replica's prompts, one
after another: the prompt prefilled once (its cache shared by the ``G`` rows), then ``max_new_tokens - 1`` decoding
steps of ``G`` rows with the key/value cache; then the rows are scored once more (old log-probabilities for
``--ppo-epochs`` above 1, the reference's for ``--kl-beta``). The ranks of one replica (tensor, pipeline, context
parallel) all do the whole replica's rollout: a model-parallel layout does not split it.

**Counted** (:func:`price`, on any machine): the decoding steps, the bytes each reads -- the copy's weights, then the
cache so far -- the FLOPs of prefill, decoding and scoring, the gather's bytes and what the rollout holds beside the
model state. Every completion is taken to run ``max_new_tokens`` (an upper bound: a stop ends one sooner) after a
prompt filling the rest of the window.

**Timed** on a GPU cluster (``--machine``): decoding memory-bound, each step the larger of its bytes through HBM at
the datasheet's bandwidth and its FLOPs at float32's peak x the measured efficiency (a roofline: an eager loop's
kernel launches, about a layer's handful per token, are not counted); prefill and scoring at that rate; the gather
as NCCL's all-gather over its placed group. Against the update's step time it says which part dominates.
"""

from __future__ import annotations

from distlab.plan.gpu import Group, collective_seconds, placement

FP32 = 4  # the generation copy's bytes per element


def split_dims(lay) -> tuple[str, ...]:
    """The mesh dimensions that split the parameters, over which the rollout gathers them."""
    dims = [d for d, n in (("tp", lay.tp), ("ep", lay.ep), ("pp", lay.pp)) if n > 1]
    if lay.zero == 3:
        dims += [d for d, n in (("cp", lay.cp), ("dp", lay.dp)) if n > 1]
    return tuple(dims)


def price(t, lay) -> dict:
    """The rollout of one step on each rank (module docstring): counts, bytes and FLOPs, no times."""
    window = t.tokens_per_sample or 1
    new = min(lay.max_new_tokens or window // 2, window)
    prompt = window - new
    g, prompts = lay.group, lay.global_batch // lay.dp
    kv_token = t.attention_kv_bytes_per_sample / window / t.element_size * FP32  # one token's keys and values, fp32
    fwd_token = t.forward_flops_per_sample / window
    weights = t.num_parameters * FP32
    copies = 1 + (lay.kl_beta > 0 and not t.trainable)  # the reference a second copy, unless it is the base
    steps = max(new - 1, 0)
    kv_read = g * kv_token * (steps * prompt + steps * (steps + 1) / 2)  # the cache so far, every decoding step
    passes = (lay.ppo_epochs > 1) + (lay.kl_beta > 0)
    return {"group_size": g, "rows_per_step": lay.global_batch * g, "prompts_per_rank": prompts,
            "prompt_tokens": prompt, "max_new_tokens": new, "decode_steps_per_rank": prompts * steps,
            "generated_tokens_per_rank": prompts * g * new,
            "decode_bytes_per_rank": int(prompts * (steps * weights + kv_read)),
            "prefill_flops_per_rank": prompts * prompt * fwd_token,
            "decode_flops_per_rank": prompts * g * steps * fwd_token,
            "scoring_flops_per_rank": passes * prompts * g * window * fwd_token, "scoring_passes": passes,
            "gather_bytes": t.num_parameters * t.element_size, "gather_dims": list(split_dims(lay)),
            "memory_bytes_per_rank": int(copies * weights + g * window * kv_token),
            "memory_basis": f"{copies} float32 cop{'ies' if copies > 1 else 'y'} of the whole model"
                            + (" (the policy and the starting weights, the KL's reference)" if copies > 1 else "")
                            + f" and the key/value cache of {g} rows of {window} tokens, beside the model state",
            "basis": f"{prompts} prompt(s) a rank, each {g} completions of {new} tokens after a {prompt}-token "
                     f"prompt (an upper bound: every completion runs to the budget); the ranks of a replica each "
                     f"generate all of its prompts"}


def timed(p: dict, t, lay, cluster, update_s: float) -> dict:
    """``p`` (:func:`price`) timed on ``cluster`` (module docstring), and which of rollout and update dominates."""
    m = cluster.machine
    rate = m.peak("fp32") * cluster.efficiency / cluster.flop_factor(t)
    steps = p["decode_steps_per_rank"]
    decode = max(p["decode_bytes_per_rank"] / (m.memory_tbps * 1e12), p["decode_flops_per_rank"] / rate)
    group = placement(lay, m.gpus_per_node, tuple(p["gather_dims"])) if p["gather_dims"] else Group(1, 1)
    parts = {"gather_s": collective_seconds(m, "all_gather", p["gather_bytes"], group),
             "prefill_s": p["prefill_flops_per_rank"] / rate, "decode_s": decode,
             "scoring_s": p["scoring_flops_per_rank"] / rate}
    seconds = sum(parts.values())
    out = {**parts, "seconds": seconds, "update_s": update_s, "step_s": seconds + update_s,
           "share": seconds / (seconds + update_s) if seconds + update_s else None,
           "dominates": "rollout" if seconds >= update_s else "update",
           "generated_tokens_per_s_per_gpu": p["generated_tokens_per_rank"] / seconds if seconds else None,
           "decode_step_s": decode / steps if steps else 0.0,
           "time_basis": f"decoding memory-bound: each step the weights "
                         f"({p['decode_bytes_per_rank'] / max(steps, 1) / 1e9:.3g} GB with the cache) through HBM at {m.memory_tbps:g} TB/s, or its FLOPs at float32's "
                         f"{m.peak('fp32') / 1e12:g} TFLOP/s x {cluster.efficiency:.1%} where slower; kernel launches "
                         f"not counted"}
    why = max(parts, key=parts.get).removesuffix("_s")
    out["why"] = (f"the rollout dominates: {seconds:.3g} s against the update's {update_s:.3g} s, most of it {why}"
                  if seconds >= update_s else
                  f"the update dominates: {update_s:.3g} s against the rollout's {seconds:.3g} s (most of it {why})")
    return out
