"""bench.common's helpers that decide what a benchmark measures (the working-set sizes)."""
from bench.common import LLC_DEFAULT, cache_size_bytes, last_level_cache


def test_cache_size_bytes():
    assert cache_size_bytes("491520K\n") == 491520 << 10
    assert cache_size_bytes("32M") == 32 << 20
    assert cache_size_bytes("1G") == 1 << 30
    assert cache_size_bytes("1024") == 1024
    for bad in ("", "K", "12Q", "abc", "-5K"):
        assert cache_size_bytes(bad) == 0


def test_last_level_cache_is_a_size():
    llc = last_level_cache()
    assert isinstance(llc, int) and llc > 0
    assert llc == LLC_DEFAULT or llc >= 1 << 16  # a real answer is at least an L2's size
