"""Hashes of the machine code of every kernel the package compiles ahead of time, for sm_90 (no
GPU needed). Run it at two revisions and diff the output to show that a change which should not
touch the kernels (a move, a comment, a shared helper) leaves the GPU-tested code as it was.

    python benchmarks/machine_code.py > before.txt      # then again at the other revision

It compiles what `python -m tilegym_mamba2 compile` compiles (forward, chained prefill, layer op,
backward, serving) and prints one line per compiled kernel: the group, the kernel's name, its
cubin size and the sha256 of the sections that hold code and constants (.text, .nv.constant*,
.nv.shared, .nv.info). Line tables are left out: any edit above a kernel moves them.
"""
import hashlib
import io
import re
import struct
import sys

from cuda.tile import compilation

from tilegym_mamba2 import aot

CODE_SECTIONS = (".text", ".nv.constant", ".nv.shared", ".nv.info")
SECTION_KIND = re.compile(r"\.text|\.nv\.constant\d*|\.nv\.shared|\.nv\.info")
SHT_NOBITS = 8  # a section with no bytes in the file


def sections(cubin: bytes):
    """(name, kind, bytes) of each section of an ELF64 cubin."""
    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]
    for name_at, kind, _, _, offset, size in headers:
        start = names_at + name_at
        yield cubin[start:cubin.index(b"\0", start)].decode(), kind, cubin[offset:offset + size]


def code_hash(cubin: bytes) -> str:
    digest = hashlib.sha256()
    for name, kind, data in sections(cubin):
        if name.startswith(CODE_SECTIONS) and kind != SHT_NOBITS:
            # The section's kind, not its full name: that carries the kernel's mangled name.
            digest.update(SECTION_KIND.match(name).group(0).encode() + data)
    return digest.hexdigest()[:16]


GROUPS = (
    ("forward", lambda t: aot.compile_kernels(t)),
    ("forward, chained prefill", lambda t: aot.compile_kernels(t, chained=True)),
    ("layer op, every option", lambda t: aot.compile_layer_kernels(t, per_sequence_init=True)),
    ("backward", lambda t: aot.compile_backward_kernels(t)),
    ("layer backward, packed", lambda t: aot.compile_backward_kernels(t, layer="packed")),
    ("layer backward, sequence states", lambda t: aot.compile_backward_kernels(t, layer="sequence_states")),
    ("serving", lambda t: aot.compile_serving_kernels(t)),
)


def main(target="sm_90"):
    cubins = []
    real_export = compilation.export_kernel

    def export_and_keep(kernel, signatures, out, **kw):
        buffer = io.BytesIO()
        real_export(kernel, signatures, buffer, **kw)
        cubins.append(buffer.getvalue())
        out.write(buffer.getvalue())

    aot.export_kernel = export_and_keep
    for group, compile_group in GROUPS:
        first = len(cubins)
        for (name, size, _), cubin in zip(compile_group(target), cubins[first:]):
            print(f"{group:32s} {name:30s} {size:8d} {code_hash(cubin)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
