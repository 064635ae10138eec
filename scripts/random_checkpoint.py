"""Write a Hugging Face checkpoint of a published model's shape with random weights, saved by ``transformers``
(an optional extra; training never imports it): what ``distlab bench load`` reads.

    python scripts/random_checkpoint.py llama-3.2-1b /tmp/llama-3.2-1b

Shapes: ``llama-3.2-1b`` (16 layers x 2048, 32 query / 8 key-value heads, SwiGLU 8192, vocabulary 128,256,
tied embeddings, bfloat16: 1,235,814,400 parameters), ``qwen3-1.7b`` (Qwen3: 28 layers x 2048, 16 query / 8
key-value heads of 128, q/k norms, SwiGLU 6144, vocabulary 151,936, tied embeddings, bfloat16) and ``tiny``
(the Llama family, 2 layers x 64).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path, help="a new directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty: name a new directory")
    import torch
    import transformers
    torch.manual_seed(args.seed)
    family = "Qwen3" if args.shape.startswith("qwen3") else "Llama"
    config = getattr(transformers, f"{family}Config")(**SHAPES[args.shape], torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)  # made in bfloat16: never the float32 model in memory
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters, bfloat16")


if __name__ == "__main__":
    main()
