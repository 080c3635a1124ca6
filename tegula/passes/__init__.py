"""Compiler passes: each a pure function ``run(func, target) -> func`` in its own file; pipeline.py orders them."""
