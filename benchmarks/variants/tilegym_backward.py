"""tilegym 1.5.1's own forward + backward next to ours on the source config, in one device call
(experiment 45).

Its autotune compiles every configuration of every kernel for a new shape, ~1.6 s each on the
device: run36 stopped it after 545 s, 326 configurations in, inside its last kernel
(`_compute_da_db_dc_ddt`). Here its search spaces stay its own, filtered to the three best
configurations that run36's log printed for each kernel it finished
(`benchmarks/h200/run36/backward_tilegym_545s.log`, source config, chunk 128), so its search
still picks among them; the last kernel searches its whole space. Then `bench --backward`'s
harness times tilegym and ours (L2 flushed, gradients checked against float64).

    python benchmarks/variants/tilegym_backward.py
"""
from tilegym.ops.cutile import mamba2 as theirs

from tilegym_mamba2.bench import ANCHOR_SHAPES
from tilegym_mamba2.bench_backward import backward_table, run_backward_bench

_FWD_STATE = dict(SWAP=False, BHT=True, BLOCK_HEAD=64, occupancy=2, num_ctas=1, STORE_LAT=2)
RUN36_BEST = {
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


def pin(name, best):
    """tilegym's generator ``name``, keeping only the configurations listed in ``best``."""
    everything = getattr(theirs, name)

    def kept(*args, **kwargs):
        configs = [c for c in everything(*args, **kwargs) if vars(c) in best]
        if not configs:
            raise RuntimeError(f"{name}: none of run36's configurations is in this tilegym's space")
        return iter(configs)
    setattr(theirs, name, kept)


def main():
    for name, best in RUN36_BEST.items():
        pin(name, best)
    rows = run_backward_bench(shapes=ANCHOR_SHAPES[:1], tilegym_shapes=1, only=["tilegym"])
    print(backward_table(rows))


if __name__ == "__main__":
    main()
