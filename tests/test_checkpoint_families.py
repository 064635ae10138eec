"""The checkpoints people download, read as transformers reads them: rotary scaling (Llama 3.1+'s llama3,
linear, Qwen2.5's yarn) -- logits equal to transformers' within twice its float32 rounding, through the
layouts and out bitwise, and generation's cache past the training window. Tiny random configs, made here
with the published keys."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.errors import ConfigError
from distlab.models import hf, rope
from tests.conftest import invoke
from tests.test_hf import _agree, _saved, _transformers

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # Llama 3.1's keys; a tiny original context: every band in use
SCALINGS = [("LlamaForCausalLM", LLAMA3), ("LlamaForCausalLM", {"rope_type": "linear", "factor": 4.0}),
            ("Qwen2ForCausalLM", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})]


def _in_and_out(theirs, tmp_path, arch: str, length: int = 24):
    """distlab's model of the checkpoint in ``tmp_path / "in"`` (``theirs``: transformers' of it): logits within
    twice transformers' float32 rounding (its float64 run the reference: :func:`tests.test_hf._agree`); written
    back, the architecture ``arch`` and transformers' logits unchanged. Returns (mine, record, x, expected)."""
    mine, record = hf.build(tmp_path / "in")
    x = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(x).logits
    _agree(mine, theirs, x)  # (turns theirs to float64)
    out = hf.write(mine.state_dict(), record["model"], hf.options_of(hf.config_of(tmp_path / "in"), "")[2], 256,
                   64, tmp_path / "out")
    assert hf.config_of(out)["architectures"] == [arch]
    back = _transformers().AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, expected)
    return mine, record, x, expected


def _through(make, strategy: str, tmp_path, model: str = "llama", length: int = 24):
    """The checkpoint ``make(DIR)`` saves read on 2 ranks with ``strategy``, one step too small to move a weight,
    exported: every tensor as it came, and transformers' logits from the export equal the original's."""
    from distlab.launch.spawn import run_ranks
    from distlab.train.export import export
    from safetensors.torch import load_file
    from tests.test_hf import _train
    theirs = make(tmp_path / "in")
    run_ranks(_train, 2, tmp_path / "in", tmp_path / "s", strategy, model, timeout=300)
    export(tmp_path / "s" / "step-00000001", tmp_path / "out", fmt="hf")
    before = {k: v for f in hf.tensor_files(tmp_path / "in") for k, v in load_file(f).items()}
    after = {k: v for f in hf.tensor_files(tmp_path / "out") for k, v in load_file(f).items()}
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    back = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    experts = getattr(theirs.config, "_experts_implementation", None)
    if experts:  # the experts run by the same kernels on both sides (transformers' default has changed: grouped_mm)
        back.set_experts_implementation(experts)
    x = torch.randint(0, 256, (1, length))
    with torch.no_grad():
        assert torch.equal(back(x).logits, theirs(x).logits)


@pytest.mark.parametrize("arch,scaling", SCALINGS, ids=["llama3", "linear", "yarn"])
def test_a_scaled_rotary_checkpoint_gives_transformers_logits_and_goes_out_as_it_came(arch, scaling, tmp_path):
    """rope_scaling as Llama 3.1 and Qwen2.5 publish it (the old ``rope_scaling`` key, ``type`` for
    ``rope_type``): the logits over 48 positions (3x the original context) agree with transformers' float32
    forward within twice its own rounding (its float64 run the reference), and the export's config holds the
    same scaling transformers computes the same logits with."""
    mine, record, x, expected = _in_and_out(_scaled(arch, tmp_path / "in", scaling), tmp_path, arch, length=48)
    assert record["rope_scaling"].startswith(scaling.get("rope_type", scaling.get("type")))
    plain = hf.build(tmp_path / "in")[0]
    for block in list(plain)[1:-1]:
        block.attn.rotary.scaling = None
    with torch.no_grad():  # the scaling matters here: unscaled, the logits are another model's
        assert (plain(x) - expected).abs().max() > 100 * (mine(x) - expected).abs().max()

def _scaled(arch: str, directory, scaling: dict, **extra):
    """A checkpoint saved by transformers whose config.json says ``rope_scaling`` in the published form."""
    _saved(arch, directory, **extra)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = scaling
    (directory / "config.json").write_text(json.dumps(config))
    return getattr(_transformers(), arch).from_pretrained(directory).eval()


def test_a_scaled_checkpoint_through_context_parallel_comes_out_bitwise(tmp_path):
    """Llama 3.1's scaling read on 2 ranks splitting every sequence (the ring: each rank's rotary angles at its
    chunks' global positions), one step too small to move a weight, exported: every tensor as it came, the
    same rope_scaling, and transformers' logits from the export equal the original's."""
    _through(lambda d: _scaled("LlamaForCausalLM", d, LLAMA3), "bucketed+cp=2", tmp_path, length=40)
    assert hf.config_of(tmp_path / "out")["rope_scaling"] == LLAMA3


WINDOWS = [("MistralForCausalLM", dict(sliding_window=8)),  # Mistral 7B v0.1's: every layer
           ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))]  # layer 1


@pytest.mark.parametrize("arch,window", WINDOWS, ids=["mistral", "qwen2"])
def test_a_sliding_window_checkpoint_gives_transformers_logits_and_goes_out_as_it_came(arch, window, tmp_path):
    """A window of 8 over sequences of 24 (Mistral: every layer; Qwen2: the layers from max_window_layers on):
    the logits agree with transformers' within twice its float32 rounding -- attention over the whole context
    would not -- and the export is the same architecture with the same window, transformers' logits unchanged."""
    mine, record, x, expected = _in_and_out(_saved(arch, tmp_path / "in", **window), tmp_path, arch)
    assert record["sliding_window"] == 8 and hf.config_of(tmp_path / "out")["sliding_window"] == 8
    whole = hf.build(tmp_path / "in")[0]
    for block in list(whole)[1:-1]:
        block.attn.core.window = None
    with torch.no_grad():
        assert (whole(x) - expected).abs().max() > 100 * (mine(x) - expected).abs().max()


@pytest.mark.parametrize("strategy", ["allreduce+tp=2", "bucketed+pp=2+mb=2", "bucketed+cp=2+ulysses"])
def test_a_sliding_window_checkpoint_through_a_layout_comes_out_bitwise(strategy, tmp_path):
    """Mistral's window of 8 read on 2 ranks with sequences of 16 (tensor parallel's heads, a pipeline's
    stages, Ulysses' whole sequences per head group under the window's mask), one step too small to move a
    weight, exported: every tensor as it came; transformers' logits from the export equal the original's."""
    _through(lambda d: _saved("MistralForCausalLM", d, sliding_window=8), strategy, tmp_path)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_over_the_ring_trains_as_one_process_does(family, tmp_path):
    """Mistral's window of 8 (every layer) and Gemma 3's local layers (8) beside its global one, over sequences
    of 16 on context parallel's ring: the first two losses are one process's within verify's float32 bound for
    SGD (one process's logits are transformers', above) -- the ring scoring whole key blocks moves them by
    ~1e-3, a thousand times that; a window at least as long as the sequence needs no mask, and the header says so."""
    from distlab.tools.verify import sgd_tolerance
    if family == "mistral":
        _saved("MistralForCausalLM", tmp_path / "m", sliding_window=8)
    else:
        _gemma3(tmp_path / "m")
    args = ["train", "--init-from", f"hf:{tmp_path / 'm'}", "--dataset", "synthetic-text:400", "--global-batch-size",
            "8", "--max-steps", "2", "--log-every", "1", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
            "--no-progress"]
    losses = {}
    for name, extra in [("one", []), ("ring", ["--nproc-per-node", "2", "--cp", "2"])]:
        code, out, err = invoke([*args, *extra, "--block-size", "16", "--out", str(tmp_path / name)], tmp_path)
        assert code == 0, (out, err)
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    bound = sgd_tolerance(2, 0.05, 8, 0.9)
    assert max(abs(a - b) for a, b in zip(losses["one"], losses["ring"])) <= bound, losses
    if family == "mistral":
        code, out, err = invoke([*args, "--block-size", "8", "--max-steps", "1", "--out", str(tmp_path / "short")],
                                tmp_path)
        assert code == 0 and "sliding window 8 (masked only where a sequence is longer)" in out + err, (out, err)


def _qwen3(directory, **extra):
    """A Qwen3 checkpoint: heads of 16 over a width of 32 (4 heads: 64 wide), q/k norms with weights that
    are not ones (a misplaced norm shows), saved by transformers."""
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False), **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(directory, max_shard_size="40KB")
    return model


def test_a_qwen3_checkpoint_gives_transformers_logits_and_goes_out_as_it_came(tmp_path):
    """Qwen3: each query and key head RMS-normed before the rotation, heads wider than width / heads: the
    logits agree with transformers' within twice its float32 rounding, and it goes out as Qwen3."""
    record = _in_and_out(_qwen3(tmp_path / "in"), tmp_path, "Qwen3ForCausalLM")[1]
    assert record["qk_norm"] and record["head_dim"] == 16


@pytest.mark.parametrize("strategy", ["allreduce+tp=2+sp", "bucketed+cp=2"])
def test_a_qwen3_checkpoint_through_a_layout_comes_out_bitwise(strategy, tmp_path):
    """Qwen3 on 2 ranks -- tensor parallel splitting the heads (each rank's heads through the one q/k norm
    weight, its gradient summed), or the ring -- one step too small to move a weight, exported: every tensor
    as it came, transformers' logits from the export equal the original's."""
    _through(_qwen3, strategy, tmp_path)


def _mixtral(directory, **extra):
    """A Mixtral checkpoint (4 experts, top 2) saved by transformers, in several shards."""
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64), **extra})).eval()
    model.save_pretrained(directory, max_shard_size="40KB")
    model.set_experts_implementation("eager")  # a loop over experts: its float64 run the reference (grouped_mm has none)
    return model


def test_a_mixtral_checkpoint_gives_transformers_logits_and_goes_out_as_it_came(tmp_path):
    """Mixtral read as llama-moe: the router's float32 softmax, top-2 renormalised, every expert's w1/w3/w2
    stacked -- no token dropped (dropless, as transformers computes it); logits within twice transformers'
    float32 rounding; out as Mixtral, transformers' logits unchanged."""
    record = _in_and_out(_mixtral(tmp_path / "in"), tmp_path, "MixtralForCausalLM")[1]
    assert record["model"] == "llama-moe" and record["experts"] == 4 and record["top_k"] == 2
    assert record["capacity_factor"] is None


@pytest.mark.parametrize("strategy", ["allreduce+tp=2", "bucketed+ep=2"])
def test_a_mixtral_checkpoint_through_a_layout_comes_out_bitwise(strategy, tmp_path):
    """Mixtral on 2 ranks -- tensor parallel (the experts whole on each rank), or expert parallel (2 experts
    each, tokens sent to them and back) -- one step too small to move a weight, exported: every tensor as it
    came; transformers' logits from the export equal the original's."""
    _through(_mixtral, strategy, tmp_path, "llama-moe")


MADE = {"llama3": lambda d: _scaled(SCALINGS[0][0], d, SCALINGS[0][1], vocab_size=320),
        "yarn": lambda d: _scaled(SCALINGS[2][0], d, SCALINGS[2][1], vocab_size=320),
        "mistral-window": lambda d: _saved(WINDOWS[0][0], d, vocab_size=320, **WINDOWS[0][1]),
        "qwen2-window": lambda d: _saved(WINDOWS[1][0], d, vocab_size=320, **WINDOWS[1][1]),
        "qwen3": lambda d: _qwen3(d, vocab_size=320),
        "mixtral": lambda d: _mixtral(d, vocab_size=320),
        "phi3": lambda d: _phi3(d, vocab_size=320),
        "gemma3": lambda d: _gemma3(d, vocab_size=320)}


@pytest.mark.parametrize("made", list(MADE))
def test_generate_continues_each_checkpoint_as_transformers_does(made, tmp_path):
    """`distlab generate hf:DIR --temperature 0` -- the key/value cache: each new token's rotary angles at its
    position (scaled), its query seeing only the window's last keys, its query and key heads normed -- gives
    transformers' greedy continuation for 40 tokens, past the original context of 16 positions a scaling
    stretches and five windows of 8."""
    from tests.test_hf import _tokenizer_dir
    theirs = MADE[made](tmp_path / "m")
    tok = _tokenizer_dir(tmp_path / "m")
    code, out, err = invoke(["generate", f"hf:{tmp_path / 'm'}", "--prompt", "the quick brown fox", "--temperature",
                             "0", "--max-new-tokens", "40"], tmp_path)
    assert code == 0, err
    ids = torch.tensor([tok.encode("the quick brown fox").ids])
    with torch.no_grad():
        greedy = theirs.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=1, pad_token_id=1)[0]
    assert out == tok.decode(greedy.tolist(), skip_special_tokens=True) + "\n"


def test_a_llama_with_biases_where_its_config_puts_them_gives_transformers_logits(tmp_path):
    """attention_bias (q, k, v and o) and mlp_bias (gate, up, down), random biases: the logits agree with
    transformers' within twice its float32 rounding (refused before: "distlab's attention has no biases"), and
    it goes out as the same Llama."""
    _saved("LlamaForCausalLM", tmp_path / "made", attention_bias=True, mlp_bias=True)
    theirs = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "made").eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    theirs.save_pretrained(tmp_path / "in")
    record = _in_and_out(theirs, tmp_path, "LlamaForCausalLM")[1]
    assert record["qkv_bias"] and record["proj_bias"] and record["mlp_bias"]
    assert hf.config_of(tmp_path / "out")["attention_bias"] and hf.config_of(tmp_path / "out")["mlp_bias"]


def _phi3(directory, **extra):
    """A Phi-3 checkpoint (fused qkv_proj and gate_up_proj, a window of 8 as mini-4k's 2047) saved by
    transformers, in several shards."""
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), **extra})).eval()
    model.save_pretrained(directory, max_shard_size="40KB")
    return model


def test_a_phi3_checkpoints_fused_tensors_are_read_by_the_rows_each_piece_needs(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj: distlab's q, k, v and gate, up are their row ranges -- each piece a
    layout asks for (rows or columns of a rank, a ZeRO range) read from the file as the whole model's tensor
    gives it; the logits agree with transformers' within twice its float32 rounding; out as Phi-3 again."""
    theirs = _phi3(tmp_path / "in")
    mine, record = hf.build(tmp_path / "in")
    assert record["sliding_window"] == 8
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(x).logits
    _agree(mine, theirs, x)
    whole, slices = mine.state_dict(), hf.sliced(tmp_path / "in")
    assert sorted(slices) == sorted(whole) and {"1.attn.k.weight", "1.mlp.up.weight"} <= set(slices)
    for name, piece in slices.items():
        assert torch.equal(piece.detach(), whole[name]), name
        for dim in range(len(piece.shape)):
            for part in range(2):
                assert torch.equal(piece.piece(dim, 2, part), whole[name].chunk(2, dim)[part]), (name, dim, part)
        assert torch.equal(piece.flat(3, 7), whole[name].reshape(-1)[3:10]), name
    out = hf.write(whole, "llama", hf.options_of(hf.config_of(tmp_path / "in"), "")[2], 256, 64, tmp_path / "out",
                   ids={"pad_token_id": 0}, architecture="Phi3ForCausalLM")
    back = _transformers().AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Phi3ForCausalLM"
    with torch.no_grad():
        assert torch.equal(back(x).logits, expected)


@pytest.mark.parametrize("strategy", ["allreduce+tp=2", "zero=3"])
def test_a_phi3_checkpoint_through_a_layout_comes_out_bitwise_as_phi3(strategy, tmp_path):
    """Phi-3 on 2 ranks -- tensor parallel (each rank reading its heads' rows of qkv_proj), ZeRO-3 (a flat
    range of each) -- one step too small to move a weight, exported: Phi-3 again, every fused tensor as it
    came; transformers' logits from the export equal the original's."""
    _through(_phi3, strategy, tmp_path)
    assert hf.config_of(tmp_path / "out")["architectures"] == ["Phi3ForCausalLM"]


def _gemma3(directory, **extra):
    """A Gemma 3 text checkpoint: 3 layers, the 3rd global (linear-scaled rotary, base 10^6), the others local
    over a window of 8 (base 10^4); heads of 16, scores scaled by 24^-0.5; norms that are not zeros."""
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8, sliding_window_pattern=3,
        query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 8.0}), **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        # its pad token's row starts at zeros, which a step of any size moves: not left at exactly 0 here
        model.model.embed_tokens.weight[0].normal_(0.0, 0.02)
    model.save_pretrained(directory, max_shard_size="40KB")
    return model


def test_a_gemma3_checkpoint_gives_transformers_logits_and_goes_out_as_it_came(tmp_path):
    """Gemma 3: the scaled embedding, (1 + w) RMSNorms before and after each branch, q/k norms, GeGLU, its own
    score scale, local layers (a window, their own rotary base) and a global one (linear-scaled): the logits
    agree with transformers' within twice its float32 rounding -- from transformers 5's config and from the
    published one (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) -- and the export
    is Gemma 3 again."""
    theirs = _gemma3(tmp_path / "in")
    mine, record = hf.build(tmp_path / "in")
    assert record["model"] == "gemma3" and record["global_every"] == 3 and record["rope_scaling"] == "linear,factor=8"
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(x).logits
    out = hf.write(mine.state_dict(), "gemma3", hf.options_of(hf.config_of(tmp_path / "in"), "")[2], 256, 64,
                   tmp_path / "out")
    config = json.loads((tmp_path / "in" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config |= dict(rope_theta=1e6, rope_local_base_freq=10000, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   sliding_window_pattern=3)
    (tmp_path / "in" / "config.json").write_text(json.dumps(config))
    published = hf.build(tmp_path / "in")[0]
    with torch.no_grad():
        assert torch.equal(published(x), mine(x))
    _agree(mine, theirs, x)
    assert hf.config_of(out)["architectures"] == ["Gemma3ForCausalLM"]
    back = _transformers().AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, expected)


@pytest.mark.parametrize("strategy", ["allreduce+tp=2+sp", "bucketed+pp=2+mb=2"])
def test_a_gemma3_checkpoint_through_a_layout_comes_out_bitwise(strategy, tmp_path):
    """Gemma 3 on 2 ranks -- tensor and sequence parallel (the scaled embedding and the post-branch norms on
    each rank's positions), or a pipeline (its tied head a copy on the last stage) -- one step too small to
    move a weight, exported: every tensor as it came; transformers' logits from the export equal the original's."""
    _through(_gemma3, strategy, tmp_path, "gemma3")
