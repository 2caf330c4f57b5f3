"""The SSD stages in plain PyTorch, no argument checks and no autograd, runnable on any device, a
file per kernel under the kernel's own name: chunk_cumsum.py, fwd_pass_state.py, compute_out.py (the
forward's three stages), chunk_states_walk.py, chunk_grads.py, gate_grads.py (the backward's),
end_state.py (context parallelism's); forward.py (the token recurrence, the definition, and the
stages composed), layer.py (mamba_chunk_scan_combined's definition), scans.py (the scan the
backward is made of); chunks.py, their shared chunk helpers."""
