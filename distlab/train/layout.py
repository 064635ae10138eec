"""What a snapshot must agree on to be resumed by a run: its layout, compared field by field at resume."""

from __future__ import annotations

from distlab.train.optim import decay_groups


def run_layout(trainer) -> dict:
    """``trainer``'s layout: world size, model and its sizes, adapters, data, strategy, batch, optimizer and
    schedule (compiling changes how the blocks run, not the state: a snapshot resumes with or without it)."""
    cfg = trainer.cfg
    return {"world_size": trainer.rt.world_size, "model": cfg.model,
            **({"model_args": list(cfg.model_args)} if cfg.model_args else {}),
            **trainer.model_record,
            **({"lora": cfg.lora.text()} if cfg.lora is not None else {}),
            **({"base_dtype": cfg.base_dtype} if cfg.base_dtype != "float32" else {}),
            "num_parameters": trainer.num_parameters, "dataset": cfg.dataset,
            **({"vocab_size": cfg.vocab_size} if cfg.vocab_size else {}),
            **({"tokenizer": trainer.tokenizer.spec, "tokenizer_sha256": trainer.tokenizer.sha256}
               if trainer.tokenizer is not None and trainer.tokenizer.sha256 else {}),
            # compiling changes how the blocks run, not the state: a snapshot resumes with or without it
            "strategy": {k: v for k, v in cfg.strategy.to_dict().items()
                         if k not in ("compile", "compile_backend")},
            "global_batch_size": cfg.global_batch_size, "optimizer": cfg.optimizer, "seed": cfg.seed,
            "val_fraction": cfg.val_fraction, "lr": cfg.lr, "lr_schedule": cfg.lr_schedule,
            "lr_scaling": cfg.lr_scaling, "base_batch_size": cfg.base_batch_size, "warmup_steps": cfg.warmup_steps,
            "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
            **({"clip_grad_norm": cfg.clip_grad_norm} if cfg.clip_grad_norm else {}),
            **({"label_smoothing": cfg.label_smoothing} if cfg.label_smoothing else {}),
            **({"weight_decay_groups": "no decay on biases, norms, embeddings"} if decay_groups(cfg) else {}),
            # a schedule that decays over the run depends on its length: changing it would bend the curve
            **({"total_steps": trainer.total_steps} if cfg.lr_schedule != "constant" else {})}
