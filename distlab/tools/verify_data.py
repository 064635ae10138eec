"""What :mod:`distlab.tools.verify`'s single-process reference reads besides a model and a batch: DPO's
reference log-probabilities and its loss, and the generated fine-tuning records ``+pack`` packs."""

from __future__ import annotations

import torch


def packing_records(n: int = 160) -> str:
    """``sft:FILE`` of ``n`` generated prompt/completion records of 4 to 13 bytes (written once, atomically, in
    the temporary directory): +pack's data, several records to a window of 16 tokens."""
    import json
    import random
    import tempfile
    from pathlib import Path
    from distlab.train.metrics import atomic_write_text
    rng = random.Random(0)
    lines = [json.dumps({"prompt": f"{i % 10}:", "completion": "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 10)))})
             for i in range(n)]
    path = Path(tempfile.gettempdir()) / f"distlab-verify-records-{n}.jsonl"
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)
    return f"sft:{path}"


@torch.no_grad()
def reference_logps(model: torch.nn.Module, data) -> torch.Tensor:
    """Each target's log-probability under ``model`` in evaluation mode, per place of ``data``'s stream (one
    process, every pair in one batch): DPO's reference."""
    from distlab.models import IGNORE_INDEX, task_loss
    was = model.training
    model.eval()
    x, y = data.with_positions().batch(torch.arange(len(data)))
    target = y[..., 0].long()
    kept = target != IGNORE_INDEX
    found = torch.zeros(len(data.tokens))
    found[y[..., 1].long()[kept]] = -task_loss(model(x), target, reduction="none").reshape(target.shape)[kept]
    model.train(was)
    return found


def dpo_mean(beta: float):
    """DPO's loss of a batch of pairs, the mean over them (``label_smoothing`` ignored: refused with pairs)."""
    from distlab.models import task_loss
    from distlab.train.preference import pair_scores, token_logps

    def loss(out, y, label_smoothing=0.0):
        logps, reference = token_logps(task_loss, out, y)
        return pair_scores(logps, reference.to(logps.dtype), beta)[0].mean()
    return loss
