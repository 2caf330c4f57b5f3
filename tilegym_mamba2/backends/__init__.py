"""The registry's targets (ops_registry.yaml): cutile.py (our kernels), pytorch.py (the
references), split_conv1d_scan.py (the mixer's composition, either backend). Each entry point
checks its arguments, then hands the call to autograd or runs the forward directly. The serving
ops' cuTile entry points (serving/) are registered where their kernels are: they have no
autograd path, and a wrapper here would add host time to every decode step."""
