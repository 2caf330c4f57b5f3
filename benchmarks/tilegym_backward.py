"""tilegym 1.5.1's own cuTile forward + backward next to ours on the source config, in about
ten minutes (GPU).

    python benchmarks/tilegym_backward.py

On a new shape tilegym's autotune compiles every configuration of every kernel, about 1.6 s each
on an H200, and a full search of its backward takes well over ten minutes. Here each of its
search spaces is filtered to the configurations its own full search ranked best on the source
config (chunk 128, H200), listed in PINNED below, so its autotune still picks among them;
its last kernel (`_compute_da_db_dc_ddt`) searches its whole space. Then `bench --backward`'s
harness times tilegym and ours (L2 flushed, gradients checked against float64 autograd) and
prints its table: forward + backward ms, the largest gradient error and the first call's
seconds for each implementation. It needs a tilegym whose space holds these configurations
(it stops with an error naming the kernel otherwise).
"""
from tilegym.ops.cutile import mamba2 as theirs

from tilegym_mamba2.bench.backward import backward_table, run_backward_bench
from tilegym_mamba2.bench.forward import ANCHOR_SHAPES

_FWD_STATE = dict(SWAP=False, BHT=True, BLOCK_HEAD=64, occupancy=2, num_ctas=1, STORE_LAT=2)
PINNED = {  # tilegym's config generator -> the configurations kept
    "_chunk_cumsum_autotune_configs": [dict(BLOCK_H=4, occupancy=o) for o in (7, 4, 6)],
    # searched twice: the forward's state pass, then the backward's with its narrow copy
    "_fwd_pass_state_autotune_configs": [
        dict(_FWD_STATE, BLOCK_STATE=16, LOAD_LAT=6, BDD_LAT=4), dict(_FWD_STATE, BLOCK_STATE=32, LOAD_LAT=4, BDD_LAT=4),
        dict(_FWD_STATE, BLOCK_STATE=32, LOAD_LAT=6, BDD_LAT=4), dict(_FWD_STATE, BLOCK_STATE=16, LOAD_LAT=4, BDD_LAT=4),
        dict(_FWD_STATE, BLOCK_STATE=32, LOAD_LAT=4, BDD_LAT=2)],
    "_compute_out_configs": [dict(BLOCK_STATE=64, BLOCK_HEAD=64, occupancy=2, persistent=False, H_LAT=h)
                             for h in (6, 3, 4)],
    "_bwd_pass_state_autotune_configs": [
        dict(BLOCK_STATE=16, BLOCK_HEAD=64, occupancy=2, num_ctas=1, LOAD_LAT=5, STORE_LAT=1, CD_LAT=5, HID_LAT=3),
        dict(BLOCK_STATE=16, BLOCK_HEAD=64, occupancy=2, num_ctas=1, LOAD_LAT=5, STORE_LAT=2, CD_LAT=5, HID_LAT=3),
        dict(BLOCK_STATE=16, BLOCK_HEAD=64, occupancy=2, num_ctas=1, LOAD_LAT=4, STORE_LAT=1, CD_LAT=3, HID_LAT=3)],
    "_compute_dd_dcb_dx_autotune_configs": [
        dict(BLOCK_STATE=128, BLOCK_HEAD=64, occupancy=1, persistent=True, LOAD_LAT=load, STORE_LAT=1,
             DOUT_LAT=dout, DHID_LAT=dhid) for load, dout, dhid in ((4, 5, 6), (4, 7, 6), (5, 5, 7))],
}


def pin(name, kept_configs):
    """Replaces tilegym's generator ``name`` with one that yields only its configurations listed
    in ``kept_configs``."""
    everything = getattr(theirs, name)

    def kept(*args, **kwargs):
        configs = [c for c in everything(*args, **kwargs) if vars(c) in kept_configs]
        if not configs:
            raise RuntimeError(f"{name}: none of the pinned configurations is in this tilegym's space")
        return iter(configs)
    setattr(theirs, name, kept)


def main():
    for name, kept_configs in PINNED.items():
        pin(name, kept_configs)
    rows = run_backward_bench(shapes=ANCHOR_SHAPES[:1], tilegym_shapes=1, only=["tilegym"])
    print(backward_table(rows))


if __name__ == "__main__":
    main()
