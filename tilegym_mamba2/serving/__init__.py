"""The serving ops' kernels: selective_state_update (the decode step), causal_conv1d (prefill)
and causal_conv1d_update (the convolution's decode step)."""
