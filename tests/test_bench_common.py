"""bench.common's helpers that decide what a benchmark measures (the working-set sizes)."""
import ast
import pathlib

from bench.common import LLC_DEFAULT, cache_size_bytes, last_level_cache, summary


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


def test_tile_kernels_cache_rows():
    """The cache columns' slice of bench.tile_kernels: whole 128-row bands, at most 1024 rows, and at most a quarter
    of the last-level cache (read and written); 128 rows where the cache is smaller than that."""
    from bench.tile_kernels import cache_rows

    row = 7168 * 3
    assert cache_rows(480 << 20) == 1024
    assert cache_rows(32 << 20) == 384 and 384 * row <= (32 << 20) // 4
    assert cache_rows(1 << 20) == 128
    for llc in (8 << 20, 45 << 20, 96 << 20, 260 << 20):
        r = cache_rows(llc)
        assert r % 128 == 0 and 128 <= r <= 1024 and (r == 128 or r * row <= llc // 4)


def test_summary_is_the_first_paragraph():
    """--help states a benchmark's whole first paragraph on one line, not its first line (which may stop
    mid-sentence); every bench module's summary is a whole sentence."""
    assert summary("One line.\nstill the first sentence.\n\nDetails.") == "One line. still the first sentence."
    assert summary("\n  Indented   words\n") == "Indented words"
    benches = sorted((pathlib.Path(__file__).parent.parent / "bench").glob("*.py"))
    assert benches
    for f in benches:
        text = f.read_text()
        if f.name in ("__init__.py", "common.py") or "argparse" not in text:
            continue
        doc = ast.get_docstring(ast.parse(text))
        assert doc and summary(doc).endswith((".", ")")), f.name
        assert "summary(__doc__)" in text, f"{f.name}: --help should describe it by summary(__doc__)"
