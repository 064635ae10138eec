"""The in-memory image dataset every loader works on."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from distlab.data.transforms import normalize, random_crop_flip


@dataclass
class ImageDataset:
    """Images ``(N, C, H, W)`` (uint8 as stored on disk, or float32 for synthetic data) and labels.

    ``batch()`` returns normalised float32 images, with CIFAR-style augmentation when asked.
    """

    name: str
    split: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False
    source: str = ""
    class_names: tuple[str, ...] | None = None  # label i's name, where the data set has names
    notes: tuple[str, ...] = ()  # what reading it skipped or could not cover (the run's header says it)

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or len(self.images) != len(self.labels):
            raise ValueError(f"images {tuple(self.images.shape)} and labels {tuple(self.labels.shape)} disagree")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def ignores_targets(self) -> bool:
        """Whether some labels are not scored (never: every image has its class)."""
        return False

    pairs = False  # a sample is one image (not a preference pair)
    inputs_per_sample = 1  # model inputs a sample is (a preference pair: two)

    @property
    def predicts_tokens(self) -> bool:
        """Whether a sample's targets are a sequence of tokens (no: one class per image)."""
        return False

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def to(self, device: torch.device | str) -> "ImageDataset":
        """The same data set with its tensors on ``device`` (batches are then gathered there)."""
        return replace(self, images=self.images.to(device), labels=self.labels.to(device))

    def batch(self, indices: torch.Tensor, *, augment: bool = False,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.as_tensor(indices).to(self.images.device, non_blocking=True)
        x = normalize(self.images[indices], self.mean, self.std)
        if augment:
            x = random_crop_flip(x, generator or torch.Generator().manual_seed(0))
        return x, self.labels[indices]

    def subset(self, indices: torch.Tensor, split: str) -> "ImageDataset":
        """A copy holding only ``indices`` (e.g. a validation split carved from the training set)."""
        return replace(self, split=split, images=self.images[indices], labels=self.labels[indices])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], int(y[0])
