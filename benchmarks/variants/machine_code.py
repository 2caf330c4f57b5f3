"""CPU (no GPU): a hash of the machine code of every chunk_grads kernel variant the backward can
launch, compiled for sm_90 with the JIT's signatures (kernel_remarks.py), to show that a change
to the kernels' source that should not change them (a shared @ct.function, a comment) leaves
the GPU-tested code as it was. Only the code, constant, shared-memory and .nv.info sections are
hashed: the cubin also holds line tables, which any edit above a kernel moves.

    python benchmarks/variants/machine_code.py > after.txt   (and again at the other revision)

One line per compiled kernel: its mangled name and the hash; 40 variants (bf16 / fp16 / fp32,
with and without seq_idx, dy's low half, D per head, per channel or none).
"""
import hashlib
import itertools
import json
import os
import re
import sqlite3
import struct
import tempfile

import torch
from cuda.tile._cext import default_tile_context

from kernel_remarks import jit_like_signature  # this folder's
from tilegym_mamba2.cutile.chunk_grads import chunk_grads
from tilegym_mamba2.cutile.launch import recording_launches

CODE_SECTIONS = (".text", ".nv.constant", ".nv.shared", ".nv.info")
SECTION_KIND = re.compile(r"\.text|\.nv\.constant\d*|\.nv\.shared|\.nv\.info")


def sections(cubin: bytes):
    """(name, kind, bytes) of each ELF64 section of a cubin."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]
    for name_at, kind, _, _, offset, size in headers:
        yield cubin[names_at + name_at:cubin.index(b"\0", names_at + name_at)].decode(), kind, cubin[offset:offset + size]


def code_hash(cubin: bytes) -> str:
    """sha256 of the ELF64 sections that make up the kernel's code (not its line tables)."""
    digest = hashlib.sha256()
    for name, kind, data in sections(cubin):
        if name.startswith(CODE_SECTIONS) and kind != 8:  # 8: SHT_NOBITS, no bytes in the file
            # The section's kind, not the kernel's mangled name in it: a new constant argument
            # renames the kernel without changing its code.
            digest.update(SECTION_KIND.match(name).group(0).encode() + data)
    return digest.hexdigest()[:16]


def distinct_cubins(labelled_launches):
    """(label, kernel, cubin) for each distinct (kernel, JIT signature) among (label, kernel, args),
    in order, each compiled for sm_90 into an empty cache of its own (so the cubin is that
    launch's)."""
    seen = set()
    for label, kernel, args in labelled_launches:
        signature = jit_like_signature(kernel, args)
        if repr(signature) in seen:
            continue
        seen.add(repr(signature))
        cache = tempfile.mkdtemp()
        default_tile_context.config.cache_dir = cache
        kernel._compile(signature, default_tile_context, (9, 0))
        (blob,), = sqlite3.connect(os.path.join(cache, "cache.db")).execute("select blob from cache")
        yield label, kernel, bytes(blob)


def launches(dtype, has_seq, has_low, skip, shape=(2, 1000, 2, 8, 64, 32)):
    batch, tokens, groups, heads, state, head = shape
    chunks = -(-tokens // 64)
    x, dy = (torch.zeros(batch, tokens, heads, head, dtype=dtype) for _ in range(2))
    b, c = (torch.zeros(batch, tokens, groups, state, dtype=dtype) for _ in range(2))
    dt_bht, decay_cumsum = (torch.zeros(batch, heads, chunks * 64) for _ in range(2))
    entry, rev_entry = (torch.zeros(batch, heads, chunks * state, head) for _ in range(2))
    seq_idx = torch.zeros(batch, tokens, dtype=torch.int32) if has_seq else None
    d = {None: None, "head": torch.zeros(heads), "channel": torch.zeros(heads, head)}[skip]
    with recording_launches() as recorded:
        chunk_grads(x, b, c, dy, dy.clone() if has_low else None, dt_bht, decay_cumsum, entry, rev_entry, seq_idx,
                    d, torch.zeros(heads), 64)
    return recorded


def main():
    cache = tempfile.mkdtemp()
    default_tile_context.config.cache_dir = cache
    seen = set()
    for dtype, has_seq, has_low, skip in itertools.product((torch.bfloat16, torch.float16, torch.float32),
                                                           (False, True), (False, True), (None, "head", "channel")):
        if has_low and dtype == torch.float32:  # fp32 dy is never split
            continue
        for kernel, args in launches(dtype, has_seq, has_low, skip):
            signature = jit_like_signature(kernel, args)
            if repr(signature) not in seen:
                seen.add(repr(signature))
                kernel._compile(signature, default_tile_context, (9, 0))
    rows = sqlite3.connect(os.path.join(cache, "cache.db")).execute("select blob, metadata from cache")
    for name, digest in sorted((json.loads(meta)["kernel_names"][0], code_hash(bytes(blob))) for blob, meta in rows):
        print(name, digest)


if __name__ == "__main__":
    main()
