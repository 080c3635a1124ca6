"""Every script in examples/ on every target, against its torch reference."""

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@functools.cache
def example(name):
    """Import examples/<name>.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location(f"tegula_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check(name, target, reference_kwargs=None, **sizes):
    ex = example(name)
    kernel, inputs = ex.prepare(target, **sizes)
    out = kernel(*inputs)
    ref = ex.reference(*inputs, **(reference_kwargs or {}))
    assert out.shape == ref.shape
    assert out.dtype == inputs[0].dtype
    torch.testing.assert_close(out.to(ref.dtype), ref, **ex.TOLERANCE[sizes["dtype"]])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("M, N", [(64, 256), (70, 300)])  # the second leaves a tail in both dims
def test_elementwise_add(target, M, N, dtype):
    check("elementwise_add", target, M=M, N=N, dtype=dtype)


@pytest.mark.parametrize(
    "M, N, K, dtype",
    [
        (256, 256, 128, "float32"),
        (256, 128, 96, "float16"),
        (128, 256, 64, "bfloat16"),
        (160, 136, 72, "float32"),  # a tail in M, N and K
        (200, 72, 40, "float16"),
    ],
)
def test_gemm(target, M, N, K, dtype):
    check("gemm", target, M=M, N=N, K=K, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M, N", [(64, 128), (37, 96)])  # 37 rows: the last block is partly outside X
def test_softmax(target, M, N, dtype):
    check("softmax", target, M=M, N=N, dtype=dtype)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "batch, heads, seq_len, dim, dtype",
    [
        (1, 2, 128, 32, "float16"),
        (2, 1, 96, 64, "float16"),  # 96 = 64 + 32: a partial query block and key block
        (1, 2, 64, 32, "float32"),
    ],
)
def test_flash_attention(target, batch, heads, seq_len, dim, is_causal, dtype):
    check(
        "flash_attention", target, reference_kwargs={"is_causal": is_causal},
        batch=batch, heads=heads, seq_len=seq_len, dim=dim, is_causal=is_causal, dtype=dtype,
    )


def test_flash_attention_smaller_blocks(target):
    # block_N < block_M: a causal query block spans several key blocks past its start.
    check(
        "flash_attention", target, reference_kwargs={"is_causal": True},
        batch=1, heads=1, seq_len=80, dim=16, is_causal=True, dtype="float32", block_M=32, block_N=16,
    )


@pytest.mark.parametrize(
    "name, args",
    [
        ("elementwise_add", ["--M", "40", "--N", "200"]),
        ("gemm", ["--M", "128", "--N", "128", "--K", "64"]),
        ("softmax", ["--M", "20", "--N", "64"]),
        ("flash_attention", ["--heads", "1", "--seq-len", "64", "--dim", "32", "--causal"]),
    ],
)
def test_demo_main(name, args, monkeypatch, capsys):
    # The script's own entry point, at a small size: it checks itself and prints a timing line.
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--target", "c", *args])
    example(name).main()
    printed = capsys.readouterr().out
    assert "matches torch" in printed
    assert "tegula/torch time ratio" in printed
