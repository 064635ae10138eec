"""distlab: distributed training from first principles, measured against PyTorch's own."""

__version__ = "0.1.0"
