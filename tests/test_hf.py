"""Hugging Face checkpoints in and out (distlab.models.hf): a Llama or Mistral directory saved by
``transformers`` gives distlab's ``llama`` the same logits; trained on any layout and exported with
``--format hf`` it comes back bitwise, and ``transformers`` loads it. Tiny random configs, made here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distlab.errors import ConfigError
from distlab.models import hf



def _transformers():
    return pytest.importorskip("transformers", reason="transformers (the test extra) is not installed: "
                                                      "pip install -e '.[test]' runs the interop tests")


def _config(arch: str, **extra):
    transformers = _transformers()
    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config}[arch]
    return cls(**{**dict(vocab_size=256, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=False), **extra})


def _saved(arch: str, directory, **extra):
    torch.manual_seed(0)
    model = getattr(_transformers(), arch)(_config(arch, **extra)).eval()
    model.save_pretrained(directory, max_shard_size="40KB")  # several shards and an index, as large models come
    return model


def _agree(mine, theirs, x) -> None:
    """distlab's logits and transformers' agree: both compute in float32, each within its rounding of the
    float64 result (transformers' model in float64), so they agree to twice that (plus one rounding)."""
    with torch.no_grad():
        a, b = mine(x), theirs(x).logits
        exact = theirs.double()(x).logits
    bound = 2 * (b.double() - exact).abs().max().item() + torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert (a.double() - b.double()).abs().max().item() <= bound


@pytest.mark.parametrize("arch,tied", [("LlamaForCausalLM", False), ("MistralForCausalLM", False),
                                       ("Qwen2ForCausalLM", False), ("Qwen2ForCausalLM", True)])
def test_a_hugging_face_checkpoint_gives_the_same_logits(arch, tied, tmp_path):
    """Both compute in float32; each is within its rounding of the float64 result (transformers' own model
    in float64), so they agree to twice that. Qwen2's q/k/v biases (random here, not zeros) included, and
    its small models' tied embeddings (the checkpoint has no lm_head: one matrix in distlab too); and
    back out as the same architecture."""
    theirs = _saved(arch, tmp_path, rope_theta=500000.0, tie_word_embeddings=tied)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    theirs.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / hf.INDEX).is_file()
    mine, record = hf.build(tmp_path)
    assert record["kv_heads"] == 2 and record["rope_theta"] == 500000.0 and record["vocab"] == 256
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    _agree(mine, theirs, x)
    assert (mine[-1].out.weight is mine[0].tok.weight) == tied
    out = hf.write(mine.state_dict(), "llama", hf.options_of(hf.config_of(tmp_path), "")[2], 256, 64, tmp_path / "out")
    assert hf.config_of(out)["architectures"] == ["Qwen2ForCausalLM" if arch.startswith("Qwen") else "LlamaForCausalLM"]
    assert hf.config_of(out)["tie_word_embeddings"] == tied
    from safetensors.torch import load_file
    assert ("lm_head.weight" in load_file(out / hf.SINGLE)) != tied


def _train(rank, world, directory, snapshots, strategy, model="llama"):
    from distlab import runtime
    from distlab.parallel import Strategy
    from distlab.train import Trainer, TrainConfig
    cfg = TrainConfig.from_flags(model=model, init_from=f"hf:{directory}", dataset="synthetic-text:2000",
                                 block_size=16, max_steps=1, global_batch_size=8, optimizer="sgd", momentum=0.0,
                                 lr=1e-30, progress=False, verbose=False, eval_every_epoch=False,
                                 snapshot_dir=str(snapshots), snapshot_every=1, strategy=Strategy.parse(strategy))
    Trainer(cfg.validate(world), runtime.from_process_group()).fit()


@pytest.mark.parametrize("strategy", ["allreduce+tp=2", "bucketed+pp=2+mb=2"])
def test_in_through_a_layout_and_out_is_bitwise_and_transformers_loads_it(strategy, tmp_path):
    """A checkpoint with tied embeddings read on 2 ranks split by the layout (the LM head split by the
    embedding's vocabulary rows, or a copy on the last stage), one step too small to move a weight,
    exported: every tensor as it came, still no lm_head; transformers' from_pretrained gives the
    original's logits."""
    from distlab.launch.spawn import run_ranks
    from distlab.train.export import export
    from safetensors.torch import load_file
    theirs = _saved("LlamaForCausalLM", tmp_path / "in", tie_word_embeddings=True)
    run_ranks(_train, 2, tmp_path / "in", tmp_path / "s", strategy, timeout=300)
    export(tmp_path / "s" / "step-00000001", tmp_path / "out", fmt="hf")
    before = {k: v for f in hf.tensor_files(tmp_path / "in") for k, v in load_file(f).items()}
    after = {k: v for f in hf.tensor_files(tmp_path / "out") for k, v in load_file(f).items()}
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    back = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(back(x).logits, theirs(x).logits)


def test_each_rank_reads_the_pieces_of_a_checkpoint_its_layout_holds(tmp_path):
    """--init-from hf:DIR is read after the layout cuts the model: each rank's placement asks a tensor for its
    piece (safetensors' slices of rows or columns, float32), the same piece the whole tensor would give --
    GPT-2's too: its Conv1D matrices transposed, c_attn's q, k and v each a third of its columns (it was read
    whole on every rank)."""
    from distlab.parallel.placement import Placement, take
    _saved("LlamaForCausalLM", tmp_path / "m")
    _gpt2(tmp_path / "g")
    for directory in (tmp_path / "m", tmp_path / "g"):
        whole, slices = hf.read(directory)[3], hf.sliced(directory)
        assert sorted(slices) == sorted(whole)
        for name, t in whole.items():
            for dim in range(t.dim()):
                for part in range(2):
                    placement = Placement(name, tuple(t.shape), dim, 2, part)
                    assert torch.equal(take(slices[name], placement), take(t, placement)), (name, dim, part)
            flat = Placement(name, tuple(t.shape), None, 1, 0, start=3, length=min(37, t.numel() - 3))  # ZeRO's
            assert torch.equal(take(slices[name], flat, 40), take(t, flat, 40)), name
    assert {"1.attn.k.weight", "1.attn.k.bias", "2.mlp.2.weight"} <= set(slices)


def _gpt2(directory, **extra):
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**dict(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0), **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # not zeros: a misplaced bias shows
    model.save_pretrained(directory)
    return model


def test_gpt2_checkpoints_come_in_fused_and_transposed_and_go_out_bitwise(tmp_path):
    """GPT-2's fused c_attn (split into q, k, v) and Conv1D matrices (transposed), tied embeddings, the tanh
    GELU: distlab's logits equal transformers' within twice its float32 rounding; in on 2 ranks with tensor
    parallel (windows of 16 of its 64 positions), one step too small to
    move a weight, out: every tensor as it came -- the whole position table, the model's context; and a distlab GPT of its own defaults (no q/k/v biases,
    the exact GELU, an untied head) goes out as a GPT-2 transformers computes the same logits with."""
    from distlab.launch.spawn import run_ranks
    from distlab.models import build_model
    from distlab.train.export import export
    from safetensors.torch import load_file
    theirs = _gpt2(tmp_path / "in")
    mine, record = hf.build(tmp_path / "in")
    assert record["qkv_bias"] and record["gelu"] == "tanh" and record["tie_embeddings"]
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    _agree(mine, theirs, x)
    run_ranks(_train, 2, tmp_path / "in", tmp_path / "s", "allreduce+tp=2", "gpt", timeout=300)
    export(tmp_path / "s" / "step-00000001", tmp_path / "out", fmt="hf")
    before, after = (load_file(tmp_path / d / hf.SINGLE) for d in ("in", "out"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    torch.manual_seed(0)
    own = build_model("gpt", (16,), 256, n_layer=1, n_head=2, n_embd=16).eval()
    from distlab.models.gpt import GPTOptions
    hf.write(own.state_dict(), "gpt", GPTOptions(n_layer=1, n_head=2, n_embd=16), 256, 16, tmp_path / "own")
    back = _transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "own").eval()
    _agree(own, back, x[:, :16])


def test_what_distlab_would_compute_differently_is_refused_in_one_line(tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    for change, message in [({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic': dynamic NTK"),
                            ({"rope_scaling": {"rope_type": "longrope"}}, "longrope's per-dimension factors"),
                            ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                             "llama3 scaling needs original_max_position_embeddings"),
                            ({"architectures": ["GPTNeoXForCausalLM"]}, "architecture 'GPTNeoXForCausalLM' is not "
                                                                        "supported")]:
        (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(ConfigError, match=message):
            hf.read(tmp_path)
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4}
    for change, message in [({"activation_function": "relu"}, "activation_function 'relu'"),
                            ({"n_inner": 64}, "n_inner 64 \\(distlab's MLP is 4 x n_embd = 128 wide\\)")]:
        (tmp_path / "config.json").write_text(json.dumps({**gpt2, **change}))
        with pytest.raises(ConfigError, match=message):
            hf.read(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="a pytorch_model.bin is a pickle, which distlab never loads"):
        hf.read(tmp_path)


def _tokenizer_dir(path, vocab_size: int | None = None):
    """A pretrained model's tokenizer files, as a Hugging Face directory holds them (a tiny BPE with <s> and
    </s>; a config.json whose vocabulary pads it where ``vocab_size`` is given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    if vocab_size:
        (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size, "eos_token_id": 1}))
    return tok


def test_prepare_text_with_a_models_tokenizer_puts_its_eos_between_documents(tmp_path):
    """prepare-text --tokenizer hf:DIR: the model's own tokenizer (no template tokens), its end-of-sequence
    token between documents, the tokenizer copied beside the tokens; a vocabulary past 65,536 is uint32."""
    from distlab.data.prepare import prepare
    from distlab.data.tokens import load_tokens
    tok = _tokenizer_dir(tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"the fox {i}" for i in range(12)) + "\n")
    manifest = prepare(tmp_path / "corpus.txt", tmp_path / "tok", f"hf:{tmp_path / 'model'}", progress=False)
    train = np.fromfile(tmp_path / "tok" / "train.bin", dtype=manifest["dtype"])
    eos = tok.token_to_id("</s>")
    assert manifest["eos_token_id"] == eos and int((train == eos).sum()) == manifest["splits"]["train"]["documents"] - 1
    assert tok.token_to_id("<s>") not in train  # no template's begin token
    assert list(train[:len(tok.encode("the fox 0").ids)]) == tok.encode("the fox 0").ids
    data = load_tokens(f"tokens:{tmp_path / 'tok'}", "train", 4)
    assert data.tokenizer.decode(train[:3].tolist()) == tok.decode(train[:3].tolist())
    _tokenizer_dir(tmp_path / "big", vocab_size=70_000)
    wide = prepare(tmp_path / "corpus.txt", tmp_path / "wide", f"hf:{tmp_path / 'big'}", progress=False)
    assert wide["dtype"] == "uint32" and wide["vocab_size"] == 70_000


def test_generate_reads_a_hugging_face_directory_with_its_tokenizer(tmp_path, run_cli):
    """distlab generate hf:DIR: the checkpoint's model and its tokenizer.json; the same text with and
    without the key/value cache."""
    _saved("LlamaForCausalLM", tmp_path / "small")
    _tokenizer_dir(tmp_path / "small")  # 290 tokens for a model of 256
    proc = run_cli("generate", f"hf:{tmp_path / 'small'}", "--max-new-tokens", "2")
    assert proc.returncode == 2 and "the tokenizer has 290 tokens" in proc.stderr and proc.stderr.count("\n") == 1
    _saved("LlamaForCausalLM", tmp_path / "m", vocab_size=320)
    _tokenizer_dir(tmp_path / "m")
    args = ["generate", f"hf:{tmp_path / 'm'}", "--prompt", "the fox", "--max-new-tokens", "8", "--seed", "3"]
    cached, plain = (run_cli(*args, *extra, check=True) for extra in ([], ["--no-cache"]))
    assert cached.stdout == plain.stdout and cached.stdout.startswith("the fox")
    assert "(llama)" in cached.stderr and "hf tokens" in cached.stderr
    # --chat: the prompt as a user's turn through the model's chat template; the reply is transformers' greedy one
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    reply = run_cli("generate", f"hf:{tmp_path / 'm'}", "--chat", "--prompt", "the fox?", "--temperature", "0",
                    "--max-new-tokens", "6", check=True).stdout
    transformers = _transformers()
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ids = tok.apply_chat_template([{"role": "user", "content": "the fox?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    assert reply == tok.decode(out.tolist(), skip_special_tokens=True) + "\n"
    from distlab.data.tokenizer import HFTokenizer
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert {1, 7} <= HFTokenizer.from_dir(str(tmp_path / "m")).stops  # an end of turn stops it as an end of text
    from distlab.tools.generate import chat_prompt
    with pytest.raises(ConfigError, match="--chat renders the prompt with a model's chat template: .* has none"):
        chat_prompt(f"hf:{tmp_path / 'small'}", "hi")


def test_init_from_a_directory_takes_its_family_options_and_limits(tmp_path):
    """--init-from hf:DIR without --model builds the checkpoint's family with its config's options; a
    context past its positions, another family, an option that differs are refused in one line."""
    from distlab.models import build_model, options_from
    from distlab.train import TrainConfig
    options = options_from("llama", {"n_embd": 32, "kv_heads": 1})
    model = build_model("llama", (32,), 256, options)
    hf.write(model.state_dict(), "llama", options, 256, 32, tmp_path)
    flags = dict(init_from=f"hf:{tmp_path}", dataset="synthetic-text:2000", max_steps=1, progress=False)
    cfg = TrainConfig.from_flags(**flags, block_size=16).validate(1)
    assert cfg.model == "llama" and cfg.options.kv_heads == 1 and cfg.options.n_embd == 32
    for extra, message in [(dict(block_size=64), "`block_size` 64 is longer than the 32 positions"),
                           (dict(model="gpt", block_size=16), "is a llama model: give `model` llama"),
                           (dict(model="llama", n_embd=64, block_size=16), "`n_embd` 64 differs from")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_flags(**flags, **extra).validate(1)


CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_chat_records_are_rendered_by_the_models_template_as_transformers_renders_them(tmp_path):
    """sft: chat records (messages) through the directory's chat_template, the same text as transformers'
    apply_chat_template; the targets are the last reply's tokens and the template's end of turn only."""
    from distlab.data import load_dataset
    from distlab.data.chat import ChatTemplate
    from distlab.models import IGNORE_INDEX
    tok = _tokenizer_dir(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    talks = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"the fox {i}?"},
              {"role": "assistant", "content": "the quick dog"}] for i in range(20)]
    theirs = _transformers().AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    mine = ChatTemplate.from_dir(tmp_path / "model")
    for talk in talks[:2]:
        for prompt in (False, True):
            assert mine.render(talk, prompt) == theirs.apply_chat_template(talk, tokenize=False,
                                                                           add_generation_prompt=prompt)
    with pytest.raises(ConfigError, match="refused a conversation: unknown role tool"):
        mine.render([{"role": "tool", "content": "x"}])
    (tmp_path / "named").mkdir()  # the other places a directory keeps it: named templates, chat_template.jinja
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHAT}]}))
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    assert ChatTemplate.from_dir(tmp_path / "named").render(talks[0]) == mine.render(talks[0]).replace("<s>", "")
    assert ChatTemplate.from_dir(tmp_path / "file").render(talks[0]) == "be brief"
    assert ChatTemplate.from_dir(tmp_path) is None
    records = tmp_path / "chat.jsonl"
    records.write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks))
    data = load_dataset(f"sft:{records}", "train", block_size=128, tokenizer=f"hf:{tmp_path / 'model'}")
    x, y = data.batch(torch.arange(len(data)))
    reply = tok.encode("the quick dog</s>").ids  # the reply and the template's end of turn: no second EOS
    assert y[0][y[0] != IGNORE_INDEX].tolist() == reply and reply[-1] == tok.token_to_id("</s>")
    prompt = tok.encode(mine.render(talks[0][:-1], True)).ids
    assert x[0, :len(prompt)].tolist() == prompt and x[0, 0] == tok.token_to_id("<s>")
    with pytest.raises(ConfigError, match="are rendered by a model's chat template: give --tokenizer hf:DIR"):
        load_dataset(f"sft:{records}", "train", block_size=128)


def test_a_text_starts_with_the_tokenizers_begin_token_as_transformers_tokenizes_it(tmp_path, run_cli, refused_here):
    """A tokenizer whose post-processor puts <s> before a text (Llama's, Mistral's): generate's prompt, an SFT
    prompt and every prepared document start with it, so distlab generate prints transformers' greedy text
    for tokenizer(prompt) -- it never added it; a checkpoint with its own tokenizer given bytes is refused."""
    from tokenizers import Tokenizer, processors
    from distlab.data import load_dataset
    from distlab.data.prepare import prepare
    from distlab.data.tokenizer import HFTokenizer
    _saved("LlamaForCausalLM", tmp_path / "m", vocab_size=320)
    _tokenizer_dir(tmp_path / "m")
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    assert HFTokenizer.from_dir(str(tmp_path / "m")).begin == (bos,)
    mine = run_cli("generate", f"hf:{tmp_path / 'm'}", "--prompt", "the fox", "--temperature", "0",
                   "--max-new-tokens", "6", check=True).stdout
    transformers = _transformers()
    theirs_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ids = theirs_tok("the fox", return_tensors="pt")["input_ids"]
    assert ids[0, 0] == bos
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=theirs_tok.eos_token_id)[0, ids.shape[1]:]
    assert mine == "the fox" + theirs_tok.decode(out.tolist(), skip_special_tokens=True) + "\n"
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"prompt": f"the fox {i}", "completion": " dog"}) + "\n"
                                               for i in range(10)))
    x, _ = load_dataset(f"sft:{tmp_path / 'qa.jsonl'}", "train", block_size=32,
                        tokenizer=f"hf:{tmp_path / 'm'}").batch(torch.arange(2))
    assert x[:, 0].tolist() == [bos, bos]
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"the fox {i}" for i in range(12)) + "\n")
    manifest = prepare(tmp_path / "corpus.txt", tmp_path / "tok", f"hf:{tmp_path / 'm'}", progress=False)
    train = np.fromfile(tmp_path / "tok" / "train.bin", dtype=manifest["dtype"])
    assert train[0] == bos and int((train == bos).sum()) == manifest["splits"]["train"]["documents"]
    proc = refused_here("train", "--init-from", f"hf:{tmp_path / 'm'}", "--dataset", "synthetic-text:2000",
                        "--block-size", "16")
    assert f"give --tokenizer hf:{tmp_path / 'm'}" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_checkpoint_without_a_tokenizer_whose_vocabulary_is_not_bytes_needs_one(refused_here, run_cli, tmp_path):
    """A pretrained model of 1,000 tokens whose directory holds no tokenizer.json: training it on text without
    --tokenizer fed it byte ids as if they were its tokens (rc 0); now refused in one line naming --tokenizer.
    A byte-level checkpoint (256 tokens) and a prepared corpus of ids still train."""
    _saved("LlamaForCausalLM", tmp_path / "big", vocab_size=1000)
    proc = refused_here("train", "--init-from", f"hf:{tmp_path / 'big'}", "--dataset", "synthetic-text:2000",
                        "--block-size", "16", "--max-steps", "1")
    assert "has a vocabulary of 1,000 tokens and no tokenizer.json" in proc.stderr and "--tokenizer hf:DIR" in \
        proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    _saved("LlamaForCausalLM", tmp_path / "bytes")
    run_cli("train", "--init-from", f"hf:{tmp_path / 'bytes'}", "--dataset", "synthetic-text:2000", "--block-size",
            "16", "--global-batch-size", "8", "--max-steps", "1", "--no-progress", "--out", str(tmp_path / "run"),
            check=True)
