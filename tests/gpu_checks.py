"""Helpers of the GPU tests: fresh seeds, and the package's relative error (inf for a NaN or inf
in the output, so that it fails every tolerance)."""
import os
import zlib

from tilegym_mamba2.testing import relative_error as rel_err


def fresh_seed() -> int:
    """This test's seed (failures print it): fixed by default, from the test's id, so that every
    run draws the same inputs; TILEGYM_MAMBA2_SEED=<n> replays a printed seed in every test,
    TILEGYM_MAMBA2_SEED=random draws new seeds (to explore; a failure still prints its own)."""
    chosen = os.environ.get("TILEGYM_MAMBA2_SEED")
    if chosen == "random":
        return int.from_bytes(os.urandom(4), "little")
    if chosen:
        return int(chosen)
    return seed_of_this_test()


def seed_of_this_test() -> int:
    """The running test's fixed seed: a checksum of its pytest id."""
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return zlib.crc32(test_id.encode())


