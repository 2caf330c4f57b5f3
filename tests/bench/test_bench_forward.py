"""The benchmark's arithmetic and report on the CPU (timing itself needs a GPU)."""
import json

import pytest

from tilegym_mamba2.bench import forward as bench

SOURCE = (4, 16384, 1, 8, 128, 64)


def test_floor_and_work_match_the_anchors():
    # The source config: floor 0.040 ms at 4.3 TB/s; about 43 GFLOP at chunk 128.
    assert bench.floor_bytes(*SOURCE) / 4.3e12 * 1e3 == pytest.approx(0.040, abs=0.001)
    assert bench.nominal_flops(*SOURCE) / 1e9 == pytest.approx(43, abs=0.5)
    assert bench.floor_bytes(*SOURCE, elem=4) > bench.floor_bytes(*SOURCE)


def test_table_reports_ratios_to_each_peer_and_to_the_floor(tmp_path):
    result = {"meta": {"copy_bandwidth_bytes_per_s": 4.3e12},
              "rows": [{"shape": list(SOURCE), "impl": "ours", "ms": 0.2, "rel_err": 2e-3, "note": ""},
                       {"shape": list(SOURCE), "impl": "mamba_ssm", "ms": 0.5, "rel_err": 2e-3, "note": ""},
                       {"shape": list(SOURCE), "impl": "fla", "ms": None, "rel_err": None, "note": "failed"}]}
    text = bench.table(json.loads(json.dumps(result)))
    header, _, line = text.splitlines()
    assert "mamba_ssm / ours" in header and "ours / floor" in header
    assert "2.50x" in line                                  # 0.5 / 0.2
    assert "5.0x" in line                                   # 0.2 ms over a 0.040 ms floor
    assert "—" in line                                      # fla failed: no time, no ratio


def test_the_grid_covers_the_issue_dimensions():
    shapes = bench.GRID_SHAPES
    assert set(bench.ANCHOR_SHAPES) <= set(shapes)
    assert {s[4] for s in shapes} >= {64, 128, 256} and {s[5] for s in shapes} >= {64, 128}
    assert {s[2] for s in shapes} >= {1, 8} and max(s[3] for s in shapes) >= 80
