"""Device functions the kernels of several op families share (cuTile, inlined where called)."""
import cuda.tile as ct


@ct.function
def log1p(e):
    # log(1 + e) without losing small e to the rounding of 1 + e (there is no log1p in cuTile):
    # log(u) * e / (u - 1) with u = fl(1 + e) cancels the rounding error to first order.
    u = 1.0 + e
    return ct.where(u == 1.0, e, ct.log(u) * (e / (u - 1.0)))
