"""The Llama family (distlab.models.llama): rotary positions, grouped-query attention, SwiGLU -- equal to
one process on every layout verify's default set gives it, its pieces checked against their definitions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from distlab.errors import ConfigError
from distlab.models import build_model, options_from
from distlab.models.decoder import RotaryTable, rotate
from distlab.parallel.context_parallel import ContextLayout
from distlab.parallel.ring_attention import RingAttentionFunction
from distlab.tools.verify import default_strategies, parse_strategy, verify


def test_llama_trains_every_layout_as_one_process():
    """Data parallel, ZeRO-3 recomputing, TP+SP, the ring and all-to-all over grouped heads (each rank's
    rotary positions offset: without the offset the ring case is off by ~1e-5 against a 4e-6 bound),
    a pipeline, SwiGLU experts shared out by expert parallel, and key/value heads that tensor parallel
    does not divide kept whole on every rank (one head for 2 ranks; 3 heads read by 2 x 3 query heads, one
    copy per query head: without the gradients summed over the group both miss by ~1e-3), the first with
    its LM head tied to the token embedding (untied by the split, it misses by ~1e-2), and a tied head
    on a pipeline's last stage and under ZeRO-3 with accumulation -- verify's float32 bound, on 2 ranks."""
    cases = [c for c in default_strategies(2) if c.model in ("llama", "llama-moe") and not c.lora
             and not c.dpo and not c.pack]
    assert len(cases) == 9
    cases.append(parse_strategy("allreduce+tp=2+llama+n_embd=24+n_head=6+kv_heads=3"))
    records = verify(cases, 2, steps=3, timeout=600)
    failed = [(r["strategy"], r["max_abs_param_diff"], r["tolerance"]) for r in records if not r["passed"]]
    assert not failed, failed


def test_rotary_scores_depend_on_the_relative_position_only():
    """q at position m against k at n scores the same as at m + s, n + s (float64: equal to rounding), and
    pairs dimension i with i + D/2 (Hugging Face's rotate-half layout): a rotation of each pair by
    position x theta^(-2i/D)."""
    torch.manual_seed(0)
    d, theta = 8, 10000.0
    table = RotaryTable(d, theta)
    q, k = torch.randn(1, 1, 1, d, dtype=torch.float64), torch.randn(1, 1, 1, d, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        cq, sq = (x.double() for x in table(torch.tensor([m])))
        ck, sk = (x.double() for x in table(torch.tensor([n])))
        return float((rotate(q, cq, sq) * rotate(k, ck, sk)).sum())

    eps = torch.finfo(torch.float32).eps  # the angles are float32: position x eps of rounding each
    scale = float(q.abs().sum() * k.abs().sum())  # a bound on any score's magnitude
    assert abs(score(7, 3) - score(107, 103)) <= 4 * 107 * eps * scale
    assert abs(score(7, 3) - score(7, 4)) > 4 * 107 * eps * scale  # another distance: another score
    cos, sin = table(torch.tensor([5]))
    angle = 5 * theta ** (-2 * 1 / d)  # dimension pair (1, 1 + d/2)
    x = torch.zeros(1, 1, 1, d)
    x[..., 1] = 1.0
    y = rotate(x, cos, sin)
    assert y[0, 0, 0, 1] == pytest.approx(math.cos(angle), abs=1e-6)
    assert y[0, 0, 0, 1 + d // 2] == pytest.approx(math.sin(angle), abs=1e-6)


def test_grouped_query_attention_in_the_ring_equals_repeated_heads():
    """The ring's blockwise attention over grouped heads (4 query heads sharing 2 key/value heads) equals
    attention over the key/value heads repeated for each query head, forward and backward -- the keys'
    and values' gradients summed over their group (float64, one rank: agreement to ~1e-12)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True)
    out = RingAttentionFunction.apply(q, k, v, None, ContextLayout(1, 0), True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(grads, ref_grads))


def test_llama_options_refuse_what_does_not_fit():
    with pytest.raises(ConfigError, match="`kv_heads` 3 must divide `n_head` 4"):
        options_from("llama", {"kv_heads": 3})
    with pytest.raises(ConfigError, match="model gpt has no such option: drop `kv_heads`"):
        options_from("gpt", {"kv_heads": 2})
    model = build_model("llama", (16,), 64, options_from("llama", {"n_embd": 64, "kv_heads": 1}))
    plan = model.tensor_parallel_plan(2, "megatron", False)  # one key/value head for 2 ranks: whole on each
    assert (plan["1.attn.k"], plan["1.attn.v"], plan["1.attn"], plan["1.attn.q"]) == (
        "replicated", "replicated", "tensor_rank", "colwise_entered")
    from distlab.parallel import Strategy
    from distlab.plan import trace
    t = trace("llama", (16,), 64, options=options_from("llama", {"n_embd": 64, "kv_heads": 1}))
    # the planner prices the plan at the layout's tp (here not tp 1's), context parallel sending the whole head
    assert t.tensor_key(Strategy("allreduce", tp=2), 2) == ("megatron", False, 2) and t.kv_share == {2: 1.0, 4: 1.0}
    assert "1.attn.k.weight" not in t.tensor_split[("megatron", False, 2)]  # whole on every rank
    with pytest.raises(ConfigError, match="`n_head` 4 is not divisible by 3"):
        model.tensor_parallel_plan(3, "megatron", False)
    with pytest.raises(ConfigError, match="1 key/value heads per tensor-parallel rank do not divide by 2"):
        model.context_parallel_plan(2, "ulysses", 1)
    with pytest.raises(ConfigError, match="1 key/value heads per tensor-parallel rank do not divide by 2"):
        model.context_parallel_plan(2, "ulysses", 2)  # each of 2 tensor-parallel ranks reads the one head


def _train_llama(rank, world, out, snapshots):
    from distlab import runtime
    from distlab.train import Trainer, TrainConfig
    cfg = TrainConfig.from_flags(model="llama", n_layer=1, n_head=4, kv_heads=2, n_embd=32, dataset="synthetic-text:2000",
                                 block_size=16, max_steps=2, global_batch_size=8, progress=False, verbose=False,
                                 eval_every_epoch=False, out=str(out), snapshot_dir=str(snapshots), snapshot_every=2,
                                 tp=world)
    Trainer(cfg.validate(world), runtime.from_process_group()).fit()


def test_a_llama_run_generates_from_its_snapshot_and_its_export(tmp_path):
    """generate rebuilds the family from the options recorded with it (the snapshot's meta, the export's
    metadata): the same weights from both -- the snapshot's two tensor-parallel shards put back together."""
    from distlab.launch.spawn import run_ranks
    from distlab.tools.generate import generate, load_gpt
    from distlab.train.export import export
    run_ranks(_train_llama, 2, tmp_path / "run", tmp_path / "s", timeout=300)
    export(tmp_path / "s" / "step-00000002", tmp_path / "m.safetensors")
    exported, _, _ = load_gpt(tmp_path / "m.safetensors")
    sharded, _, where = load_gpt(tmp_path / "s" / "step-00000002")
    assert type(exported).__name__ == "Llama" and exported.kv_heads == 2 and "step 2" in where
    assert all(torch.equal(a, b) for a, b in zip(exported.parameters(), sharded.parameters()))
    text = generate(exported, "ab", 8, 0.8, None, 3)
    assert text == generate(sharded, "ab", 8, 0.8, None, 3) and text.startswith("ab") and len(text) > 2


def test_generation_with_the_key_value_cache_gives_the_uncached_tokens():
    """Prefill once, then one token a step: the same tokens as running the whole window every step --
    greedy and sampled, past the context length (where the window slides and the cache starts over) --
    and fewer FLOPs: the blocks see each new token once."""
    from distlab.models.generation import generate
    torch.manual_seed(0)
    for family in ("gpt", "llama"):
        other = build_model(family, (16,), 256, options_from(family, {"n_embd": 32})).eval()
        for temperature in (0.0, 0.8):
            cached = generate(other, "to be", 30, temperature, None, 7)
            plain = generate(other, "to be", 30, temperature, None, 7, use_cache=False)
            assert cached == plain and len(cached.encode()) >= len("to be") + 20, (family, cached, plain)
    model = build_model("llama", (16,), 256, options_from("llama", {"n_embd": 32})).eval()
    seen = []
    hook = model[1].attn.q.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    generate(model, "to be", 4, 0.0, None, 0)
    generate(model, "to be", 4, 0.0, None, 0, use_cache=False)
    hook.remove()
    assert seen == [5, 1, 1, 1] + [5, 6, 7, 8]  # tokens through the first block per step: cached, then not


def test_nucleus_sampling_and_the_end_of_sequence_token():
    """top-p keeps the smallest set of most likely tokens reaching p: a tiny p is greedy decoding whatever
    the seed; generation stops at the tokenizer's end-of-sequence token."""
    from distlab.data.tokenizer import ByteTokenizer
    from distlab.models.generation import generate
    torch.manual_seed(0)
    model = build_model("llama", (16,), 256, options_from("llama", {"n_embd": 32})).eval()
    greedy = generate(model, "to be", 12, 0.0, None, 0)
    assert all(generate(model, "to be", 12, 1.0, None, seed, top_p=1e-6) == greedy for seed in (1, 2))
    assert generate(model, "to be", 12, 1.0, None, 1, top_p=1.0) != greedy  # p 1: every token may come
    stop = ByteTokenizer()
    with torch.no_grad():
        stop.eos = int(model(torch.tensor([list(b"to be")]))[0, -1].argmax())  # the first greedy token
    assert generate(model, "to be", 12, 0.0, None, 0, stop) == "to be" != greedy


def test_a_tied_head_is_one_matrix_through_a_split_a_snapshot_a_reshard_and_an_export(run_cli, tmp_path):
    """--tie-embeddings: the LM head is the token embedding's matrix; under --tp 2 both split by the same
    vocabulary rows and stay one parameter; the snapshot keeps it once and gives it under both names whole
    (an export loads into the tied model and an untied one alike); a resume on one process reshards it."""
    from safetensors.torch import load_file
    model = build_model("llama", (16,), 64, options_from("llama", {"n_embd": 32, "tie_embeddings": True}))
    assert model[-1].out.weight is model[0].tok.weight
    flags = ["train", "--model", "llama", "--tie-embeddings", "true", "--dataset", "synthetic-text:3000", "--n-layer",
             "1", "--n-embd", "32", "--global-batch-size", "4", "--block-size", "16", "--no-progress",
             "--lr-schedule", "constant", "--snapshot-dir", "s"]
    run_cli(*flags, "--max-steps", "2", "--snapshot-every", "2", "--out", "a", "--nproc-per-node", "2", "--tp", "2",
            check=True)
    run_cli("export", "s/step-00000002", "--out", "m.safetensors", check=True)
    state = load_file(str(tmp_path / "m.safetensors"))
    assert state["2.out.weight"].shape == (256, 32) and torch.equal(state["2.out.weight"], state["0.tok.weight"])
    for tie in (True, False):
        build_model("llama", (16,), 256, options_from("llama", {"n_layer": 1, "n_embd": 32, "tie_embeddings": tie})
                    ).load_state_dict(state)
    proc = run_cli(*flags, "--max-steps", "3", "--resume", "auto", "--out", "b", check=True)
    assert "resharded from 2 ranks (bucketed+tp=2) to 1" in proc.stderr
