"""Pure PyTorch math, no argument checks and no autograd, runnable on any device: ssd.py (the
token recurrence and the forward's three chunked stages), layer.py (mamba_chunk_scan_combined's
definition), scan.py (the scan the backward is made of and its chunk-local gradients), serving.py
(the decode-time ops)."""
