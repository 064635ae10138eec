"""``distlab bench finetune`` and ``distlab bench packing`` (distlab.bench.finetune): each writes its JSON
and table, and what they measure moves the way the variants say it must."""

from __future__ import annotations

import json


def test_bench_finetune_and_packing_write_their_records(run_cli, tmp_path):
    """A LoRA fine-tune holds less model state per rank than training every weight (no gradients or
    optimizer state for the base), and a bf16 base less again; packing the same records fills fewer windows
    with the same record tokens."""
    from tests.test_hf import _saved
    _saved("LlamaForCausalLM", tmp_path / "base")
    run_cli("bench", "finetune", "--init-from", f"hf:{tmp_path / 'base'}", "--steps", "2", "--runs", "1",
            "--block-size", "16", "--out", str(tmp_path / "f"), check=True)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "f" / "finetune.json").read_text())}
    state = {k: r["model_state_bytes_per_rank"] for k, r in rows.items()}
    assert state["lora-bf16"] < state["lora"] < state["full"], state
    proc = run_cli("bench", "packing", "--records", "40", "--block-size", "96", "--runs", "1", "--out",
                   str(tmp_path / "p"), check=True)
    modes = {r["mode"]: r for r in json.loads((tmp_path / "p" / "packing.json").read_text())}
    assert modes["packed"]["windows"] < modes["padded"]["windows"]
    assert modes["packed"]["real_tokens"] == modes["padded"]["real_tokens"]
    assert "packed / padded" in proc.stdout
