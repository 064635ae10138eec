import pytest
import torch

from distlab.errors import ConfigError
from distlab.models import build_model, count_parameters, is_text_model, model_names


@pytest.mark.parametrize("name", [n for n in model_names() if not is_text_model(n)])  # gpt: tests/test_text.py
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
def test_every_model_maps_images_to_logits_and_trains(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 7)
    x = torch.randn(4, *shape)
    out = model(x)
    assert out.shape == (4, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_known_sizes():
    # Parameter counts follow from the architectures (VGG-11 conv stack + 512-512-10 classifier).
    assert count_parameters(build_model("mlp", (1, 28, 28), 10)) == 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    assert count_parameters(build_model("resnet18", (3, 32, 32), 10)) == 11_173_962
    assert count_parameters(build_model("mlp", (1, 28, 28), 10, widths=(16,))) == 784 * 16 + 16 + 16 * 10 + 10


def test_batchnorm_variants_have_batchnorm():
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in build_model("vgg11-bn", (3, 32, 32), 10).modules())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in build_model("vgg11", (3, 32, 32), 10).modules())


def test_unknown_model():
    with pytest.raises(ConfigError, match="unknown model 'vgg13'.*mlp"):
        build_model("vgg13", (3, 32, 32), 10)


@pytest.mark.parametrize("name", model_names())
def test_the_layers_a_pipeline_cuts_compute_the_model(name):
    """Applied one after another, ``sequential_layers`` give the model's own output (so a pipeline
    of any registered model computes that model), and hold every parameter once (a tied head's twice)."""
    from distlab.parallel.pipeline import sequential_layers
    torch.manual_seed(0)
    shape, classes = ((16,), 256) if is_text_model(name) else ((3, 32, 32), 10)
    model = build_model(name, shape, classes).eval()
    x = torch.randint(0, 256, (2, 16)) if is_text_model(name) else torch.randn(2, *shape)
    layers = sequential_layers(model)
    out = x
    for _, layer in layers:
        out = layer(out)
    assert torch.equal(out, model(x))
    held = [id(p) for _, layer in layers for p in layer.parameters()]
    assert set(held) == {id(p) for p in model.parameters()}
    # once each -- but a tied LM head's matrix, the embedding's, which the first and last layers both hold
    tied = {id(model[0].tok.weight)} if getattr(model, "tie_embeddings", False) else set()
    assert {i for i in held if held.count(i) > 1} == tied


def test_a_models_snapshot_record_is_the_one_snapshots_so_far_carry():
    """The model declares the sizes a snapshot must agree on (snapshot_record); the record is, key for
    key, the one every snapshot written so far carries -- so they still resume."""
    from distlab.models import snapshot_record
    assert snapshot_record(build_model("mlp", (1, 8, 8), 4, widths=(32, 16))) == {"mlp_widths": [32, 16]}
    assert snapshot_record(build_model("small-cnn-bn", (3, 8, 8), 4)) == {"mlp_widths": None}
    moe = build_model("gpt-moe", (16,), 256, n_layer=1, n_head=2, n_embd=8, experts=4, top_k=2, capacity_factor=1.5,
                      aux_coef=0.01)
    assert snapshot_record(moe) == {"mlp_widths": None, "n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 16,
                                    "experts": 4, "top_k": 2, "capacity_factor": 1.5, "aux_coef": 0.01}
    assert snapshot_record(build_model("gpt", (16,), 256, n_layer=1, n_head=2, n_embd=8)) == {
        "mlp_widths": None, "n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 16}
