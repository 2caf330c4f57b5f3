"""bench --check: the anchor tables of docs/performance.md read, compared and flagged (CPU; the
rerun itself needs a GPU)."""
import pytest
import torch

from tilegym_mamba2.__main__ import main
from tilegym_mamba2.bench.check import Anchor, default_document, read_anchors, report
from tilegym_mamba2.bench.layer import LAYER_CASES


def test_the_documents_anchors_cover_forward_backward_layer_and_training():
    anchors = read_anchors(default_document().read_text())
    assert {a.kind for a in anchors} == {"forward", "backward", "layer", "training"}
    assert all(a.recorded_ms > 0 for a in anchors)
    assert all(len(a.shape) == 6 for a in anchors if a.kind in ("forward", "backward"))
    assert {a.row for a in anchors if a.kind in ("layer", "training")} <= {c.name for c in LAYER_CASES}
    source = [a for a in anchors if a.kind == "backward" and a.shape == (4, 16384, 1, 8, 128, 64)]
    assert {a.column for a in source} == {"ours", "ours, autograd"}


DOC = """Some text.

<!-- check: forward -->
| B, T, G, H, N, P | ours | peer |
| --- | --- | --- |
| 1, 64, 1, 4, 16, 32 (tiny) | **0.050** | 0.2 |
| 2, 128, 1, 4, 16, 32 | 0.1 | 0.3 |

| 9, 9, 9, 9, 9, 9 | 7.0 | unmarked table |
"""


def test_a_marked_table_gives_its_rows_and_an_unmarked_one_none():
    anchors = read_anchors(DOC)
    assert anchors == [Anchor("forward", "1, 64, 1, 4, 16, 32 (tiny)", "ours", 0.05),
                       Anchor("forward", "2, 128, 1, 4, 16, 32", "ours", 0.1)]
    assert anchors[0].shape == (1, 64, 1, 4, 16, 32)


@pytest.mark.parametrize("doc, says", [
    (DOC.replace("check: forward", "check: sideways"), "unknown check kind 'sideways'"),
    (DOC.replace("| ours | peer |", "| mine | peer |"), "no column 'ours'"),
    (DOC.replace("**0.050**", "—"), "no figure in column 'ours'"),
    ("<!-- check: layer -->\nno table\n", "without a table"),
])
def test_a_malformed_anchor_table_is_named_by_its_line(doc, says):
    with pytest.raises(ValueError, match=says):
        read_anchors(doc)


def test_report_flags_rows_more_than_ten_percent_slower_and_failed_ones():
    a, b, c = (Anchor("forward", f"{i}, 1, 1, 1, 1, 1", "ours", 1.0) for i in range(3))
    text, flagged = report([a, b, c], {a: 1.09, b: 1.11, c: None})
    assert flagged == [b, c]
    lines = text.splitlines()
    assert "SLOWER" not in lines[1] and "SLOWER" in lines[2] and "failed" in lines[3]
    assert "1 of 3 within 1.10x" in lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check reruns every row")
def test_on_a_cpu_the_command_lists_the_anchors_and_says_a_gpu_is_needed(capsys):
    assert main(["bench", "--check"]) == 1
    out, err = capsys.readouterr()
    assert "anchor figures in" in out and "needs an NVIDIA GPU" in err


def test_a_missing_document_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:          # a usage error, before anything runs
        main(["bench", "--check", "--doc", str(tmp_path / "nowhere.md")])
    assert stop.value.code == 2
    assert "--doc must name an existing file" in capsys.readouterr().err


def test_a_document_without_anchors_fails(tmp_path, capsys):
    garbage = tmp_path / "garbage.md"
    garbage.write_text("no tables here\n| a | b |\n")
    assert main(["bench", "--check", "--doc", str(garbage)]) == 2
    assert "holds no anchor figures" in capsys.readouterr().err
