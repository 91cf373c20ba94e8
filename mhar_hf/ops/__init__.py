"""Fused GPU kernels (Triton). Imported lazily by the model: the package works without Triton."""
