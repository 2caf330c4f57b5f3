"""The tuning cache survives what a shared home directory does to it: corrupt or ill-typed
content, bad entries, processes and threads writing at once, writers killed mid-write."""
import json
import multiprocessing
import os
import threading
from dataclasses import asdict, replace

import pytest
import torch

from tilegym_mamba2.runtime import config_store
from tilegym_mamba2.runtime.tuning import ConfigCache, bucket_key, choose_config, tuned_config

BASE = choose_config(4, 16384, 1, 8, 64, 128, 128)


def key(tokens):
    return bucket_key("a GPU without shipped choices", torch.bfloat16, 4, tokens, 8, 1, 64, 128)


def never_timed(config):
    raise AssertionError("nothing should be timed with tuning off")


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"text"', "17", "{not json", "",
                                     "[" * 100000 + "]" * 100000, '{"k": ' + "[" * 100000 + "]" * 100000 + "}"],
                         ids=["list", "null", "text", "number", "not json", "empty", "deep list", "deep entry"])
def test_ill_typed_or_unreadable_content_is_ignored_with_one_warning(tmp_path, capsys, content):
    path = tmp_path / "configs.json"
    path.write_text(content)
    config_store._warned.discard(str(path))
    for tokens in (1024, 2048):  # two new shapes, one warning
        assert tuned_config(key(tokens), BASE, never_timed, tune=False, cache=ConfigCache(str(path))) == BASE
    assert capsys.readouterr().err.count("ignoring") == 1
    ConfigCache(str(path)).put(key(4096), BASE)  # and the next write makes it an object again
    assert list(json.loads(path.read_text())) == [key(4096)]


@pytest.mark.parametrize("bad", [0, -3, "lots", True, 2.5, None, 1 << 20])
def test_entries_with_bad_values_are_ignored(tmp_path, bad):
    path = tmp_path / "configs.json"
    entry = dict(asdict(BASE), chunks_per_segment=bad)
    path.write_text(json.dumps({key(4096): entry, key(8192): "not an entry", key(16384): asdict(BASE)}))
    cache = ConfigCache(str(path))
    assert cache.get(key(4096)) is None
    assert cache.get(key(8192)) is None
    assert cache.get(key(16384)) == BASE
    assert tuned_config(key(4096), BASE, never_timed, tune=False, cache=cache) == BASE


@pytest.mark.parametrize("field,bad", [("out_occupancy", 7), ("out_occupancy", 0), ("out_load_latency", 11),
                                       ("out_load_latency", 1e30), ("out_load_latency", 10 ** 30),
                                       ("state_tile", 48), ("out_head_tile", 512), ("chunk_size", 100)])
def test_entries_outside_the_documented_ranges_are_ignored(tmp_path, field, bad):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({key(4096): dict(asdict(BASE), **{field: bad})}))
    assert ConfigCache(str(path)).get(key(4096)) is None


@pytest.mark.parametrize("where", ["configs.json", "configs.json.lock"])
def test_a_fifo_in_the_caches_place_never_blocks(tmp_path, capsys, where):
    """A FIFO with no writer blocks an open for reading forever (and one with no reader an open for
    writing): the cache reads nothing from it, and a write that finds one at the lock fails at once."""
    path = tmp_path / "configs.json"
    os.mkfifo(tmp_path / where)
    done = []

    def use():
        cache = ConfigCache(str(path))
        done.append(cache.get(key(4096)))
        cache.put(key(4096), BASE)          # warns and goes on where it cannot save
        done.append("put")

    worker = threading.Thread(target=use, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), f"the tuning cache's use of a FIFO at {where} blocked (its thread still waits)"
    assert done == [None, "put"]


def _write_many(path, prefix, count):
    for i in range(count):
        ConfigCache(path).put(f"{prefix}-{i}", replace(BASE, chunks_per_segment=i + 1))


def test_processes_writing_at_once_keep_each_others_entries(tmp_path):
    path = str(tmp_path / "configs.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(path, f"p{n}", 25)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    entries = json.loads(open(path).read())
    assert sorted(entries) == sorted(f"p{n}-{i}" for n in range(3) for i in range(25))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_threads_writing_at_once_never_publish_half_a_file(tmp_path):
    path = str(tmp_path / "configs.json")
    ConfigCache(path).put("seed", BASE)
    bad_reads, done = [], threading.Event()

    def reader():
        while not done.is_set():
            try:
                json.loads(open(path).read())
            except ValueError as e:
                bad_reads.append(e)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=_write_many, args=(path, f"t{n}", 30)) for n in range(6)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert not bad_reads
    assert len(json.loads(open(path).read())) == 1 + 6 * 30


def test_a_killed_writers_temporary_file_is_cleaned_up(tmp_path):
    path = tmp_path / "configs.json"
    stale = tmp_path / "configs.json.4242.17.deadbeef.tmp"
    stale.write_text('{"half": ')
    ConfigCache(str(path)).put(key(4096), BASE)
    assert not stale.exists()
    assert ConfigCache(str(path)).get(key(4096)) == BASE
