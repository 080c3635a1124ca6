"""Benchmarks: side-by-side ratios against the peers and the machine's measured peak. Run as `python -m bench.X`."""
