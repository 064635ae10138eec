"""What a language model's run shows and leaves beyond its metrics: a text it generates now and then
(``--sample-every``), and -- where it keeps no snapshots -- its final model as one file."""

from __future__ import annotations

from pathlib import Path

from distlab.models import build_model, is_user_model, lora
from distlab.models.plans import assign_state
from distlab.runtime.meta import on_meta_device
from distlab.train.export import write_state
from distlab.train.loading import FINAL_MODEL
from distlab.train.metrics import atomic_write_text
from distlab.train.snapshot import broadcast_object


def sample(trainer, tokens: int = 48) -> str:
    """A short text the model generates now, the same on every rank (collective: the whole model
    is gathered; rank 0 samples, seeded by the run's seed and step, apart from the run's own random
    streams, then tells the others)."""
    from distlab.models.generation import generate
    cfg = trainer.cfg
    state = {k: v.detach().float().cpu() for k, v in trainer.engine.full_state_dict().items()}
    text = None
    if trainer.rt.is_main:
        with on_meta_device():  # built without initialising: the run's random streams are untouched
            model = build_model(cfg.model, trainer.train_set.input_shape, trainer.train_set.num_classes,
                                **cfg.model_options())
            if cfg.lora is not None:  # the adapters as the run computes with them
                lora.apply(model, cfg.lora)
        assign_state(model, state)
        text = generate(model.eval(), "", tokens, temperature=0.8, top_k=None, seed=cfg.seed + trainer.run.step,
                        tokenizer=trainer.tokenizer)
    return broadcast_object(text)


def final_model(trainer) -> str | None:
    """A language model's run that keeps no snapshots still leaves its model: ``OUT/model.safetensors``
    (the whole model, gathered from any layout; ``distlab generate OUT`` and ``distlab export OUT``
    read it, with ``OUT/tokenizer.json``). Returns its path on rank 0 (None where nothing was written,
    and on the other ranks). Collective."""
    cfg = trainer.cfg
    if not cfg.out or cfg.snapshot_dir or not trainer.train_set.predicts_tokens or is_user_model(cfg.model):
        return None
    state = {k: v.detach().cpu() for k, v in trainer.engine.full_state_dict().items()}
    if not trainer.rt.is_main:
        return None
    path = Path(cfg.out) / FINAL_MODEL
    carried = {"hf": trainer.run.attachments["hf"]} if "hf" in trainer.run.attachments else {}
    write_state(state, {**trainer.run.layout, "step": trainer.run.step, **carried}, path)
    return str(path)


def attachments(cfg, tokenizer) -> dict:
    """What a text run's snapshots carry beside the state: the tokenizer that made its tokens (``tokenizer_json``)
    and what an export of a Hugging Face model must say again (``hf``: :func:`carried`); {} for images."""
    made = tokenizer.to_json() if tokenizer is not None else None
    kept = carried(cfg, tokenizer)
    return {**({"tokenizer_json": made} if made else {}), **({"hf": kept} if kept else {})}


def write_tokenizer(out: str | None, tokenizer) -> None:
    """``OUT/tokenizer.json``, which ``distlab generate`` reads (a text run's on rank 0; nothing otherwise)."""
    if out and tokenizer is not None and tokenizer.to_json():
        atomic_write_text(Path(out) / "tokenizer.json", tokenizer.to_json())


def carried(cfg, tokenizer) -> dict | None:
    """What a run started from Hugging Face files keeps for its export to ship (:func:`distlab.models.hf.carried`):
    the checkpoint's token ids, generation config and dtype, the files beside the tokenizer it read with --
    from ``--init-from hf:DIR``, ``--tokenizer hf:DIR`` or the prepared corpus; None for a run without any."""
    if cfg.kept() is not None:  # resumed where the directory is gone: what its snapshot kept of it
        return cfg.kept()
    dirs = [s[3:] for s in (cfg.tokenizer, cfg.init_from) if isinstance(s, str) and s.startswith("hf:")]
    dirs += [cfg.dataset.split(":", 1)[1]] if cfg.dataset.startswith("tokens:") else []
    model_dir = cfg.init_from[3:] if isinstance(cfg.init_from, str) and cfg.init_from.startswith("hf:") else None
    if model_dir is None and not any(d for d in dirs if (Path(d) / "tokenizer.json").is_file()):
        return None
    from distlab.models import hf
    return hf.carried(model_dir, dirs, tokenizer.sha256 if tokenizer is not None else None)
