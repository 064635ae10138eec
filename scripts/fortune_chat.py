"""What the fine-tuning walkthrough (docs/fine-tuning.md) starts from, made here because nothing is downloaded:

    python scripts/fortune_chat.py model /usr/share/games/fortunes base   # a chat model's directory
    python scripts/fortune_chat.py data /usr/share/games/fortunes data    # chats and preference pairs

``model``: a Hugging Face directory as a download gives it -- a randomly initialised Llama (4 layers x 128,
2 key/value heads, SwiGLU 384, context 256) saved by ``transformers``, a 2,048-token byte-level BPE learned
from the fortunes with ChatML's special tokens, and ChatML's chat template (Qwen's turn markers:
``<|im_start|>user ... <|im_end|>``) in ``tokenizer_config.json``; ``<|im_end|>`` ends a turn.

``data``: from Debian's fortunes package (``apt-get install fortunes``), one topic per file:
``chat.jsonl``, a user asking for a fortune about a topic and the assistant answering with one of that
topic's fortunes (at most 240 characters); ``pairs.jsonl``, the same question answered with a fortune
(chosen) and with the same fortune's words shuffled (rejected) -- preferring text that reads. (Preferring
the topic asked for, a fortune of another topic rejected, is the realistic contrast; a model this small
did not learn it in a few hundred steps: held-out preference accuracy stayed at 50.65%.)
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

TOPICS = ("computers", "science", "food", "law", "education", "art", "kids", "love", "politics", "sports")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def fortunes(path: Path) -> list[str]:
    text = path.read_bytes().decode("utf-8", "replace").replace("\r\n", "\n")
    return [f.strip("\n") for f in re.split(r"(?m)^%\n", text + "\n") if f.strip()]


def model(source: Path, out: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out.mkdir(parents=True, exist_ok=False)
    texts = [f for p in sorted(source.iterdir()) if p.is_file() and p.suffix not in (".dat", ".u8")
             for f in fortunes(p)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    end, turn = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=384,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, eos_token_id=[end, turn], bos_token_id=None,
                                      pad_token_id=end)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    print(f"wrote {out}: a {sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters()):,}-parameter "
          f"Llama, a {tok.get_vocab_size():,}-token BPE, ChatML's template")


def data(source: Path, out: Path, limit: int = 240) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    by_topic = {t: [f for f in fortunes(source / t) if len(f) <= limit] for t in TOPICS if (source / t).is_file()}
    ask = lambda topic: [{"role": "user", "content": f"Tell me a fortune about {topic}."}]  # noqa: E731
    chats, pairs = [], []
    for topic, mine in by_topic.items():
        for fortune in mine:
            chats.append({"messages": ask(topic) + [{"role": "assistant", "content": fortune}]})
            words = fortune.split()
            rng.shuffle(words)
            pairs.append({"prompt": ask(topic), "chosen": [{"role": "assistant", "content": fortune}],
                          "rejected": [{"role": "assistant", "content": " ".join(words)}]})
    rng.shuffle(chats)
    rng.shuffle(pairs)
    for name, rows in (("chat.jsonl", chats), ("pairs.jsonl", pairs)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}/chat.jsonl ({len(chats):,} chats) and pairs.jsonl ({len(pairs):,} pairs) over "
          f"{len(by_topic)} topics: " + ", ".join(f"{t} {len(f)}" for t, f in by_topic.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("model", "data"))
    parser.add_argument("source", type=Path, help="the fortunes' directory (/usr/share/games/fortunes)")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    (model if args.what == "model" else data)(args.source, args.out)


if __name__ == "__main__":
    main()
