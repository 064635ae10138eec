"""What a log step records (a line of ``metrics.jsonl``, TensorBoard's scalars) and the line rank 0 prints."""

from __future__ import annotations

from distlab.train import language


def step_record(trainer, epoch: int, lr: float, loss: float, rate: float | None, sample: bool,
                evaluation: dict | None, end_of_run: bool) -> dict:
    """The record of the step ``trainer`` is at: its loss over the window, learning rate, throughput, time --
    and, where the run has them, DPO's window of rewards (collective), the gradient norm, a generated sample
    (collective) and the evaluation of this step."""
    record = {"step": trainer.run.step, "epoch": epoch, "loss": loss, "lr": lr, "samples_per_s": rate,
              **trainer.throughput.of_rate(rate), "time_s": trainer.run.time_used()}
    record.update(trainer.objective.window())  # (collective)
    if trainer._grad_norm is not None:  # read once per log line, not per step
        record["grad_norm"] = float(trainer._grad_norm)
    if end_of_run:
        record["end_of_run"] = True
    if sample:
        record["sample"] = language.sample(trainer)
    if evaluation:
        record.update((k, v) for k, v in evaluation.items() if k.startswith(("test_", "val_")))
    return record


def step_words(record: dict, total_steps: int, throughput) -> str:
    """``step  20/937 | epoch 0 | loss 0.5123 | lr 0.05 | 3,210 samples/s`` (and the norm, DPO's rewards, GRPO's)."""
    norm = f" | grad norm {record['grad_norm']:.3g}" if "grad_norm" in record else ""
    norm += (f" | reward margin {record['reward_margin']:.4f}, {100 * record['reward_accuracy']:.1f}% preferred"
             if "reward_margin" in record else "")
    norm += f" | reward {record['reward']:.3f}, {record['completion_length']:.1f} tokens" if "reward" in record else ""
    norm += (f" | kl {record['kl']:.2g}, clipped {100 * record['clip_fraction']:.1f}%" if "clip_fraction" in record
             else "")
    return (f"step {record['step']:>6}/{total_steps} | epoch {record['epoch']} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.4g}{norm} | {record['samples_per_s'] or 0:,.0f} samples/s{throughput.words(record)}")
