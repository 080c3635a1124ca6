"""The README's library example runs as written (the text users copy first)."""
import pathlib

import pytest

torch = pytest.importorskip("torch")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _block_after(heading: str) -> str:
    text = README.read_text()
    assert heading in text, f"README lost its {heading!r} section"
    section = text.split(heading, 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_library_example_runs():
    env: dict = {}
    exec(compile(_block_after("## The libraries"), "README.md", "exec"), env)
    assert env["d"].shape == (4, 512)
    ref = env["a"].float() @ env["b"].float().T
    assert env["deep_gemm"].calc_diff(env["d"], ref) < 1e-3
    values, indices = env["values"], env["indices"]
    assert indices.shape == (8, 512) and values.shape == (8, 512)
    assert env["q"].dtype == torch.float8_e4m3fn and env["sf"].shape == (4, 8)
    assert env["out"].shape == (2, 1, 16, 512) and env["lse"].shape == (2, 16, 1)
    assert torch.isfinite(env["out"].float()).all()
