"""Side-by-side benchmarks on the GPU (`python -m tilegym_mamba2 bench`): forward.py (the plain
op against tilegym, mamba_ssm and FLA), layer.py, backward.py, serving.py and hf_decode.py."""
