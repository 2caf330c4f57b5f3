"""Hugging Face transformers: the patch of Mamba-2 and its hybrids onto our kernels (patch.py),
their norms as one rms_norm kernel each (norm_patch.py), and decoding in CUDA graphs
(decode_graphs.py)."""
from .patch import apply_tilegym_kernel_to_mamba2, revert_tilegym_kernel_to_mamba2

__all__ = ["apply_tilegym_kernel_to_mamba2", "revert_tilegym_kernel_to_mamba2"]
