"""DLRM trainer for Criteo click logs (PyTorch Lightning + TorchRec)."""
