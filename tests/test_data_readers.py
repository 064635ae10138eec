import gzip
import os
import pickle

import numpy as np
import pytest
import torch

from distlab.data import canonical_name, load_dataset, locate
from distlab.data.cifar import write_cifar_batch
from distlab.data.idx import read_idx, write_idx
from distlab.data.synthetic import make_synthetic
from distlab.tools.verify import sum_tolerance
from distlab.data.transforms import normalize, random_crop_flip
from distlab.errors import ConfigError, DataNotFoundError


def _write_mnist_like(d, n_train=12, n_test=5, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        ext = ".gz" if gz else ""
        write_idx(d / f"{prefix}-images-idx3-ubyte{ext}", images)
        write_idx(d / f"{prefix}-labels-idx1-ubyte{ext}", labels)
        out[prefix] = (images, labels)
    return out


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip_matches_the_bytes_of_the_format(tmp_path, gz):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("x.idx.gz" if gz else "x.idx")
    write_idx(path, arr)
    raw = gzip.open(path).read() if gz else path.read_bytes()
    # magic 0x00000803 (uint8, 3 dims), then big-endian sizes 2, 3, 4, then the data
    assert raw[:16] == bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4])
    assert np.array_equal(read_idx(path), arr)


def test_idx_truncated_and_bad_magic_are_refused(tmp_path):
    path = tmp_path / "t.idx"
    write_idx(path, np.zeros((4, 5), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ConfigError, match="truncated"):
        read_idx(path)
    path.write_bytes(b"\x12\x34\x08\x01" + b"\x00" * 8)
    with pytest.raises(ConfigError, match="not an IDX file"):
        read_idx(path)


@pytest.mark.parametrize("name,sub", [("fashion-mnist", "fashion-mnist"), ("mnist", "MNIST/raw")])
@pytest.mark.parametrize("gz", [True, False])
def test_mnist_family_loads_from_idx_files(tmp_path, name, sub, gz):
    written = _write_mnist_like(tmp_path / sub, gz=gz)
    train = load_dataset(name, "train", data_dir=tmp_path)
    test = load_dataset(name, "test", data_dir=tmp_path)
    assert len(train) == 12 and len(test) == 5 and train.input_shape == (1, 28, 28)
    assert torch.equal(train.images[:, 0], torch.from_numpy(written["train"][0]))
    assert torch.equal(test.labels, torch.from_numpy(written["t10k"][1].astype(np.int64)))
    x, y = train.batch(torch.tensor([3]))
    mean, std = train.mean[0], train.std[0]
    assert torch.allclose(x[0, 0], (torch.from_numpy(written["train"][0][3]).float() / 255 - mean) / std)


def _write_cifar(root, name, n_per_batch=4, seed=0):
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        d = root / "cifar-10-batches-py"
        files, key, k = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], "labels", 10
    else:
        d = root / "cifar-100-python"
        files, key, k = ["train", "test"], "fine_labels", 100
    d.mkdir(parents=True)
    written = {}
    for f in files:
        images = rng.integers(0, 256, (n_per_batch, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, k, n_per_batch)
        write_cifar_batch(d / f, images, labels, label_key=key)
        written[f] = (images, labels)
    return written


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_reads_python_pickle_batches(tmp_path, name):
    written = _write_cifar(tmp_path, name)
    train = load_dataset(name, "train", data_dir=tmp_path)
    test = load_dataset(name, "test", data_dir=tmp_path)
    first_train = "data_batch_1" if name == "cifar10" else "train"
    n_train = 4 * (5 if name == "cifar10" else 1)
    assert len(train) == n_train and len(test) == 4 and train.input_shape == (3, 32, 32)
    assert torch.equal(train.images[:4], torch.from_numpy(written[first_train][0]))
    assert train.labels[:4].tolist() == list(written[first_train][1])
    assert train.augment and not test.augment and train.num_classes == (10 if name == "cifar10" else 100)


def test_cifar_pickle_that_would_run_code_is_refused(tmp_path):
    d = tmp_path / "cifar-100-python"
    d.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    for f in ("train", "test"):
        (d / f).write_bytes(pickle.dumps({b"data": Evil(), b"fine_labels": []}, protocol=2))
    with pytest.raises(ConfigError, match="refusing to load"):
        load_dataset("cifar100", "train", data_dir=tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_missing_dataset_names_package_paths_and_alternative(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_SYSTEM_DATASETS", str(tmp_path / "system"))
    monkeypatch.delenv("DISTLAB_DATA", raising=False)
    with pytest.raises(DataNotFoundError) as err:
        locate("fashion-mnist", tmp_path / "mine")
    msg = str(err.value)  # a named directory is the only one searched
    assert "dataset-fashion-mnist" in msg and str(tmp_path / "mine") in msg and str(tmp_path / "system") not in msg
    assert "--dataset synthetic:1x28x28:10:60000" in msg
    with pytest.raises(DataNotFoundError, match=str(tmp_path / "system")):
        locate("fashion-mnist")
    with pytest.raises(DataNotFoundError, match="cifar-10-batches-py"):
        locate("cifar10", tmp_path)


def test_dataset_env_var_is_searched(tmp_path, monkeypatch):
    _write_mnist_like(tmp_path / "fashion-mnist")
    monkeypatch.setenv("DISTLAB_DATA", str(tmp_path))
    assert locate("fashion-mnist") == tmp_path / "fashion-mnist"


def test_unknown_dataset_and_bad_synthetic_spec():
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'"):
        canonical_name("imagenet")
    with pytest.raises(ConfigError, match="synthetic:CxHxW"):
        canonical_name("synthetic:28x28:10")


def test_synthetic_is_seeded_and_learnable():
    a, b = make_synthetic("synthetic:1x6x6:3:300", "train", seed=1), make_synthetic("synthetic:1x6x6:3:300", "train", seed=1)
    assert torch.equal(a.images, b.images) and len(a) == 300
    test = make_synthetic("synthetic:1x6x6:3:300", "test", seed=1)
    # Nearest class mean (from train) classifies the test split far above chance (1/3).
    means = torch.stack([a.images[a.labels == k].mean(0) for k in range(3)]).flatten(1)
    pred = torch.cdist(test.images.flatten(1), means).argmin(1)
    assert (pred == test.labels).float().mean() > 0.8


def test_normalize_uint8():
    x = torch.tensor([[[[0, 255]]]], dtype=torch.uint8)
    assert torch.allclose(normalize(x, (0.5,), (0.5,)), torch.tensor([[[[-1.0, 1.0]]]]))


def test_random_crop_flip_is_a_crop_of_the_padded_image_or_its_mirror():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    out = random_crop_flip(x, torch.Generator().manual_seed(0), padding=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        candidates = [padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        candidates += [c.flip(-1) for c in candidates]
        assert any(torch.equal(out[i], c) for c in candidates)
    again = random_crop_flip(x, torch.Generator().manual_seed(0), padding=2)
    assert torch.equal(out, again)


# ---------------------------------------------------------------------------------- tensors:FILE

def test_tensors_file_splits_standardises_with_train_statistics_and_reads_npz(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 2, 3, 3, generator=g) * 4 + 7, torch.arange(50) % 5
    torch.save({"inputs": x, "labels": y}, tmp_path / "d.pt")
    train, test = (load_dataset(f"tensors:{tmp_path / 'd.pt'}", s) for s in ("train", "test"))
    assert (len(train), len(test), train.num_classes, train.input_shape) == (45, 5, 5, (2, 3, 3))
    raw = {tuple(v.tolist()) for v in x.flatten(1)}
    mean, std = torch.tensor(train.mean).view(1, -1, 1, 1), torch.tensor(train.std).view(1, -1, 1, 1)
    back = [tuple(v.tolist()) for v in (torch.cat([train.images, test.images]) * std + mean).flatten(1)]
    # rounding only: the mean and std come from sums over a channel's n values (their bound over n), and
    # each value is normalised and restored by two operations each way
    n = train.images[:, 0].numel()
    bound = 4 * sum_tolerance(n, x.abs().max().item()) / n
    assert len(back) == 50 and all(min(abs(torch.tensor(b) - torch.tensor(r)).max().item() for r in raw) <= bound
                                   for b in back[:3])  # every sample once, in one of the splits
    assert train.images.mean(dim=(0, 2, 3)).abs().max() <= bound  # the training split's own statistics
    again = load_dataset(f"tensors:{tmp_path / 'd.pt'}", "test", seed=9)  # the held-out split ignores the run seed
    assert torch.equal(again.images, test.images)
    torch.save({"x": x[:40], "y": y[:40], "x_test": x[40:], "y_test": y[40:]}, tmp_path / "own.pt")
    assert len(load_dataset(f"tensors:{tmp_path / 'own.pt'}", "test")) == 10  # the file's own test split
    np.savez(tmp_path / "u8.npz", images=np.full((20, 4, 4), 255, dtype=np.uint8), labels=np.arange(20) % 2)
    u8 = load_dataset(f"tensors:{tmp_path / 'u8.npz'}", "train")
    assert u8.input_shape == (1, 4, 4) and u8.images.dtype == torch.uint8 and u8.mean == (1.0,)


@pytest.mark.parametrize("content,message", [
    (None, "there is no file"),
    (b"not a pickle", "cannot read it"),
    ({"features": torch.zeros(4, 3)}, "no inputs / x / images among its keys"),
    ({"inputs": torch.zeros(4, 3), "labels": torch.zeros(4)}, "labels must be one class index per sample"),
    ({"inputs": torch.zeros(4, 3), "labels": torch.zeros(3, dtype=torch.long)}, "labels must be one class index"),
    ({"inputs": torch.zeros(4, 3), "labels": -torch.ones(4, dtype=torch.long)}, "class indices 0..K-1"),
    ({"inputs": torch.zeros(4, 3, dtype=torch.bool), "labels": torch.zeros(4, dtype=torch.long)}, "uint8 or floating"),
    ([1, 2], "holds a list, not a dict"),
])
def test_a_bad_tensors_file_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ConfigError, match=message) as info:
        load_dataset(f"tensors:{path}", "train")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def _train_tensors(rank, world, cfg):
    from distlab import runtime
    from distlab.train import Trainer
    trainer = Trainer(cfg, runtime.from_process_group())
    trainer.fit()
    return [p.detach().clone() for p in trainer.engine.full_parameters()]


def test_training_on_a_tensors_file_over_two_ranks_equals_one_process(tmp_path):
    from distlab.launch.spawn import run_ranks
    from distlab.tools.verify import reference_run, tolerance
    from distlab.train import TrainConfig
    g = torch.Generator().manual_seed(1)
    torch.save({"inputs": torch.randn(120, 1, 4, 4, generator=g), "labels": torch.arange(120) % 3}, tmp_path / "d.pt")
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(8,), dataset=f"tensors:{tmp_path / 'd.pt'}", max_steps=5,
                      global_batch_size=12, lr=0.1, lr_schedule="constant", momentum=0.9, seed=2, progress=False,
                      out=str(tmp_path / "run")).validate(2)
    params = run_ranks(_train_tensors, 2, cfg, timeout=120)[0]
    ref, _ = reference_run(cfg)
    assert max((a - b).abs().max().item() for a, b in zip(params, ref)) <= tolerance(cfg)


# ---------------------------------------------------------------------------------- imagefolder:DIR

def _png(path, value, size=(6, 5), mode="L"):
    from PIL import Image
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
    Image.fromarray(np.full(shape, value, dtype=np.uint8), mode=mode).save(path)


def test_imagefolder_reads_class_subfolders_splits_them_and_normalises_with_train_statistics(tmp_path):
    for c, value in (("b_dogs", 200), ("a_cats", 10)):
        for i in range(10):
            _png(tmp_path / "flat" / c / f"{i}.png", value + i)
    (tmp_path / "flat" / "a_cats" / "notes.txt").write_text("not an image: ignored")
    train, test = (load_dataset(f"imagefolder:{tmp_path / 'flat'}", s) for s in ("train", "test"))
    assert (len(train), len(test), train.num_classes, train.input_shape) == (18, 2, 2, (1, 5, 6))
    assert sorted(test.labels.tolist()) == [0, 1]  # a seeded tenth of each class, labels by sorted name
    assert set(train.images[train.labels == 0].flatten().tolist()) <= set(range(10, 20))  # a_cats = 0
    pixels = train.images.float() / 255
    assert train.mean[0] == pytest.approx(pixels.mean().item()) and train.std[0] == pytest.approx(pixels.std().item())
    x, _ = train.batch(torch.arange(len(train)))
    bound = 2 * sum_tolerance(x.numel(), x.abs().max().item()) / x.numel()  # two means over the same pixels
    assert abs(x.mean().item()) <= bound  # normalised with the training split's own statistics
    for split, n in (("train", 3), ("test", 1)):
        for c in ("x", "y"):
            for i in range(n):
                _png(tmp_path / "own" / split / c / f"{i}.png", 50, mode="RGB")
    own = load_dataset(f"imagefolder:{tmp_path / 'own'}", "test")
    assert len(own) == 2 and own.input_shape == (3, 5, 6)  # its own test split, RGB


@pytest.mark.parametrize("case,message", [
    ("missing", "there is no directory"),
    ("one_class", "at least two"),
    ("sizes", "is 7x5, the others 6x5: give every image one size"),
    ("corrupt", r"cannot read .*bad.png \(UnidentifiedImageError"),
    ("empty_class", r"class folder .*/c holds no images .*add some, or remove the folder"),
    ("bomb", r"odd.png is too large to decode safely .*resize it"),
    ("test_only_class", r"class z is in test/ but not in train/: the model would be scored on classes it never saw"),
])
def test_a_bad_imagefolder_is_one_line(tmp_path, monkeypatch, case, message):
    root = tmp_path / "d"
    if case != "missing":
        for c in ("a", "b") if case != "one_class" else ("a",):
            for i in range(3):
                _png(root / c / f"{i}.png", 9)
    if case == "sizes":
        _png(root / "b" / "odd.png", 9, size=(7, 5))
    if case == "corrupt":
        (root / "b" / "bad.png").write_bytes(b"\x89PNG not really")
    if case == "empty_class":
        (root / "c").mkdir()
    if case == "bomb":  # a 20000 x 20000 PNG is what Pillow refuses; its limit lowered, a 7 x 5 one is refused here
        from PIL import Image
        _png(root / "b" / "odd.png", 9, size=(7, 5))
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 15)
    if case == "test_only_class":
        for split, classes in (("train", "ab"), ("test", "abz")):
            for c in classes:
                _png(root / split / c / "0.png", 9)
    with pytest.raises(ConfigError, match=message) as info:
        load_dataset(f"imagefolder:{root}", "train")
    assert "\n" not in str(info.value)


@pytest.mark.timeout(60)
def test_an_imagefolder_skips_what_is_not_a_regular_file_and_says_what_it_cannot_cover(tmp_path):
    root = tmp_path / "d"
    for split, classes in (("train", "abc"), ("test", "ab")):
        for c in classes:
            for i in range(2):
                _png(root / split / c / f"{i}.png", 9)
    os.mkfifo(root / "train" / "a" / "pipe.png")  # reading it would wait for a writer forever
    (root / "train" / "b" / "folder.png").mkdir()
    (root / "train" / ".cache").mkdir()  # hidden: not a class
    train = load_dataset(f"imagefolder:{root}", "train")
    assert len(train) == 6 and train.class_names == ("a", "b", "c")
    skipped, untested = train.notes
    assert skipped.startswith("skipped 2 entries named like images that are not regular files: ") and \
        str(root / "train" / "a" / "pipe.png") in skipped
    assert untested == "class c has no test images: the test accuracy does not cover it"


def test_training_on_an_imagefolder_over_two_ranks_equals_one_process(tmp_path):
    from distlab.launch.spawn import run_ranks
    from distlab.tools.verify import reference_run, tolerance
    from distlab.train import TrainConfig
    rng = np.random.RandomState(0)
    for c in ("a", "b", "c"):
        for i in range(14):
            from PIL import Image
            (tmp_path / "imgs" / c).mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.randint(0, 256, (4, 4), dtype=np.uint8), mode="L").save(tmp_path / "imgs" / c / f"{i}.png")
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(8,), dataset=f"imagefolder:{tmp_path / 'imgs'}", max_steps=5, epochs=2,
                      global_batch_size=12, lr=0.1, lr_schedule="constant", momentum=0.9, seed=2, progress=False,
                      out=str(tmp_path / "run")).validate(2)
    params = run_ranks(_train_tensors, 2, cfg, timeout=120)[0]
    ref, _ = reference_run(cfg)
    assert max((a - b).abs().max().item() for a, b in zip(params, ref)) <= tolerance(cfg)
