"""Low-rank adapters (``--lora``, distlab.models.lora): the base frozen -- no gradient, no optimizer state, no
gradient sync, never updated -- and only the adapters trained, on every layout as on one process; a run from
a Hugging Face checkpoint keeps its weights bitwise, sends only the adapters' gradients, resumes bitwise,
and exports as the merged model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from distlab.errors import ConfigError
from distlab.models import build_model, lora

SPEC = "r=4,alpha=8,targets=q,v,o_proj,down"


def test_a_spec_is_read_as_peft_names_it_and_bad_ones_are_refused_in_one_line(refused_here):
    spec = lora.LoRASpec.parse("r=16,alpha=32,dropout=0.05,targets=q_proj,k,v,o")
    assert (spec.r, spec.alpha, spec.dropout, spec.targets, spec.scale) == (16, 32.0, 0.05, ("q_proj", "k", "v", "o"), 2.0)
    assert lora.LoRASpec.parse(spec.text()) == spec
    model = build_model("llama", (8,), 64, n_layer=2, n_embd=32, n_head=4)
    names = lora.apply(model, lora.LoRASpec.parse("targets=q_proj,o,gate_proj"))
    assert names == ["1.attn.q", "1.attn.proj", "1.mlp.gate", "2.attn.q", "2.attn.proj", "2.mlp.gate"]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.{k}" for n in names for k in lora.KEYS}  # everything else frozen
    assert lora.apply(build_model("llama", (8,), 64, n_layer=1, n_embd=32, n_head=4),
                      lora.LoRASpec.parse("targets=all")) == ["1.attn.q", "1.attn.k", "1.attn.v", "1.attn.proj",
                                                              "1.mlp.gate", "1.mlp.up", "1.mlp.down"]
    assert lora.apply(build_model("llama", (8,), 64, n_layer=1, n_embd=32, n_head=4),
                      lora.LoRASpec.parse("targets=all-linear")) == ["1.attn.q", "1.attn.k", "1.attn.v",
                                                                     "1.attn.proj", "1.mlp.gate", "1.mlp.up",
                                                                     "1.mlp.down"]  # PEFT's name for all
    for text, message in [("r=0", "rank, a whole number of at least 1"), ("r=4,rank=2", "unknown key 'rank'"),
                          ("dropout=1", "probability below 1"), ("alpha=x", "alpha is a number"),
                          ("targets=", "names the layers"), ("r=4,r=8", "r is given twice"),
                          ("targets=all,q", "all is every linear layer already"),
                          ("alpha=1e308", "past the 1024 allowed"), ("alpha=inf", "finite positive"),
                          ("targets=q,v=1", "unknown key 'v'"), ("targets=q v", "'q v' is not a layer's name")]:
        with pytest.raises(ConfigError, match=message):
            lora.LoRASpec.parse(text)
    base = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--dataset",
            "synthetic-text:2000", "--block-size", "8", "--max-steps", "1"]
    for spec_text, message in [("targets=qkv", "target 'qkv' names no linear layer of the model (its layers: "
                                               "q, k, v, o, gate, up, down, q_proj, k_proj, v_proj, o_proj, "
                                               "gate_proj, up_proj, down_proj; or all, PEFT's all-linear)"),
                               ("targets=out", "names the LM head"),
                               ("r=1000000000,alpha=1e9", "r 1000000000 is more than layer 1.attn.q can hold "
                                                          "(32 x 32: a rank of at most 32)")]:
        proc = refused_here(*base, "--lora", spec_text)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    for extra, message in [(["--base-dtype", "bf16"], "the base is frozen under --lora"),
                           (["--base-dtype", "bf16", "--lora", "targets=q"], "add --precision bf16")]:
        proc = refused_here(*base, *extra)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_the_adapted_layer_is_peft_arithmetic_and_merges_into_the_same_function():
    """``W x + b + B(A(x)) * alpha / r``; merged, ``W + B A * alpha / r`` gives the same output within float32
    rounding; B starts at zero (the adapted model starts as the base), A the same for a layer whatever builds it."""
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 12)
    layer = lora.LoRALinear(base, 4, 2.0)
    with torch.no_grad():
        layer.lora_a.normal_()
        layer.lora_b.normal_()
    x = torch.randn(5, 16)
    expected = base(x) + (x @ layer.lora_a.T @ layer.lora_b.T) * 2.0
    assert torch.equal(layer(x), expected)
    merged = torch.nn.functional.linear(x, layer.merged(), base.bias)
    assert (merged - expected).abs().max() <= 64 * torch.finfo(torch.float32).eps * expected.abs().max()
    a = lora.initial("1.attn.q", (4, 16), seed=3)
    assert torch.equal(a, lora.initial("1.attn.q", (4, 16), seed=3)) and not torch.equal(a, lora.initial(
        "1.attn.k", (4, 16), seed=3)) and a.abs().max() <= 16 ** -0.5
    assert not lora.initial("1.attn.q", (12, 4), 3, "lora_b").any()


def test_adapters_on_every_layout_train_as_one_process():
    """Data parallel (only the adapters' gradients all-reduced), ZeRO-3 (the frozen base sharded and
    gathered, never reduced or updated), TP + SP (B split with a column layer's rows, A with a row layer's
    columns, the whole factor's gradient summed over the group) and a pipeline train the one-process model
    within verify's float32 bound -- the base included, which neither moves; under bf16 autocast with the
    base held (and gathered) in bf16 too, within verify's bf16 bound."""
    from distlab.tools.verify import parse_strategy, verify
    cases = [parse_strategy(f"{s}+llama+lora={SPEC}") for s in
             ("bucketed", "zero=3", "allreduce+tp=2+sp", "bucketed+pp=2+mb=2", "zero=3+bf16")]
    cases.append(parse_strategy(f"zero=3+bf16+llama+lora={SPEC}+base=bf16"))  # the base held and gathered in bf16
    records = verify(cases, 2, steps=3, timeout=600)
    failed = [(r["strategy"], r["max_abs_param_diff"], r["tolerance"]) for r in records if not r["passed"]]
    assert not failed, failed


def _whole(snapshot):
    from distlab.train.loading import whole_state
    return whole_state(snapshot)[0]


def test_a_lora_fine_tune_from_the_command_line_keeps_the_base_and_resumes_bitwise(run_cli, tmp_path):
    """`distlab train --init-from hf:DIR --lora ...` on 2 processes: the header names the adapters and their
    share; each step sends the adapters' gradients and nothing else (4 bytes each); the snapshot holds the
    checkpoint's weights bitwise and adapters that moved; under --tp 2 a run resumed at step 2 ends bitwise
    where the uninterrupted one does; the export is the merged model, which transformers loads."""
    from safetensors.torch import load_file
    from distlab.models import hf
    from tests.test_hf import _saved, _transformers
    _saved("LlamaForCausalLM", tmp_path / "in")
    base = ["train", "--init-from", f"hf:{tmp_path / 'in'}", "--dataset", "synthetic-text:2000", "--block-size",
            "16", "--global-batch-size", "8", "--optimizer", "adamw", "--lr", "0.01", "--log-every", "1",
            "--no-progress", "--nproc-per-node", "2", "--lora", SPEC]
    dp = run_cli(*base, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "dp"), "--out", str(tmp_path / "dprun"),
                 check=True)
    trained = 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4) + (4 * 32 + 32 * 4) + (4 * 96 + 32 * 4))  # q v o down
    assert f"adapters LoRA r=4,alpha=8,dropout=0,targets=q,v,o_proj,down (scale 2): {trained:,} trained" in dp.stdout
    summary = json.loads((tmp_path / "dprun" / "summary.json").read_text())
    assert summary["comm_bytes_per_step"] == 4 * trained  # the adapters' gradients, float32, nothing of the base
    state = _whole(next((tmp_path / "dp").glob("step-*2")))
    before = hf.read(tmp_path / "in")[3]
    assert all(torch.equal(state[k], v) for k, v in before.items())  # the checkpoint's weights, bitwise
    assert sorted(set(state) - set(before)) == sorted(lora.adapter_keys(state)) and all(
        state[k].any() for k in state if k.endswith("lora_b"))  # B moved from zero: the adapters trained
    # --tp 2: a run stopped at step 2 and resumed ends where the uninterrupted one does
    tp = [*base, "--tp", "2", "--snapshot-every", "2", "--keep-snapshots", "5", "--lr-schedule", "constant"]
    run_cli(*tp, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "a"), "--out", str(tmp_path / "arun"), check=True)
    run_cli(*tp, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "b"), "--out", str(tmp_path / "brun"), check=True)
    run_cli(*tp, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "b"), "--resume", "auto", "--out",
            str(tmp_path / "brun2"), check=True)
    a, b = (_whole(next((tmp_path / d).glob("step-*4"))) for d in ("a", "b"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the export: the merged model (each adapted weight W + B A alpha / r), read by transformers
    run_cli("export", str(tmp_path / "arun"), "-o", str(tmp_path / "out"), "--format", "hf", "--merge", check=True)
    out = {k: v for f in hf.tensor_files(tmp_path / "out") for k, v in load_file(f).items()}
    merged = lora.merge(a, 2.0)
    mine = hf.read(tmp_path / "out")[3]
    assert sorted(mine) == sorted(merged) and all(torch.equal(mine[k], merged[k]) for k in merged)
    assert not any("lora" in k for k in out)
    back = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)


def _peft():
    return pytest.importorskip("peft", reason="peft (the test extra) is not installed: pip install -e '.[test]'")


def test_adapters_go_out_as_peft_loads_them_come_back_and_merge_as_peft_merges(run_cli, refused_here, tmp_path):
    """`export --format peft` of a LoRA fine-tune: peft.PeftModel.from_pretrained(base, DIR) computes
    distlab's logits (within twice PEFT's own float32 rounding of its float64 forward); `--lora-from peft:DIR`
    starts a run at them (one step too small to move a weight, out again: every tensor bitwise, the spec
    from their config); `--format hf --merge` writes PEFT's merge_and_unload() weights; without --merge, or
    --format peft of a run without adapters, is refused in one line."""
    from safetensors.torch import load_file
    from distlab.models import hf
    from distlab.train.loading import load
    from tests.test_hf import _saved, _transformers
    peft = _peft()
    _saved("LlamaForCausalLM", tmp_path / "base")
    base = ["train", "--init-from", f"hf:{tmp_path / 'base'}", "--dataset", "synthetic-text:2000", "--block-size",
            "16", "--global-batch-size", "8", "--no-progress"]
    run_cli(*base, "--optimizer", "adamw", "--lr", "0.01", "--max-steps", "3", "--lora", SPEC, "--out",
            str(tmp_path / "run"), check=True)
    proc = run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "adapter"), "--format", "peft", check=True)
    assert "peft.PeftModel.from_pretrained" in proc.stdout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == \
        (4, 8, ["down_proj", "o_proj", "q_proj", "v_proj"])
    transformers = _transformers()
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                            str(tmp_path / "adapter")).eval()
    mine = load(tmp_path / "run").model  # the run's model, its adapters merged
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = mine(x), theirs(x).logits
        exact = theirs.double()(x).logits
    bound = 2 * (b.double() - exact).abs().max().item() + 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert (a.double() - b.double()).abs().max().item() <= bound
    # in again: the adapters PEFT loads, one step that moves nothing, out again bitwise
    run_cli(*base, "--lora-from", f"peft:{tmp_path / 'adapter'}", "--optimizer", "sgd", "--momentum", "0",
            "--lr", "1e-30", "--max-steps", "1", "--out", str(tmp_path / "again"), check=True)
    run_cli("export", str(tmp_path / "again"), "-o", str(tmp_path / "adapter2"), "--format", "peft", check=True)
    before, after = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("adapter", "adapter2"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    # merged as PEFT merges
    run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "merged"), "--format", "hf", "--merge", check=True)
    merged = {k: v for f in hf.tensor_files(tmp_path / "merged") for k, v in load_file(f).items()}
    reference = theirs.float().merge_and_unload().state_dict()
    for key, value in merged.items():
        bound = 4 * torch.finfo(torch.float32).eps * reference[key].abs().max().item()
        assert (value - reference[key]).abs().max().item() <= bound, key
    proc = run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "plain"), "--format", "hf")
    assert proc.returncode == 2 and "--format hf --merge" in proc.stderr and proc.stderr.count("\n") == 1
    run_cli(*base, "--max-steps", "1", "--out", str(tmp_path / "full"), check=True)
    proc = run_cli("export", str(tmp_path / "full"), "-o", str(tmp_path / "none"), "--format", "peft")
    assert proc.returncode == 2 and "has none" in proc.stderr and not (tmp_path / "none").exists()
    # an adapter config is read as the types it holds: nothing in a value becomes another setting
    for n, (change, message) in enumerate([
            ({"lora_dropout": "0,alpha=1000"}, "lora_dropout is a probability below 1, not '0,alpha=1000'"),
            ({"target_modules": ["q_proj", "alpha=1000"]}, "target 'alpha=1000' is not a layer's name"),
            ({"r": 8}, "not that of a rank-8 factor (adapter_config.json says r 8)"),
            ({"r": 4.0}, "r is the adapters' rank, a whole number"),
            ({"lora_alpha": "8"}, "lora_alpha is a finite")]):
        bad = tmp_path / f"bad{n}"
        shutil.copytree(tmp_path / "adapter", bad)
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        proc = refused_here(*base, "--lora-from", f"peft:{bad}", "--max-steps", "1")
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, (change, proc.stderr)


def test_a_lora_chat_fine_tune_generates_from_every_source_as_transformers_and_peft_do(run_cli, tmp_path):
    """A Llama 3 chat model fine-tuned with LoRA: `distlab generate SOURCE --chat`, greedy, prints the reply that
    PEFT (the base plus the exported adapter) and transformers (the merged export) generate -- from the run
    directory's final model, from a run directory whose model is a snapshot, from the snapshot itself and from
    the merged export -- and every one stops at the template's end of turn (<|eot_id|>, which the run's tokenizer
    keeps from the checkpoint it started from), where they stop."""
    from tests.test_chat_families import TALKS, _bigram, _family_dir
    from tests.test_hf import _transformers
    peft, transformers = _peft(), _transformers()
    tok = _family_dir("llama3", tmp_path / "m")
    _bigram("llama3", tmp_path / "m", tok)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": t}) + "\n" for t in TALKS * 10))
    train = ["train", "--init-from", f"hf:{tmp_path / 'm'}", "--tokenizer", f"hf:{tmp_path / 'm'}", "--dataset",
             f"sft:{tmp_path / 'chat.jsonl'}", "--lora", "r=2,alpha=4,targets=o,down,q,v", "--block-size", "192",
             "--global-batch-size", "4", "--optimizer", "adamw", "--lr", "0.01", "--max-steps", "3", "--no-progress"]
    run_cli(*train, "--out", str(tmp_path / "run"), check=True)
    run_cli(*train, "--out", str(tmp_path / "snaprun"), "--snapshot-dir", str(tmp_path / "snaps"), check=True)
    run_cli("export", str(tmp_path / "run"), "--format", "peft", "-o", str(tmp_path / "adapter"), check=True)
    run_cli("export", str(tmp_path / "run"), "--format", "hf", "--merge", "-o", str(tmp_path / "merged"), check=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "the fox?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    theirs = {"peft": peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval(),
              "merged": transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()}
    eot = tok.token_to_id("<|eot_id|>")
    replies = set()
    for name, model in theirs.items():
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:].tolist()
        assert new[-1] == eot and len(new) < 12, (name, new)  # it stopped at the end of turn
        for logits in out.logits:  # each greedy choice clear of float32 rounding, so every float32 model agrees
            top = logits[0].double().topk(2).values
            assert top[0] - top[1] > 64 * torch.finfo(torch.float32).eps * logits.abs().max().item(), name
        replies.add(hf_tok.decode(new, skip_special_tokens=True))
    assert len(replies) == 1
    reply = replies.pop()
    snapshot = next((tmp_path / "snaps").glob("step-*"))
    for source in (tmp_path / "run", tmp_path / "snaprun", snapshot, f"hf:{tmp_path / 'merged'}"):
        proc = run_cli("generate", str(source), "--chat", "--prompt", "the fox?", "--temperature", "0",
                       "--max-new-tokens", "12", check=True)
        assert proc.stdout == reply + "\n", (source, proc.stdout, reply)


def test_a_peft_export_names_its_base_so_auto_peft_loads_it_and_an_adapter_of_another_base_is_said(run_cli,
                                                                                                   tmp_path):
    """`export --format peft` writes the base it was trained on as base_model_name_or_path (the hf: directory,
    absolute), so `AutoPeftModelForCausalLM.from_pretrained(DIR)` loads base and adapters alone, computing
    what the base plus the adapters computes; those adapters started on a Mistral of the same shapes load,
    and the header says they were trained on another base."""
    from tests.test_hf import _saved, _transformers
    peft = _peft()
    _saved("LlamaForCausalLM", tmp_path / "llama")
    _saved("MistralForCausalLM", tmp_path / "mistral")
    base = ["train", "--dataset", "synthetic-text:2000", "--block-size", "16", "--global-batch-size", "8",
            "--no-progress", "--max-steps", "2"]
    run_cli(*base, "--init-from", f"hf:{tmp_path / 'llama'}", "--lora", SPEC, "--optimizer", "adamw", "--lr", "0.01",
            "--out", str(tmp_path / "run"), check=True)
    run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "adapter"), "--format", "peft", check=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "llama").resolve())
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    by_hand = peft.PeftModel.from_pretrained(_transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "llama"),
                                             str(tmp_path / "adapter")).eval()
    x = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(auto(x).logits, by_hand(x).logits)
    same = run_cli(*base, "--init-from", f"hf:{tmp_path / 'llama'}", "--lora-from", f"peft:{tmp_path / 'adapter'}",
                   "--out", str(tmp_path / "same"), check=True)
    assert "were trained on" not in same.stdout
    other = run_cli(*base, "--init-from", f"hf:{tmp_path / 'mistral'}", "--lora-from", f"peft:{tmp_path / 'adapter'}",
                    "--out", str(tmp_path / "other"), check=True)
    assert f"warning  the adapters of peft:{tmp_path / 'adapter'} were trained on {(tmp_path / 'llama').resolve()}; " \
           f"--init-from is {(tmp_path / 'mistral').resolve()}" in other.stdout, other.stdout


def test_a_fine_tune_resumes_bitwise_when_its_init_from_directory_is_gone(run_cli, refused_here, tmp_path):
    """`--resume auto` of a LoRA fine-tune from hf:DIR whose directory was moved away: the snapshot holds every
    weight and kept the checkpoint's config, so the run goes on from it and ends bitwise where the
    uninterrupted run does (it said "no config.json there"); a DPO run, whose reference is the starting model
    read again at a resume, is refused in one line instead."""
    from tests.test_hf import _saved
    _saved("LlamaForCausalLM", tmp_path / "base")
    args = ["train", "--init-from", f"hf:{tmp_path / 'base'}", "--block-size", "16", "--global-batch-size", "8",
            "--no-progress", "--lora", SPEC, "--optimizer", "adamw", "--lr", "0.01", "--lr-schedule", "constant",
            "--snapshot-every", "2", "--keep-snapshots", "5"]
    text = [*args, "--dataset", "synthetic-text:2000"]
    run_cli(*text, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "a"), "--out", str(tmp_path / "arun"),
            check=True)
    run_cli(*text, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "b"), "--out", str(tmp_path / "brun"),
            check=True)
    run_cli(*args, "--dataset", "synthetic-pairs", "--max-steps", "1", "--snapshot-dir", str(tmp_path / "d"),
            "--out", str(tmp_path / "drun"), check=True)
    (tmp_path / "base").rename(tmp_path / "moved")
    run_cli(*text, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "b"), "--resume", "auto", "--out",
            str(tmp_path / "brun2"), check=True)
    a, b = (_whole(next((tmp_path / d).glob("step-*4"))) for d in ("a", "b"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    proc = refused_here(*args, "--dataset", "synthetic-pairs", "--max-steps", "2", "--snapshot-dir",
                        str(tmp_path / "d"), "--resume", "auto", "--out", str(tmp_path / "drun2"))
    assert "DPO's reference is the model training started from" in proc.stderr and \
        proc.stderr.count("\n") == 1, proc.stderr
