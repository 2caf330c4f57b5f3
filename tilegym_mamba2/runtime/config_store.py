"""The tuning cache's file, configs.json: a JSON object of entries that survives corruption and
concurrent writers.

* Reading: a file that is not JSON, or JSON that is not an object, or an entry that is not an
  object, is ignored with one warning per file and process (the entries that are fine are kept).
* Writing: under an exclusive lock on ``configs.json.lock``, the file is read again and the new
  entry merged into what is there, so processes tuning at once keep each other's entries; the
  result goes to a temporary file named after the process, the thread and a random tag, then
  replaces the file atomically (a reader sees the old file or the new one, never half of one).
* A writer killed mid-write leaves its temporary file: the next writer, holding the lock, removes
  every temporary file (all writers write theirs under the lock, so any it finds is stale).
"""
import contextlib
import glob
import json
import os
import stat
import sys
import threading
import uuid

try:
    import fcntl
except ImportError:  # no POSIX locks (Windows): atomic replacement alone, last writer wins
    fcntl = None

_warned: set = set()
_thread_lock = threading.Lock()


def _warn_once(path: str, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        print(f"[tilegym-mamba2] {message}", file=sys.stderr)


def read_entries(path: str) -> dict:
    """{key: entry dict} of the file; {} when it is missing or unreadable (warned once). A path that
    is not a regular file (a FIFO, a device, a folder) is never opened for reading: a FIFO with no
    writer would block the read forever."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn_once(path, f"ignoring unreadable tuning cache {path}: {type(e).__name__}: {e}")
        return {}
    if not stat.S_ISREG(mode):
        _warn_once(path, f"ignoring tuning cache {path}: not a regular file")
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:   # RecursionError: nesting deeper than json reads
        _warn_once(path, f"ignoring unreadable tuning cache {path}: {type(e).__name__}: {e}")
        return {}
    if not isinstance(data, dict):
        _warn_once(path, f"ignoring tuning cache {path}: a JSON {type(data).__name__}, not an object of entries")
        return {}
    entries = {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, dict)}
    if len(entries) != len(data):
        _warn_once(path, f"ignoring {len(data) - len(entries)} malformed entries of tuning cache {path}")
    return entries


@contextlib.contextmanager
def _locked(path: str):
    with _thread_lock:  # threads of one process share a file descriptor's lock: serialize them first
        if fcntl is None:
            yield
            return
        # O_NONBLOCK: a FIFO standing where the lock file goes fails here (ENXIO) instead of
        # blocking the open until some reader comes.
        fd = os.open(path + ".lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path}.lock is not a regular file")
        with os.fdopen(fd, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def write_entry(path: str, key: str, entry: dict) -> dict:
    """Merges {key: entry} into the file under the lock -> every entry now in it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with _locked(path):
        for stale in glob.glob(glob.escape(path) + ".*.tmp"):
            with contextlib.suppress(OSError):
                os.remove(stale)
        entries = read_entries(path)
        entries[key] = entry
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return entries
