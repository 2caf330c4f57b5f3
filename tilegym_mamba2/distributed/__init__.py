"""Context parallelism: one Mamba-2 sequence split along its tokens over the ranks of a
torch.distributed group, forward and backward.

A rank's slice of the scan is affine in the state that enters it, so the ranks exchange one
summary each ([batch, heads, head_size, state_size] plus a decay per head, whatever the sequence
length) instead of activations: agreement.py (what the ranks check together first),
state_chain.py (the summaries' all-gather and chain), scan.py (the layer op), conv.py (the
convolution's halo) and mixer.py (the whole mixer). Any backend: cutile on CUDA tensors (NCCL,
or gloo through host memory), pytorch on CPU (gloo).
"""
from .conv import context_parallel_causal_conv1d
from .mixer import context_parallel_split_conv1d_scan_combined
from .scan import context_parallel_scan_combined

__all__ = ["context_parallel_causal_conv1d", "context_parallel_scan_combined",
           "context_parallel_split_conv1d_scan_combined"]
