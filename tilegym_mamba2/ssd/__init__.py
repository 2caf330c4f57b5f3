"""Mamba-2's state-space duality (SSD) op family: a cuTile file per stage named after its math, each
with its launcher (chunk_cumsum, fwd_pass_state, compute_out, group_scores, chained_prefill,
varlen_states, sequence_init; the backward's chunk_states_walk, chunk_grads, gate_grads; the context
parallel end_state), the host code that runs them (forward.py the plain op, layer.py the layer op,
scans.py the backward's scans, backward.py the backward's algorithm for every backend, autograd.py),
and reference/, the same stages in float64 PyTorch under the same file names."""
