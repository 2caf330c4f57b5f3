"""A backend as one object: what it takes (limits), what the shared backward runs on (kernels),
its runners without autograd, and the differentiable ops built over them.

The registry (ops_registry.yaml's ``backends:``) resolves a name to one of these once; the
public functions, the compositions (split_conv1d_scan.py) and distributed/ receive it and call
its methods. Nothing below this object calls the registry again.

A new backend is a module that builds one ``Backend`` (docs/extending.md): its runners take
the checked call as a keyword dataclass (core/validation.py) and return the public op's results.
"""
from dataclasses import dataclass, field
from typing import Callable

from ..core.validation import BackwardArgs, ForwardArgs, Limits, ScanCombinedArgs
from ..ssd.autograd import Differentiable, differentiable, differentiable_chunk_forward, differentiable_scan_combined, wanted


@dataclass(frozen=True, eq=False)
class Backend:
    name: str
    limits: Limits
    # dtype -> ssd.backward.Kernels: the scans and chunk-local gradients the backward runs on
    kernels_for: Callable
    # ForwardArgs (unchecked) -> (out, final_state), no autograd
    run_chunk_forward: Callable
    # BackwardArgs (unchecked) -> (dx, da, db, dc, dd, ddt, dinit_state)
    run_chunk_backward: Callable
    # (ScanCombinedArgs unchecked, keep_ungated=bool) -> (scan_returns' tuple, y + D x before the gate or None)
    run_scan_combined: Callable
    # (ScanCombinedArgs, dout, dfinal_states, dvarlen_states, checked=bool, ungated=tensor or None) -> the
    # gradients (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states), None where the input is None
    run_scan_combined_backward: Callable
    # distributed/: (x, B, dt, log_decay, run_start, start_state) -> a rank's end state and its autograd
    end_state: Callable
    # Whether run_scan_combined with keep_ungated gives the output before its gate (ssd.autograd.keeps_ungated).
    keeps_ungated: bool = True
    ops: Differentiable = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "ops", differentiable(self))

    # --- the public ops, each with its public arguments --------------------------------------

    def chunk_forward(self, x, a, b, c, d, dt, init_state=None, chunk_size=128):
        call = ForwardArgs(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init_state, chunk_size=chunk_size)
        if wanted(x, a, b, c, d, dt, init_state):
            return differentiable_chunk_forward(self.ops, call)
        return self.run_chunk_forward(call)

    def chunk_backward(self, x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128):
        return self.run_chunk_backward(BackwardArgs(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init_state,
                                                    chunk_size=chunk_size, dout=dout, dfinal_state=dfinal_state))

    def scan_combined(self, call: ScanCombinedArgs):
        """mamba_chunk_scan_combined's call -> its returns (differentiable where wanted)."""
        if wanted(call.x, call.dt, call.A, call.B, call.C, call.D, call.z, call.dt_bias, call.initial_states):
            return differentiable_scan_combined(self.ops, call)
        return self.run_scan_combined(call, keep_ungated=False)[0]

    def scan_combined_backward(self, call: ScanCombinedArgs, dout, dfinal_states, dvarlen_states):
        """The registry op mamba2_chunk_scan_combined_backward: checks its arguments."""
        return self.run_scan_combined_backward(call, dout, dfinal_states, dvarlen_states, checked=False,
                                               ungated=None)

    def __repr__(self):
        return f"<tilegym_mamba2 backend {self.name!r}>"

