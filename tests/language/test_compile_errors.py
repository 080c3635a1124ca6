"""Kernels that cannot compile raise tegula.CompileError naming this file, the line and the construct.

Each offending line ends with a `# error: <tag>` comment; the expected line number is found
from it, so editing this file does not break the tests.
"""

import re
from pathlib import Path

import pytest

import tegula
import tegula.language as T

THIS_FILE = Path(__file__)


def line_of(tag):
    for number, text in enumerate(THIS_FILE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# error: {tag}"):
            return number
    raise LookupError(tag)


def assert_compile_error(factory, target, tag, *construct_words):
    """Building and compiling `factory()` raises CompileError at the line tagged `tag`."""
    with pytest.raises(tegula.CompileError) as info:
        tegula.compile(factory(), out_idx=[-1], target=target)
    message = str(info.value)
    line = line_of(tag)
    # "file.py:42" or Python's own 'File "file.py", line 42'.
    assert re.search(rf"{re.escape(THIS_FILE.name)}(:|\"?, line )\s*{line}\b", message), message
    for word in construct_words:
        assert word.lower() in message.lower(), message


def unknown_tile_op():
    @T.prim_func
    def main(A: T.Tensor((16,), "float32"), B: T.Tensor((16,), "float32")):
        with T.Kernel(1):
            a = T.alloc_fragment((16,), "float32")
            T.copy(A, a)
            T.no_such_op(a)  # error: unknown-op
            T.copy(a, B)

    return main


def copy_shape_mismatch():
    @T.prim_func
    def main(A: T.Tensor((8, 8), "float32"), B: T.Tensor((8, 8), "float32")):
        with T.Kernel(1):
            big = T.alloc_shared((8, 8), "float32")
            small = T.alloc_shared((4, 8), "float32")
            T.copy(A, big)
            T.copy(big, small)  # error: copy-shape
            T.copy(big, B)

    return main


def gemm_shape_mismatch():
    @T.prim_func
    def main(A: T.Tensor((16, 32), "float32"), B: T.Tensor((16, 16), "float32"), C: T.Tensor((16, 16), "float32")):
        with T.Kernel(1):
            a = T.alloc_shared((16, 32), "float32")
            b = T.alloc_shared((16, 16), "float32")
            c = T.alloc_fragment((16, 16), "float32")
            T.copy(A, a)
            T.copy(B, b)
            T.clear(c)
            T.gemm(a, b, c)  # error: gemm-shape
            T.copy(c, C)

    return main


def reduce_dim_out_of_range():
    @T.prim_func
    def main(A: T.Tensor((8, 16), "float32"), B: T.Tensor((8,), "float32")):
        with T.Kernel(1):
            a = T.alloc_fragment((8, 16), "float32")
            s = T.alloc_fragment((8,), "float32")
            T.copy(A, a)
            T.reduce_sum(a, s, dim=2)  # error: reduce-dim
            T.copy(s, B)

    return main


def reduce_output_shape_mismatch():
    @T.prim_func
    def main(A: T.Tensor((8, 16), "float32"), B: T.Tensor((16,), "float32")):
        with T.Kernel(1):
            a = T.alloc_fragment((8, 16), "float32")
            s = T.alloc_fragment((16,), "float32")
            T.copy(A, a)
            T.reduce_max(a, s, dim=1)  # error: reduce-shape
            T.copy(s, B)

    return main


def lambda_in_kernel():
    @T.prim_func
    def main(A: T.Tensor((16,), "float32"), B: T.Tensor((16,), "float32")):
        with T.Kernel(1):
            double = lambda *x: x[0] * 2  # noqa: E731  # error: lambda
            for i in T.Parallel(16):
                B[i] = double(A[i])

    return main


def try_in_kernel():
    @T.prim_func
    def main(A: T.Tensor((16,), "float32"), B: T.Tensor((16,), "float32")):
        with T.Kernel(1):
            try:  # error: try
                for i in T.Parallel(16):
                    B[i] = A[i]
            except IndexError:
                pass

    return main


def undefined_name():
    @T.prim_func
    def main(A: T.Tensor((16,), "float32"), B: T.Tensor((16,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(16):
                B[i] = A[i] * not_defined_anywhere  # noqa: F821  # error: undefined-name

    return main


@pytest.mark.parametrize(
    "factory, tag, words",
    [
        pytest.param(unknown_tile_op, "unknown-op", ["no_such_op"], id="unknown-op"),
        pytest.param(copy_shape_mismatch, "copy-shape", ["copy"], id="copy-shape"),
        pytest.param(gemm_shape_mismatch, "gemm-shape", ["gemm"], id="gemm-shape"),
        pytest.param(reduce_dim_out_of_range, "reduce-dim", ["reduce", "dim"], id="reduce-dim"),
        pytest.param(reduce_output_shape_mismatch, "reduce-shape", ["reduce"], id="reduce-shape"),
        pytest.param(lambda_in_kernel, "lambda", ["lambda"], id="lambda"),
        pytest.param(try_in_kernel, "try", ["try"], id="try"),
        pytest.param(undefined_name, "undefined-name", ["not_defined_anywhere"], id="undefined-name"),
    ],
)
def test_compile_error_points_at_the_line(target, factory, tag, words):
    assert_compile_error(factory, target, tag, *words)
