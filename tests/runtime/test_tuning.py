"""Tuning bookkeeping on the CPU: buckets, the disk cache, the switch and progress output.
The measurement itself runs on a GPU (config_for / pretune); here it is a fake timer."""
import json
from dataclasses import replace

import torch
import tilegym_mamba2

from tilegym_mamba2.runtime import tuning
from tilegym_mamba2.runtime.tuning import (MEASURE_ROUNDS, ConfigCache, bucket_key, candidates, chained_config,
                                          choose_config, config_from_entry, tuned_config, whole_row_chunks)


GPU = "a GPU without shipped choices"  # the tests' buckets never meet the shipped table


def key(tokens, batch=4, heads=8):
    return bucket_key(GPU, torch.bfloat16, batch, tokens, heads, 1, 64, 128)


class FakeTimer:
    """Pretends chunks_per_segment == best is fastest; counts measurements."""

    def __init__(self, best):
        self.best, self.calls = best, 0

    def __call__(self, config):
        self.calls += 1
        return 0.1 + abs(config.chunks_per_segment - self.best)


BASE = choose_config(4, 16384, 1, 8, 64, 128, 128)


def test_same_bucket_for_token_counts_up_to_the_next_power_of_two():
    assert key(9000) == key(16384) == key(12345)
    assert key(16385) != key(16384)
    assert key(16384, batch=3) == key(16384)                # batch*heads by power of two
    assert key(16384, batch=8) != key(16384)
    assert bucket_key("NVIDIA H100", torch.bfloat16, 4, 16384, 8, 1, 64, 128) != key(16384)
    assert bucket_key(GPU, torch.float16, 4, 16384, 8, 1, 64, 128) != key(16384)
    # the layer op times itself, so its choices are kept apart from the plain op's
    assert bucket_key(GPU, torch.bfloat16, 4, 16384, 8, 1, 64, 128, layer=True) != key(16384)


def test_candidates_vary_only_the_runtime_segment_length():
    found = candidates(BASE)
    assert [c.chunks_per_segment for c in found] == sorted({max(1, BASE.chunks_per_segment // 2),
                                                          BASE.chunks_per_segment, 2 * BASE.chunks_per_segment})
    for c in found:  # everything that would need a new compile stays as the heuristic chose
        assert (c.chunk_size, c.state_head_tile, c.state_tile, c.out_head_tile) == \
               (BASE.chunk_size, BASE.state_head_tile, BASE.state_tile, BASE.out_head_tile)


def test_tunes_once_per_bucket_and_persists_across_processes(tmp_path, capsys):
    path = str(tmp_path / "configs.json")
    timer = FakeTimer(best=2 * BASE.chunks_per_segment)
    first = tuned_config(key(16384), BASE, timer, tune=True, cache=ConfigCache(path))
    assert first.chunks_per_segment == 2 * BASE.chunks_per_segment
    assert timer.calls == MEASURE_ROUNDS * len(candidates(BASE))
    err = capsys.readouterr().err
    assert "tuning" in err and f"1/{len(candidates(BASE))}" in err and "saved" in err  # progress

    again = tuned_config(key(10000), BASE, timer, tune=True, cache=ConfigCache(path))  # a "new process"
    assert again == first and timer.calls == MEASURE_ROUNDS * len(candidates(BASE))
    saved = json.load(open(path))
    assert saved[key(16384)]["chunks_per_segment"] == first.chunks_per_segment


def test_tuning_is_on_by_default_and_off_during_graph_capture(monkeypatch):
    from tilegym_mamba2.runtime.tuning import tuning_enabled
    monkeypatch.delenv("TILEGYM_MAMBA2_TUNE", raising=False)
    assert tuning_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not tuning_enabled()


def test_a_slow_first_round_does_not_decide(tmp_path):
    """The host's drift in one pass (a slow start, then a fast stretch) must not pick a candidate:
    each is judged by its median over alternating rounds."""
    best = BASE.chunks_per_segment
    times = iter([0.9, 0.9, 0.1] + [0.5, 0.2, 0.3] * (MEASURE_ROUNDS - 1))  # first round: the last one lucky

    def drifting(config):
        return next(times)

    got = tuned_config(key(8192), BASE, drifting, tune=True, cache=ConfigCache(str(tmp_path / "c.json")),
                       log=lambda m: None)
    assert [c.chunks_per_segment for c in candidates(BASE)][1] == best and got.chunks_per_segment == best


def test_switch_off_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "0")
    timer = FakeTimer(best=1)
    got = tuned_config(key(4096), BASE, timer, cache=ConfigCache(str(tmp_path / "c.json")))
    assert got == BASE and timer.calls == 0
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "1")
    got = tuned_config(key(4096), BASE, timer, cache=ConfigCache(str(tmp_path / "c.json")), log=lambda m: None)
    assert timer.calls == MEASURE_ROUNDS * len(candidates(BASE)) and got.chunks_per_segment == min(
        c.chunks_per_segment for c in candidates(BASE))


def test_unreadable_or_foreign_cache_is_ignored(tmp_path, capsys):
    path = tmp_path / "configs.json"
    path.write_text("{not json")
    timer = FakeTimer(best=BASE.chunks_per_segment)
    got = tuned_config(key(2048), BASE, timer, tune=False, cache=ConfigCache(str(path)))
    assert got == BASE and "ignoring unreadable" in capsys.readouterr().err
    path.write_text(json.dumps({key(2048): {"chunks_per_segment": 3, "some_old_field": 1}}))
    assert tuned_config(key(2048), BASE, timer, tune=False, cache=ConfigCache(str(path))) == BASE


def test_cache_keeps_only_the_measured_segment_length(tmp_path):
    path = str(tmp_path / "configs.json")
    older = replace(BASE, chunks_per_segment=2 * BASE.chunks_per_segment, state_tile=16, group_scores=True)
    ConfigCache(path).put(key(4096), older)  # as written by a version with another heuristic
    got = tuned_config(key(4096), BASE, FakeTimer(best=1), tune=False, cache=ConfigCache(path))
    assert got == replace(BASE, chunks_per_segment=older.chunks_per_segment)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    from tilegym_mamba2.runtime import tuning
    monkeypatch.setenv("TILEGYM_MAMBA2_CACHE_DIR", str(tmp_path))
    assert tuning.cache_path() == str(tmp_path / "configs.json")
    tuned_config(key(1024), BASE, FakeTimer(best=1), tune=True, log=lambda m: None)
    assert (tmp_path / "configs.json").exists()


def test_group_scores_only_for_narrow_head_tiles_shared_by_many_blocks():
    # (batch, tokens, groups, heads, head_size, state_size, chunk): compute_out blocks per C·B^T tile
    assert not choose_config(4, 16384, 1, 8, 64, 128, 128).group_scores          # 8: source config
    assert not choose_config(2, 8192, 1, 80, 64, 128, 128).group_scores          # 80, but 64-wide tiles
    assert choose_config(2, 8192, 8, 64, 64, 256, 128).group_scores              # 8 heads x 2 32-wide tiles
    assert not choose_config(2, 8192, 8, 64, 64, 128, 128).group_scores          # 8
    assert choose_config(1, 2048, 2, 32, 32, 128, 128).group_scores              # 16, 32-wide tiles


def test_whole_rows_are_a_candidate_where_their_blocks_fill_the_gpu_or_the_row_is_short():
    # 2 x 80 heads x 1 head tile = 160 blocks >= 132 SMs: rows up to 8192 tokens in 128 chunks
    wide = choose_config(2, 8000, 1, 80, 64, 128, 128)
    assert whole_row_chunks(2, 8000, 80, 64, wide) == 8192 // wide.chunk_size
    assert 8192 // wide.chunk_size in [c.chunks_per_segment for c in candidates(wide, 128)]
    # the source config: 4 x 8 heads = 32 blocks, most SMs would idle on 16384-token rows
    assert whole_row_chunks(4, 16384, 8, 64, choose_config(4, 16384, 1, 8, 64, 128, 128)) is None
    # the 2048-token prefill: 32 blocks, but a host-bound call whose timing decides
    prefill = choose_config(1, 2048, 1, 32, 64, 128, 128)
    assert whole_row_chunks(1, 2048, 32, 64, prefill) == 2048 // prefill.chunk_size
    assert whole_row_chunks(1, 4097, 32, 64, prefill) is None  # bucketed to 8192 tokens
    assert candidates(BASE, None) == candidates(BASE)


def test_compute_out_hints_follow_the_state_size():
    # (batch, tokens, groups, heads, head_size, state_size, chunk); why: choose_config's comments
    source, wide = choose_config(4, 16384, 1, 8, 64, 128, 128), choose_config(2, 8192, 8, 64, 64, 256, 128)
    assert (source.out_load_latency, source.out_occupancy) == (1, 2)
    assert (wide.out_load_latency, wide.out_occupancy) == (0, 1)
    assert choose_config(8, 4096, 1, 32, 128, 64, 128).out_occupancy == 2


def test_the_one_launch_path_is_offered_for_short_16_bit_rows_only():
    from tilegym_mamba2.runtime.tuning import CHAINED_SEGMENTS, chained_fits
    prefill = choose_config(1, 2048, 1, 32, 64, 128, 128)
    found = candidates(prefill, 2048 // prefill.chunk_size, chained=True)
    chained = [c for c in found if c.chained]
    assert [c.chunks_per_segment for c in chained] == list(CHAINED_SEGMENTS)
    assert all(c.chunk_size == 128 and c.out_head_tile <= 64 for c in chained)
    assert not any(c.chained for c in candidates(prefill, 16))  # the layer op and long rows: not asked
    assert chained_fits(2048, 128, torch.bfloat16) and chained_fits(4096, 64, torch.float16)
    assert not chained_fits(4097, 128, torch.bfloat16)   # a longer bucket fills the GPU with four launches
    assert not chained_fits(2048, 256, torch.bfloat16)   # wider states: not measured
    assert not chained_fits(2048, 128, torch.float32)


def test_a_saved_one_launch_choice_is_read_back_only_where_it_is_offered(tmp_path, capsys):
    prefill = choose_config(1, 2048, 1, 32, 64, 128, 128)
    path = str(tmp_path / "configs.json")

    def one_launch_fastest(config):
        return 0.05 if config.chained and config.chunks_per_segment == 4 else 0.08

    got = tuned_config(key(2048, batch=1, heads=32), prefill, one_launch_fastest, tune=True, cache=ConfigCache(path),
                       chained=True)
    assert got.chained and got.chunks_per_segment == 4 and got.chunk_size == 128
    assert "chained (128-token chunks)" in capsys.readouterr().err
    again = tuned_config(key(2048, batch=1, heads=32), prefill, FakeTimer(best=1), tune=False,
                         cache=ConfigCache(path), chained=True)
    assert again == got
    # a caller the path is not offered to gets the heuristic, not a config it cannot run
    assert tuned_config(key(2048, batch=1, heads=32), prefill, FakeTimer(best=1), tune=False,
                        cache=ConfigCache(path)) == prefill


def test_shipped_choices_stand_in_where_the_users_file_has_none(tmp_path, monkeypatch):
    """A bucket measured on the H200 and shipped is taken without timing; the user's own file,
    where it has the bucket, comes first."""
    shipped = replace(BASE, chunks_per_segment=3 * BASE.chunks_per_segment)
    monkeypatch.setattr(tuning, "shipped_entries", lambda: {key(8192): vars(shipped)})
    timer = FakeTimer(best=1)
    path = str(tmp_path / "configs.json")
    got = tuned_config(key(8192), BASE, timer, tune=True, cache=ConfigCache(path))
    assert got.chunks_per_segment == shipped.chunks_per_segment and timer.calls == 0
    own = replace(BASE, chunks_per_segment=5)
    ConfigCache(path).put(key(8192), own)
    assert tuned_config(key(8192), BASE, timer, tune=True, cache=ConfigCache(path)).chunks_per_segment == 5
    fresh = tuned_config(key(8192), BASE, timer, tune=True, cache=ConfigCache(str(tmp_path / "b.json"), shipped=False),
                         log=lambda m: None)  # what benchmarks/tune_table.py measures with
    assert timer.calls == MEASURE_ROUNDS * len(candidates(BASE)) and fresh.chunks_per_segment != shipped.chunks_per_segment


def test_the_shipped_table_is_valid_and_installed():
    """Every shipped entry is a Config this version reads, never the chained path (its compile is
    what a first call must not pay), under a key of bucket_key's form; setup.cfg installs the file."""
    import configparser
    import os
    import re
    table = tuning.shipped_entries()
    assert table, "shipped_configs.json is missing or empty"
    form = re.compile(r"^[^|]+\|(bfloat16|float16|float32)\|bh\d+\|t\d+\|hpg\d+\|P\d+\|N\d+(\|layer)?$")
    for name, entry in table.items():
        config = config_from_entry(entry)
        assert config is not None and not config.chained, name
        assert form.match(name), name
    setup = configparser.ConfigParser()
    setup.read(os.path.join(os.path.dirname(__file__), "..", "..", "setup.cfg"))
    folder = os.path.dirname(os.path.abspath(tuning.SHIPPED_CONFIGS))
    root = os.path.dirname(os.path.abspath(tilegym_mamba2.__file__))
    package = ".".join(["tilegym_mamba2", *os.path.relpath(folder, root).split(os.sep)])
    assert os.path.basename(tuning.SHIPPED_CONFIGS) in setup["options.package_data"][package]


def test_a_saved_chained_choice_counts_only_where_the_chained_path_is_wanted(tmp_path, monkeypatch):
    """A bucket saved with the one-launch path (TILEGYM_MAMBA2_TUNE=all, or an older version) is
    measured again without it by default: that path compiles for ~30 s per new token count."""
    path = str(tmp_path / "configs.json")
    ConfigCache(path).put(key(2048), chained_config(BASE, 4))
    timer = FakeTimer(best=BASE.chunks_per_segment)
    assert tuned_config(key(2048), BASE, timer, tune=True, chained=True, cache=ConfigCache(path)).chained
    assert timer.calls == 0
    assert tuned_config(key(2048), BASE, timer, tune=False, cache=ConfigCache(path)) == BASE
    again = tuned_config(key(2048), BASE, timer, tune=True, cache=ConfigCache(path), log=lambda m: None)
    assert not again.chained and timer.calls == MEASURE_ROUNDS * len(candidates(BASE))
    monkeypatch.delenv("TILEGYM_MAMBA2_TUNE", raising=False)
    assert not tuning.chained_wanted()
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "all")
    assert tuning.chained_wanted() and tuning.tuning_enabled()
