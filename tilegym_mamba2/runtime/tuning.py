"""Launch configuration: chunk length, tile sizes and segment length from the problem's shape."""
import functools
import os
import statistics
import sys
from dataclasses import asdict, dataclass, replace

import torch

from ..core.constants import KERNEL_CHUNK, SEGMENT_CHUNKS

from ..core.tensors import pow2_at_least
from .config_store import read_entries, write_entry

# 64-token chunks run compute_out 2x faster than 128 on the H200 (the [chunk, chunk] score tile
# fits in registers; docs/design.md, Decisions). The math is the same at any
# length, so every requested chunk_size runs the one chunk length the GPU tests cover.


@dataclass(frozen=True)
class Config:
    chunk_size: int           # the chunk length the kernels use
    chunks_per_segment: int   # sequential depth of one block; more segments = more parallel blocks
    state_head_tile: int      # segment_states tile: head_size columns ...
    state_tile: int           # ... by state_size rows
    out_head_tile: int        # compute_out: head_size columns per block (the state it carries)
    group_scores: bool        # compute_out reads C·B^T computed once per group (group_scores.py)
    out_load_latency: int = 0  # compute_out's x, B, C loads: cuTile latency hint 1-10, 0 = none
    out_occupancy: int = 2     # compute_out's blocks per SM (the kernel's occupancy hint): 1 or 2
    chained: bool = False      # the plain op in one launch, segments chained (chained_prefill.py)


def segment_count(dt_bht, chunk_size, config: Config) -> int:
    """Segments of ``config.chunks_per_segment`` chunks over dt_bht's chunk-padded tokens."""
    return -(-(dt_bht.shape[2] // chunk_size) // config.chunks_per_segment)


@functools.cache
def choose_config(batch, tokens, groups, heads, head_size, state_size, chunk_size, device=None) -> Config:
    sms = _multiprocessor_count(device)
    kernel_chunk = KERNEL_CHUNK
    # compute_out carries a [state_size, out_head_tile] fp32 state in registers: keep it <= 32 KiB.
    out_head_tile = min(head_size, max(16, 8192 // state_size))
    num_chunks = -(-tokens // kernel_chunk)
    blocks_per_segment = batch * heads * (head_size // out_head_tile)
    # Long segments save state traffic; shorten them only until there are two blocks per SM.
    chunks_per_segment = SEGMENT_CHUNKS
    while chunks_per_segment > 1 and blocks_per_segment * -(-num_chunks // chunks_per_segment) < 2 * sms:
        chunks_per_segment //= 2
    # C·B^T once per group saves a 64 x 64 x state_size product per chunk and adds a kernel and
    # a 16 KB score read. It pays where that product outweighs each of compute_out's others
    # (64 x state_size x out_head_tile), i.e. out_head_tile < 64, and 16 or more blocks share the
    # tile. Whole op, alternating rounds: -9% at N=256 (out_head_tile 32); +2% to +13% at N=128,
    # P=64 even with 32 to 80 sharers.
    sharers = heads // groups * (head_size // out_head_tile)
    group_scores = sharers >= 16 and out_head_tile < 64
    # Segment-state tiles: x is read once per head tile, so a tile as tall as the state pays where
    # it fits at occupancy 2 (256 x 64 at N=256: -19% to -25%; 64 x 128 at N=64, P=128: -23%); at
    # N=128, 64 x 64 at occupancy 4 stays ahead.
    if state_size == 128:
        state_tile, state_head_tile = 64, min(head_size, 64)
    else:
        state_tile, state_head_tile = state_size, min(head_size, max(64, 8192 // state_size))
    # compute_out's loads hinted at the lowest DRAM latency: whole op -10% to -15% at N=128,
    # P=64; none at N=64, P=128; kernel alone +6% at N=256, where the
    # compiler's own choice stays. The same hint on the state pass's loads: -1% to +3%.
    out_load_latency = 1 if state_size <= 128 else 0
    # With 64 x 256 B and C tiles, compute_out at two blocks per SM spills: one block per SM ran
    # the whole op 2.4x faster at N=256; at N=128 and N=64 it was 16-36% slower
    # (at one block per SM the N=256 kernel has no spills: 254 registers, 148 KB of shared memory).
    out_occupancy = 1 if state_size > 128 else 2
    return Config(chunk_size=kernel_chunk, chunks_per_segment=chunks_per_segment,
                  state_head_tile=state_head_tile, state_tile=state_tile,
                  out_head_tile=out_head_tile, group_scores=group_scores, out_load_latency=out_load_latency,
                  out_occupancy=out_occupancy)


def _multiprocessor_count(device) -> int:
    if getattr(device, "type", None) == "meta":
        # A replay on meta tensors (other_token_class.py) sizes its launches as the call it follows
        # did: for the current GPU, which compile_other_class makes the call's.
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return _gpu_multiprocessor_count(device)


@functools.cache
def _gpu_multiprocessor_count(device) -> int:
    if device is None or not torch.cuda.is_available():
        return 132  # an H100/H200; only used for sizing when no GPU is queried
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------- measured choices
#
# Only the segment length is searched at call time: it is a runtime argument of the kernels,
# so trying three values compiles nothing more and costs a few milliseconds. The winner is
# kept per (GPU, dtype, size bucket) in memory and in a JSON file, so a new token count in
# the same bucket, or a new process, tunes nothing again. Choices measured on the H200 ship
# with the package (shipped_configs.json, written by benchmarks/tune_table.py); a user's own
# file comes first.
#
#   TILEGYM_MAMBA2_TUNE=0           never measure: a choice saved or shipped for the bucket, else the
#                                   heuristic (default: measure on the
#                                   first call of a new bucket; GPU-tested, tests/ssd/test_forward_gpu.py)
#   TILEGYM_MAMBA2_TUNE=all         also time the one-launch chained path where it fits: its kernel
#                                   compiles for ~30 s per new token-count class (cuTile specializes on
#                                   a dimension's divisibility), beyond what a first call may take
#   TILEGYM_MAMBA2_CACHE_DIR=path   where configs.json lives (default ~/.cache/tilegym-mamba2)


def tuning_enabled() -> bool:
    if os.environ.get("TILEGYM_MAMBA2_TUNE", "1") == "0":
        return False
    # Timing synchronizes the device, which is not allowed while a CUDA graph is being captured.
    return not capturing()


def chained_wanted() -> bool:
    """Whether the one-launch chained path may be chosen (TILEGYM_MAMBA2_TUNE=all): measured, it
    saves 0.02-0.04 ms a call on short rows and costs 31-33 s of compile per token-count class."""
    return os.environ.get("TILEGYM_MAMBA2_TUNE") == "all"


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


SWITCHES = ("TILEGYM_MAMBA2_TUNE", "TILEGYM_MAMBA2_CACHE_DIR", "HOME")


def tuning_switches() -> tuple:
    """Everything in the environment that can change which config a shape gets, read on every
    call (part of each plan's key, runtime/plan.py). os.environ.get of an unset name raises and
    catches a KeyError inside: ~0.8 us each. os.environ keeps its items in ``_data`` under encoded
    names (CPython, every platform), which reads in ~0.1 us; the public path where it is missing."""
    if _environ_data is None:
        return tuple(os.environ.get(name) for name in SWITCHES)
    return tuple(map(_environ_data.get, _ENCODED_SWITCHES))


_environ_data = getattr(os.environ, "_data", None)
_ENCODED_SWITCHES = tuple(map(os.environ.encodekey, SWITCHES)) if _environ_data is not None else None


def cache_path() -> str:
    root = os.environ.get("TILEGYM_MAMBA2_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                       "tilegym-mamba2")
    return os.path.join(root, "configs.json")


def bucket_key(gpu: str, dtype, batch, tokens, heads, groups, head_size, state_size, layer=False) -> str:
    """Shapes that share a key share a config: batch*heads and tokens by power of two. The
    requested chunk length is not part of it: the kernels run their own (KERNEL_CHUNK, or the
    chained path's). The layer op, which tunes on itself, has keys of its own."""
    return (f"{gpu}|{str(dtype).removeprefix('torch.')}|bh{pow2_at_least(batch * heads)}|t{pow2_at_least(tokens)}"
            f"|hpg{heads // groups}|P{head_size}|N{state_size}" + ("|layer" if layer else ""))


SHIPPED_CONFIGS = os.path.join(os.path.dirname(__file__), "shipped_configs.json")


@functools.cache
def shipped_entries() -> dict:
    """The choices measured on the H200 that ship with the package (benchmarks/tune_table.py)."""
    return read_entries(SHIPPED_CONFIGS)


class ConfigCache:
    """configs.json (config_store.py): bucket key -> the measured Config. Read once; each new entry
    is merged into the file under a lock. Entries that are not a valid Config are ignored. A key
    the file lacks is looked up in the shipped choices (``shipped=False``: the file alone)."""

    def __init__(self, path: str | None = None, shipped: bool = True):
        self.path = path or cache_path()
        self.shipped = shipped
        self._entries = None

    def _load(self) -> dict:
        if self._entries is None:
            self._entries = read_entries(self.path)
        return self._entries

    def get(self, key: str) -> Config | None:
        found = config_from_entry(self._load().get(key))
        if found is None and self.shipped:
            found = config_from_entry(shipped_entries().get(key))
        return found

    def put(self, key: str, config: Config) -> None:
        self._load()[key] = asdict(config)
        try:
            self._entries = write_entry(self.path, key, asdict(config))
        except OSError as e:
            print(f"[tilegym-mamba2] could not save the tuning cache {self.path}: {e}", file=sys.stderr)


def config_from_entry(fields) -> Config | None:
    """A cache entry as a Config, or None when it is not one this version can use (another
    version's fields, or values of the wrong type or range)."""
    if not isinstance(fields, dict):
        return None
    try:
        config = Config(**fields)
    except TypeError:
        return None
    ints = (config.chunk_size, config.chunks_per_segment, config.state_head_tile, config.state_tile,
            config.out_head_tile, config.out_load_latency, config.out_occupancy)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        return None
    if not all(isinstance(v, bool) for v in (config.group_scores, config.chained)):
        return None
    if min(ints[:5]) < 1 or config.chunks_per_segment > 1 << 16:
        return None
    tiles = (config.chunk_size, config.state_head_tile, config.state_tile, config.out_head_tile)
    if any(t & (t - 1) or t > 256 for t in tiles):  # cuTile's tiles are powers of two
        return None
    if not 0 <= config.out_load_latency <= 10 or config.out_occupancy not in (1, 2):  # their documented ranges
        return None
    return config


_cache = None


def _default_cache() -> ConfigCache:
    global _cache
    if _cache is None or _cache.path != cache_path():
        _cache = ConfigCache()
    return _cache


def candidates(base: Config, whole_row: int | None = None, chained: bool = False) -> list[Config]:
    """The segment lengths worth trying around the heuristic's choice, ``whole_row`` (see
    whole_row_chunks) when given, and with ``chained`` the one-launch path's."""
    lengths = {max(1, base.chunks_per_segment // 2), base.chunks_per_segment, base.chunks_per_segment * 2}
    if whole_row is not None:
        lengths.add(whole_row)
    found = [replace(base, chunks_per_segment=k) for k in sorted(lengths)]
    if chained:
        found += [chained_config(base, k) for k in CHAINED_SEGMENTS]
    return found


# The one-launch path is offered for short rows of 16-bit inputs with states of up to 128 columns:
# the host-bound calls it is for, at the tile sizes its GPU tests cover. Its segment lengths (in
# 128-token chunks): 4 timed fastest on the prefill, 2 leaves more blocks to wider batches.
CHAINED_SEGMENTS = (2, 4)
CHAINED_CHUNK = 128  # the chained kernel's chunk: at 64 it ran slower (docs/design.md, Decisions)


def chained_fits(tokens, state_size, dtype) -> bool:
    return tokens <= SHORT_ROW_TOKENS and state_size <= 128 and dtype in (torch.bfloat16, torch.float16)


def chained_config(base: Config, chunks_per_segment: int) -> Config:
    # Head tiles of at most 64 columns: with 128-token chunks, wider ones were not measured.
    return replace(base, chained=True, chunk_size=CHAINED_CHUNK, chunks_per_segment=chunks_per_segment,
                   out_head_tile=min(base.out_head_tile, 64))


# Rows this short are offered whole even where their blocks leave SMs idle: such a call is
# host-bound, and two launches instead of four cost less host time than the longer walk costs the
# GPU on some hosts and not on others, so the tuner's timing decides (docs/design.md, Decisions).
SHORT_ROW_TOKENS = 4096


def whole_row_chunks(batch, tokens, heads, head_size, config: Config, device=None) -> int | None:
    """A segment length that makes every row of the bucket one segment (compute_out's blocks then
    walk whole rows and the state pass is skipped), or None where those blocks would leave SMs
    idle on a long row. Tokens are bucketed by power of two, so the length covers the bucket's
    longest row."""
    longest = pow2_at_least(tokens)
    fills_gpu = batch * heads * (head_size // config.out_head_tile) >= _multiprocessor_count(device)
    if not fills_gpu and longest > SHORT_ROW_TOKENS:
        return None
    return -(-longest // config.chunk_size)


# Candidates are timed in alternating rounds, each by its median: a host-bound call's time drifts by
# 30% within seconds on a shared host, and in one pass the first candidates met the warm-up's
# drift and the slower candidate won.
MEASURE_ROUNDS = 3


def tuned_config(key: str, base: Config, measure, *, tune: bool | None = None,
                 cache: ConfigCache | None = None, log=None, whole_row: int | None = None,
                 chained: bool = False) -> Config:
    """The cached config for ``key``; else, when tuning, the fastest candidate by ``measure``
    (config -> milliseconds), saved; else ``base``."""
    cache = cache or _default_cache()
    found = cache.get(key)
    if found is not None and found.chained and not chained:
        found = None  # chosen where the chained path was allowed: measure again without it
    if found is not None:
        # Only the segment length (and the one-launch path) was measured; the rest follows the
        # current heuristic, so a cache written by an older version does not pin its tile choices.
        if found.chained:
            return chained_config(base, found.chunks_per_segment)
        return replace(base, chunks_per_segment=found.chunks_per_segment)
    if not (tuning_enabled() if tune is None else tune):
        return base
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(f"[tilegym-mamba2] tuning {key}")
    tried = candidates(base, whole_row, chained)
    rounds = [[measure(config) for config in tried] for _ in range(MEASURE_ROUNDS)]
    timed = []
    for i, config in enumerate(tried):
        ms = statistics.median(round_[i] for round_ in rounds)
        timed.append((ms, config.chunks_per_segment, i, config))
        log(f"[tilegym-mamba2]   {i + 1}/{len(tried)} {_described(config)}: {ms:.3f} ms")
    best = min(timed)[3]
    log(f"[tilegym-mamba2]   -> {_described(best)}, saved to {cache.path}")
    cache.put(key, best)
    return best


def _described(config: Config) -> str:
    described = f"chunks_per_segment={config.chunks_per_segment}"
    return f"{described}, chained ({config.chunk_size}-token chunks)" if config.chained else described
