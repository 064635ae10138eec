"""One loader (distlab.train.loading): every text family from every source -- a run directory, a snapshot, an
exported file, a Hugging Face export -- built as it was recorded; the model's own context survives import,
training at a shorter window and export, and generation reads it: greedy continuations past the training
window equal transformers' on the exported model."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_hf import _gpt2, _saved, _transformers

PROMPT = "the quick brown fox jumps "  # 26 bytes: past the training window of 16 before anything is generated


def _greedy(model, ids: list[int], n: int) -> list[int]:
    from distlab.models.generation import sample_ids
    return list(sample_ids(model, ids, n, temperature=0))


def _theirs(directory, ids: list[int], n: int) -> list[int]:
    model = _transformers().AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_checkpoints_context_survives_training_at_a_shorter_window_and_generation_reads_it(kind, run_cli, tmp_path):
    """A checkpoint of 64 positions trained at --block-size 16 (one step too small to move a weight): the run
    generates (a GPT-2 run's options -- biases, tanh GELU, tied head -- were lost on the way: it could not),
    its export says 64 positions and keeps GPT-2's whole table (it said 16 and cut the table), and the greedy
    continuation of a 26-token prompt for 30 tokens equals transformers' on the export (distlab slid its
    window at 16 tokens: it left transformers' after the first)."""
    theirs = _gpt2(tmp_path / "in") if kind == "gpt2" else _saved("LlamaForCausalLM", tmp_path / "in")
    run_cli("train", "--init-from", f"hf:{tmp_path / 'in'}", "--dataset", "synthetic-text:2000", "--block-size", "16",
            "--global-batch-size", "4", "--max-steps", "1", "--lr", "1e-30", "--momentum", "0", "--no-progress",
            "--out", str(tmp_path / "run"), check=True)
    proc = run_cli("generate", str(tmp_path / "run"), "--prompt", PROMPT, "--temperature", "0",
                   "--max-new-tokens", "4", check=True)
    assert proc.stdout.startswith(PROMPT)
    run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "out"), "--format", "hf", check=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["n_positions" if kind == "gpt2" else "max_position_embeddings"] == 64
    from distlab.train.loading import load
    loaded = load(tmp_path / "run")
    assert loaded.model.context == 64 and loaded.model.block_size == 16
    ids = list(PROMPT.encode())
    mine = _greedy(loaded.model, ids, 30)
    assert mine == _theirs(tmp_path / "out", ids, 30) == _theirs(tmp_path / "in", ids, 30)
    if kind == "gpt2":
        from safetensors.torch import load_file
        wpe = "transformer.wpe.weight"
        assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")[wpe], theirs.state_dict()[wpe])


def _every_source(rank, world, root):
    """Each family trained one step (snapshots kept), then loaded from its run directory, its snapshot, its
    .safetensors export and, where the family has a Hugging Face layout, its hf export: logits of each, and
    what a token-id model generates."""
    from distlab import runtime
    from distlab.data.tokenizer import IdsTokenizer
    from distlab.models.generation import generate
    from distlab.train import Trainer, TrainConfig
    from distlab.train.export import export
    from distlab.train.loading import load
    small = dict(n_layer=1, n_head=2, n_embd=16)
    families = {"gpt": dict(model="gpt", **small), "gpt-moe": dict(model="gpt-moe", experts=2, top_k=1, **small),
                "llama": dict(model="llama", kv_heads=1, **small), "llama-moe": dict(model="llama-moe", experts=2, **small),
                "gpt2-hf": dict(init_from=f"hf:{root / 'gpt2'}"), "qwen2-hf": dict(init_from=f"hf:{root / 'qwen2'}"),
                "nanogpt-ids": dict(model="gpt", dataset=f"tokens:{root / 'nano'}", vocab_size=300, **small)}
    out = {}
    for name, flags in families.items():
        run = root / name
        cfg = TrainConfig.from_flags(**{**dict(dataset="synthetic-text:2000", block_size=8, max_steps=1,
                                               global_batch_size=4, progress=False, verbose=False,
                                               eval_every_epoch=False, snapshot_dir=str(run / "s"), snapshot_every=1,
                                               out=str(run)), **flags})
        Trainer(cfg.validate(1), runtime.from_process_group()).fit()
        sources = {"run": run, "snapshot": run / "s" / "step-00000001"}
        export(run, run / "m.safetensors")
        sources["export"] = run / "m.safetensors"
        if name in ("gpt", "llama", "gpt2-hf", "qwen2-hf"):
            export(run, run / "hf", fmt="hf")
            sources["hf"] = f"hf:{run / 'hf'}"
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        loaded = {k: load(v) for k, v in sources.items()}
        with torch.no_grad():
            out[name] = {k: v.model(x) for k, v in loaded.items()}
        if name == "nanogpt-ids":
            tok = loaded["run"].tokenizer
            assert isinstance(tok, IdsTokenizer)
            out["ids-text"] = generate(loaded["run"].model, "5 7 9", 3, temperature=0, tokenizer=tok)
    return out


def test_every_family_loads_from_every_source_as_the_same_model(tmp_path):
    """{gpt, gpt-moe, llama, llama-moe, gpt from GPT-2, llama from Qwen2, gpt on a nanoGPT corpus of ids} x {run
    directory, snapshot, export file, Hugging Face export}: one loader, one model -- the same logits, bitwise;
    a run on token ids without a tokenizer generates ids (it asked for a tokenizer.json it never had)."""
    import numpy as np
    from distlab.launch.spawn import run_ranks
    _gpt2(tmp_path / "gpt2", n_layer=1, n_embd=16, n_head=2)
    _saved("Qwen2ForCausalLM", tmp_path / "qwen2", num_hidden_layers=1)
    (tmp_path / "nano").mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 400)):
        rng.integers(0, 300, n).astype(np.uint16).tofile(tmp_path / "nano" / f"{split}.bin")
    out = run_ranks(_every_source, 1, tmp_path, timeout=600)[0]
    text = out.pop("ids-text")
    assert text.startswith("5 7 9 ") and len(text.split()) == 6 and all(w.isdigit() for w in text.split())
    assert set(out) == {"gpt", "gpt-moe", "llama", "llama-moe", "gpt2-hf", "qwen2-hf", "nanogpt-ids"}
    for name, logits in out.items():
        first = logits["snapshot"]
        assert len(logits) == (4 if name in ("gpt", "llama", "gpt2-hf", "qwen2-hf") else 3), name
        assert all(torch.equal(first, other) for other in logits.values()), name


def _chat_llama(directory):
    """A bf16 Llama checkpoint with a chat model's tokenizer: bos 0, ends of text and of turn [1, 2], a chat
    template, a generation_config.json listing both ends."""
    from tests.test_sft import chat_model
    chat_model(directory)
    torch.manual_seed(0)
    transformers = _transformers()
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=[1, 2], tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def test_an_export_ships_what_its_checkpoint_said_and_never_mixes_with_another(run_cli, tmp_path):
    """A chat fine-tune of a bf16 checkpoint exported with --format hf: its bos/eos ids in config.json, its
    generation_config.json, its tokenizer's tokenizer_config.json (the chat template) and bf16 weights come out
    (they were dropped: transformers fell back to Llama 2's eos and never stopped, generate --chat refused the
    export, the weights came back float32); --dtype float32 on demand; an OUT that holds files, or lies in a
    snapshot, is refused in one line and left as it was (the export wrote beside another model's shards)."""
    from safetensors import safe_open
    from tests.test_sft import _chats
    _chat_llama(tmp_path / "in")
    spec = _chats(tmp_path / "chat.jsonl")
    run_cli("train", "--init-from", f"hf:{tmp_path / 'in'}", "--tokenizer", f"hf:{tmp_path / 'in'}", "--dataset",
            spec, "--block-size", "40", "--global-batch-size", "4", "--max-steps", "1", "--lr", "1e-30",
            "--no-progress", "--snapshot-dir", str(tmp_path / "s"), "--out", str(tmp_path / "run"), check=True)
    run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "out"), "--format", "hf", check=True)
    out, original = tmp_path / "out", tmp_path / "in"
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["dtype"]) == (0, [1, 2], "bfloat16")
    assert (out / "generation_config.json").read_text() == (original / "generation_config.json").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text()) == \
        json.loads((original / "tokenizer_config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    reply = run_cli("generate", f"hf:{out}", "--chat", "--prompt", "the fox?", "--temperature", "0",
                    "--max-new-tokens", "3", check=True)
    assert reply.returncode == 0
    run_cli("export", str(tmp_path / "run"), "-o", str(tmp_path / "wide"), "--format", "hf", "--dtype", "float32",
            check=True)
    with safe_open(str(tmp_path / "wide" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    before = sorted(p.name for p in original.iterdir())
    proc = run_cli("export", str(tmp_path / "run"), "-o", str(original), "--format", "hf")
    assert proc.returncode == 2 and "already holds" in proc.stderr and proc.stderr.count("\n") == 1
    assert sorted(p.name for p in original.iterdir()) == before
    snapshot = next((tmp_path / "s").glob("step-*"))
    proc = run_cli("export", str(tmp_path / "run"), "-o", str(snapshot / "hf"), "--format", "hf")
    assert proc.returncode == 2 and "lies inside snapshot" in proc.stderr and not (snapshot / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # nothing half-written left beside


def test_a_window_longer_than_the_models_context_is_refused(refused_here):
    """--context is the model's longest sequence, --block-size the window it trains on: a window past the
    context is refused before launch, in one line."""
    proc = refused_here("train", "--model", "gpt", "--context", "8", "--block-size", "16", "--dataset",
                        "synthetic-text:2000")
    assert "--block-size 16 is longer than the model's --context 8" in proc.stderr
    assert proc.stderr.count("\n") == 1
