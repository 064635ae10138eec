"""What an optimizer makes of a model's parameters, by their names: the weights AdamW decays and those it leaves
alone, and the matrices Muon orthogonalises (the training layer builds the optimizer from these, the planner prices
its state from the same sets)."""

from __future__ import annotations

from torch import nn


NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, *([nn.RMSNorm] if hasattr(nn, "RMSNorm") else []))


def no_decay_names(model: nn.Module) -> set[str]:
    """The parameters AdamW's weight decay leaves alone (GPT-2's and minGPT's convention): biases, the
    norms' scales and shifts, and embeddings -- every parameter but the weights of matrix
    multiplications (linear and convolution weights, a mixture of experts' stacked weights). Names are
    ``model``'s: the whole model's, before a layout cuts it."""
    skip = set()
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, (nn.Embedding, *NORMS)) or name.endswith("bias") or p.dim() < 2:
                skip.add(f"{prefix}.{name}" if prefix else name)
    return skip


def matrix_names(model: nn.Module) -> set[str]:
    """The parameters Muon steps (by ``model``'s names): the weights of its matrix multiplications -- linear and
    convolution weights, stacked experts -- but the embeddings and the output layer (the last ``nn.Linear``), which
    AdamW steps with the norms and the biases (:mod:`distlab.train.muon`)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = {id(linears[-1].weight)} if linears else set()
    return {name for name, p in model.named_parameters() if p.dim() >= 2 and id(p) not in head} - no_decay_names(model)
