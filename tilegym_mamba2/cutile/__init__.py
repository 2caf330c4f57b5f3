"""The cuTile kernels, a file per stage named after its math, each with its launcher, and the
host code that runs them: forward.py (the plain op), scan_combined.py (the layer op), scan.py
(the backward's scans), serving/ (decode-time ops); launch.py, plan.py and tuning.py serve them all."""
