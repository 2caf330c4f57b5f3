"""Side-by-side benchmarks on the GPU (`python -m tilegym_mamba2 bench`): forward.py (the plain
op against tilegym, mamba_ssm and FLA), layer.py, backward.py, serving_ops.py (the serving ops
against their peers) and serving.py (those and a small HF model in one run)."""
