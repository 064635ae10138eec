"""Learning sums from a reward: a small GPT fine-tuned on 2,000 sums (``sft:``), then GRPO on 2,000 others with
the exact-answer reward on 2 ranks -- the commands a user types, the reward over the steps plotted.

    python scripts/grpo_walkthrough.py --out results/grpo-sums [--steps 200] [--nproc 2]
    python scripts/grpo_walkthrough.py --hf --out results/grpo-sums-hf-lora-tp2

``--hf``: the same from a Hugging Face checkpoint -- the fine-tuned GPT exported with ``distlab export --format hf``
(a GPT-2 checkpoint ``transformers`` loads) -- with LoRA adapters on tensor parallel 2 (the base frozen, the KL's reference the
base with its adapters off).

Writes OUT/sft.jsonl and OUT/rl.jsonl (the sums), OUT/sft/ and OUT/grpo/ (the runs), OUT/walkthrough.json (the
starting model's greedy test reward, each evaluation's, the rollouts' reward per logged step) and OUT/reward.png.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

MODEL = ["--model", "gpt", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "12"]


def sums(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(n)]


def distlab(*args: str) -> None:
    print("$ distlab " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "distlab", *args], check=True)


def greedy_reward(out: Path, hf_dir: Path | None = None) -> float:
    """The SFT model's (``hf_dir``: as exported) exact-answer reward on the test prompts, greedy -- GRPO's start."""
    import torch

    from distlab.data.rl import load_prompts
    from distlab.models import GPT
    from distlab.train import rollout
    from distlab.train.rewards import exact
    from safetensors.torch import load_file
    data = load_prompts(f"rl:{out / 'rl.jsonl'}", "test", 12)
    if hf_dir is not None:
        from distlab.models import hf
        model, _ = hf.build(hf_dir, 12)
    else:
        state = load_file(str(out / "sft" / "model.safetensors"))
        with torch.device("meta"):
            model = GPT(256, 12, 2, 4, 64)
        model.load_state_dict(state, assign=True)
    total = 0.0
    for number, prompt in enumerate(data.prompts):
        done, _, _ = rollout.complete(model.eval(), prompt, 1, 13 - len(prompt), 0.0, 1.0, data.stops, 0)
        total += exact(data.tokenizer.decode([t for t in done[0] if t not in data.stops]), data.fields[number])
    return total / len(data.prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/grpo-sums")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hf", action="store_true",
                        help="From an exported Hugging Face checkpoint, LoRA on tensor parallel 2 (module docstring).")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": f"{a + b}\n"}) + "\n"
                                           for a, b in sums(2000, 1)))
    (out / "rl.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                          for a, b in sums(2000, 2)))
    distlab("train", *MODEL, "--dataset", f"sft:{out / 'sft.jsonl'}", "--global-batch-size",
            "32", "--max-steps", "300", "--lr", "3e-3", "--optimizer", "adamw", "--lr-schedule", "constant",
            "--log-every", "50", "--no-progress", "--out", str(out / "sft"))
    if args.hf:  # the fine-tuned model as a Hugging Face checkpoint, then GRPO from it: LoRA on tensor parallel 2
        distlab("export", str(out / "sft"), "--format", "hf", "--out", str(out / "hf"))
        start = greedy_reward(out, out / "hf")
        model = ["--init-from", f"hf:{out / 'hf'}", "--block-size", "12", "--lora", "r=8,alpha=16,targets=q,k,v,o",
                 "--kl-beta", "0.02", "--tp", "2", "--lr", "3e-3"]
    else:
        start = greedy_reward(out)
        model = [*MODEL, "--init-from", str(out / "sft" / "model.safetensors"), "--lr", "1e-3"]
    distlab("train", *model, "--dataset", f"rl:{out / 'rl.jsonl'}",
            "--reward", "exact", "--group-size", "8", "--max-new-tokens", "4", "--global-batch-size", "16",
            "--max-steps", str(args.steps), "--optimizer", "adamw", "--lr-schedule", "constant",
            "--log-every", "10", "--eval-every", "50", "--no-progress", "--nproc-per-node", str(args.nproc),
            "--out", str(out / "grpo"))
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [(0, start)] + [(e["step"], e["test_reward"]) for e in summary["evals"]]
    rollouts = [(m["step"], m["reward"]) for m in metrics if "reward" in m]
    (out / "walkthrough.json").write_text(json.dumps({"kind": "distlab-grpo-walkthrough", "test_reward_greedy": evals, "rollout_reward": rollouts,
                                                      "time_per_step_s_median": summary["time_per_step_s_median"],
                                                      "date": summary["date"], "world_size": summary["world_size"],
                                                      "strategy": summary.get("strategy"), "hf_lora_tp2": args.hf},
                                                     indent=1))
    from distlab.tools.plots import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(*zip(*rollouts), label="rollouts (sampled, temperature 1)")
    ax.plot(*zip(*evals), marker="o", linestyle="--", label="test prompts (greedy)")
    ax.set(xlabel="GRPO step", ylabel="exact-answer reward", ylim=(0, 1), title="sums: GRPO after SFT, 2 ranks"
           + (" (HF checkpoint, LoRA, TP 2)" if args.hf else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)
    print(f"greedy test reward: {' -> '.join(f'{r:.3f} (step {s})' for s, r in evals)}")


if __name__ == "__main__":
    main()
