"""Mamba-3's op family, started as the shape a new family takes: its definition in float64
(reference.py), one registered op that runs it on any device (scan.py, the pytorch backend), and a
problem spec for the tests (tilegym_mamba2.testing.Mamba3ProblemSpec). No kernels yet: stage files
named after their math go beside reference.py, as in ssd/, and the registry entry gains a cutile line.

What Mamba-3 changes in Mamba-2's recurrence (docs/extending.md follows this folder step by step):
the input enters by the exponential-trapezoidal rule (two terms, the previous token's and this one's,
mixed by a per-token ``trap`` in [0, 1]; 1 is Mamba-2's rule), the state may rotate (a complex
diagonal, run as data-dependent rotations of B and C by the cumulative ``angles``), and B, C and x
may carry a rank dimension (MIMO).
"""
