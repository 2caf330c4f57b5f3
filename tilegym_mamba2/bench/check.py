"""A regression check before a release: ``python -m tilegym_mamba2 bench --check`` reruns our rows
of the tables docs/performance.md marks as anchors and prints each beside its recorded figure,
flagging any more than 10% slower.

A table is an anchor when the line just above it reads ``<!-- check: KIND -->``, KIND one of

    forward    rows "B, T, G, H, N, P | ours | ...": the plain op (bench --only: ours alone)
    backward   rows "B, T, G, H, N, P | ours | ours, autograd | ...": forward + backward, explicit
               and through autograd
    layer      rows "case | ours ms | ...": the layer op on bench.layer's case of that name
    training   rows "case | ours ms | ...": the layer op's training step on that case
               (bench --layer --backward)

The figures are read from the document, so a table updated by a new measurement is the check's
new reference; peers are not rerun (their times move between processes, ours is what a change of
ours can slow).
"""
import re
from dataclasses import dataclass
from pathlib import Path

SLOWER_THAN_RECORDED = 1.10   # flagged above this ratio of now to recorded
KINDS = {"forward": ("ours",), "backward": ("ours", "ours, autograd"), "layer": ("ours ms",),
         "training": ("ours ms",)}
MARKER = re.compile(r"<!--\s*check:\s*(\w+)\s*-->")


@dataclass(frozen=True)
class Anchor:
    kind: str               # forward, backward, layer or training
    row: str                # the row's first cell: a shape "4, 16384, ..." or a layer case's name
    column: str             # the recorded column: "ours", "ours, autograd", "ours ms"
    recorded_ms: float

    @property
    def shape(self) -> tuple:
        """The row's (batch, tokens, groups, heads, state_size, head_size), for forward and backward."""
        return tuple(int(v) for v in re.findall(r"\d+", self.row.split("(")[0]))


def default_document() -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def read_anchors(text: str) -> list:
    """Every marked table's rows and recorded figures, in the document's order. Raises ValueError
    naming the line of a marker of an unknown kind or a table without the columns its kind needs."""
    lines = text.splitlines()
    anchors = []
    for number, line in enumerate(lines):
        marker = MARKER.search(line)
        if not marker:
            continue
        kind = marker.group(1)
        if kind not in KINDS:
            raise ValueError(f"line {number + 1}: unknown check kind {kind!r}; known: {sorted(KINDS)}")
        table = []
        for row in lines[number + 1:]:
            if not row.startswith("|"):
                if table:
                    break
                continue
            table.append([cell.strip() for cell in row.strip().strip("|").split("|")])
        if len(table) < 3:
            raise ValueError(f"line {number + 1}: a '{kind}' check marker without a table under it")
        header, rows = table[0], table[2:]
        for column in KINDS[kind]:
            if column not in header:
                raise ValueError(f"line {number + 1}: the '{kind}' table has no column {column!r} (has {header})")
            at = header.index(column)
            for cells in rows:
                figure = re.search(r"\d+(\.\d+)?", cells[at].replace("*", ""))
                if figure is None:
                    raise ValueError(f"line {number + 1}: no figure in column {column!r} of row {cells[0]!r}")
                anchors.append(Anchor(kind, cells[0], column, float(figure.group())))
    return anchors


def measure_anchors(anchors, log=print) -> dict:
    """Reruns each anchor's row on the GPU: -> {anchor: ms now} (None where the run failed)."""
    from .backward import run_backward_bench
    from .forward import run
    from .layer import LAYER_CASES, run_layer_bench
    now = {}
    forward = [a for a in anchors if a.kind == "forward"]
    if forward:
        rows = run(list(dict.fromkeys(a.shape for a in forward)), only=("ours",), log=log)["rows"]
        times = {tuple(r["shape"]): r["ms"] for r in rows}
        now.update({a: times.get(a.shape) for a in forward})
    backward = [a for a in anchors if a.kind == "backward"]
    if backward:
        rows = run_backward_bench(list(dict.fromkeys(a.shape for a in backward)), only=(), log=log)
        impl = {"ours": "ours", "ours, autograd": "ours autograd"}
        times = {(tuple(r["shape"]), r["impl"]): r["ms"] for r in rows}
        now.update({a: times.get((a.shape, impl[a.column])) for a in backward})
    cases = {c.name: c for c in LAYER_CASES}
    for kind in ("layer", "training"):
        layer = [a for a in anchors if a.kind == kind]
        if not layer:
            continue
        unknown = [a.row for a in layer if a.row not in cases]
        if unknown:
            raise ValueError(f"{kind} rows {unknown} name no case of bench.layer.LAYER_CASES {sorted(cases)}")
        rows = run_layer_bench([cases[a.row] for a in layer], peers=False, log=log, training=kind == "training")
        times = {r["case"]: r["ms"] for r in rows if r["impl"] == "ours"}
        now.update({a: times.get(a.row) for a in layer})
    return now


def report(anchors, now) -> tuple:
    """-> (the table as text, the anchors flagged: slower than SLOWER_THAN_RECORDED x recorded, or failed)."""
    lines = [f"{'kind':9s} {'row':48s} {'column':15s} {'recorded':>9s} {'now':>9s} {'now/rec':>8s}"]
    flagged = []
    for a in anchors:
        ms = now.get(a)
        if ms is None:
            flagged.append(a)
            lines.append(f"{a.kind:9s} {a.row[:48]:48s} {a.column:15s} {a.recorded_ms:9.3f} {'failed':>9s}")
            continue
        ratio = ms / a.recorded_ms
        slower = ratio > SLOWER_THAN_RECORDED
        if slower:
            flagged.append(a)
        lines.append(f"{a.kind:9s} {a.row[:48]:48s} {a.column:15s} {a.recorded_ms:9.3f} {ms:9.3f} {ratio:7.2f}x"
                     + ("  SLOWER" if slower else ""))
    lines.append(f"{len(anchors) - len(flagged)} of {len(anchors)} within {SLOWER_THAN_RECORDED:.2f}x of the "
                 f"recorded figure" + (f"; {len(flagged)} flagged" if flagged else ""))
    return "\n".join(lines), flagged
