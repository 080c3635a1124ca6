"""Expression semantics: integer division, literal typing, math intrinsics, casts, constants."""

import functools

import pytest
import torch
from narrow import narrow_reference

import tegula
import tegula.language as T


def test_integer_floor_division_and_modulo(target):
    # Python semantics, not C truncation: -7 // 2 == -4 and -7 % 2 == 1.
    N = 32

    @T.prim_func
    def main(A: T.Tensor((N,), "int32"), D: T.Tensor((N,), "int32"), B: T.Tensor((9, N), "int32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[0, i] = A[i] // D[i]
                B[1, i] = A[i] % D[i]
                B[2, i] = A[i] // 3
                B[3, i] = A[i] % 3
                B[4, i] = (i - 16) // 5
                B[5, i] = (i - 16) % 5
                B[6, i] = T.ceildiv(i + 1, 4)
                B[7, i] = A[i] // -3
                B[8, i] = A[i] % -3

    a = torch.randint(-50, 50, (N,), dtype=torch.int32)
    d = torch.randint(1, 7, (N,), dtype=torch.int32) * torch.where(torch.rand(N) < 0.5, -1, 1).int()
    a[:4] = torch.tensor([-7, 7, -7, 7])
    d[:4] = torch.tensor([2, -2, -2, 2])
    b = tegula.compile(main, out_idx=[-1], target=target)(a, d)
    i = torch.arange(N, dtype=torch.int32)
    expected = torch.stack([
        torch.div(a, d, rounding_mode="floor"), torch.remainder(a, d),
        torch.div(a, 3, rounding_mode="floor"), torch.remainder(a, 3),
        torch.div(i - 16, 5, rounding_mode="floor"), torch.remainder(i - 16, 5),
        (i + 1 + 3) // 4,
        torch.div(a, -3, rounding_mode="floor"), torch.remainder(a, -3),
    ]).int()
    assert b[0, :4].tolist() == [-4, -4, 3, 3]
    assert b[1, :4].tolist() == [1, -1, -1, 1]
    assert torch.equal(b, expected)


def test_float_literals_take_the_float32_type(target):
    # x * 0.1 is a float32 multiply by float32(0.1), as torch does it: promoting to double and
    # rounding back gives a different last bit for about one value in five.
    N = 256

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((3, N), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[0, i] = A[i] * 0.1
                B[1, i] = (A[i] + 1.0) - A[i]  # 2**24 + 1 rounds back to 2**24 in float32
                B[2, i] = A[i] * 0.5 + 1

    a = torch.randn(N) * 100
    a[:3] = torch.tensor([2.0**24, 2.0**25, 3.0])
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    assert b.dtype == torch.float32
    assert torch.equal(b[0], a * 0.1)
    assert b[1, :3].tolist() == [0.0, 0.0, 1.0]
    assert torch.equal(b[1], (a + 1.0) - a)
    assert torch.equal(b[2], a * 0.5 + 1)


def test_int_literals_keep_int32(target):
    N = 16

    @T.prim_func
    def main(A: T.Tensor((N,), "int32"), B: T.Tensor((3, N), "int32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[0, i] = A[i] + 1
                B[1, i] = i * 3 - 1
                B[2, i] = A[i] * 2 // 3

    a = torch.randint(-1000, 1000, (N,), dtype=torch.int32)
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    i = torch.arange(N, dtype=torch.int32)
    assert b.dtype == torch.int32
    assert torch.equal(b[0], a + 1)
    assert torch.equal(b[1], i * 3 - 1)
    assert torch.equal(b[2], torch.div(a * 2, 3, rounding_mode="floor"))


# One kernel computes every intrinsic, one row each; it is compiled once per target.
INTRINSICS = {
    "exp": lambda p, x: torch.exp(x),
    "exp2": lambda p, x: torch.exp2(x),
    "log": lambda p, x: torch.log(p),
    "log2": lambda p, x: torch.log2(p),
    "sqrt": lambda p, x: torch.sqrt(p),
    "rsqrt": lambda p, x: torch.rsqrt(p),
    "sigmoid": lambda p, x: torch.sigmoid(x),
    "tanh": lambda p, x: torch.tanh(x),
    "erf": lambda p, x: torch.erf(x),
    "pow": lambda p, x: torch.pow(p, x),
    "floor": lambda p, x: torch.floor(x),
    "ceil": lambda p, x: torch.ceil(x),
    "abs": lambda p, x: torch.abs(x),
    "max": lambda p, x: torch.maximum(x, p),
    "min": lambda p, x: torch.minimum(x, p),
    "clamp": lambda p, x: torch.clamp(x, -1.0, 1.0),
    "if_then_else": lambda p, x: torch.where(x > 0, x, 0.5 * x),
}
N_INTRINSIC = 128


@functools.cache
def intrinsic_results(target):
    N = N_INTRINSIC

    @T.prim_func
    def main(P: T.Tensor((N,), "float32"), X: T.Tensor((N,), "float32"), B: T.Tensor((len(INTRINSICS), N), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[0, i] = T.exp(X[i])
                B[1, i] = T.exp2(X[i])
                B[2, i] = T.log(P[i])
                B[3, i] = T.log2(P[i])
                B[4, i] = T.sqrt(P[i])
                B[5, i] = T.rsqrt(P[i])
                B[6, i] = T.sigmoid(X[i])
                B[7, i] = T.tanh(X[i])
                B[8, i] = T.erf(X[i])
                B[9, i] = T.pow(P[i], X[i])
                B[10, i] = T.floor(X[i])
                B[11, i] = T.ceil(X[i])
                B[12, i] = T.abs(X[i])
                B[13, i] = T.max(X[i], P[i])
                B[14, i] = T.min(X[i], P[i])
                B[15, i] = T.clamp(X[i], -1.0, 1.0)
                B[16, i] = T.if_then_else(X[i] > 0, X[i], 0.5 * X[i])

    gen = torch.Generator().manual_seed(0)
    p = torch.rand(N, generator=gen) * 8 + 0.01  # positive, for log, sqrt, rsqrt and pow's base
    x = torch.randn(N, generator=gen) * 3
    x[:4] = torch.tensor([-2.5, -0.0, 2.5, 1.0])
    b = tegula.compile(main, out_idx=[-1], target=target)(p, x)
    return p, x, b


@pytest.mark.parametrize("name", list(INTRINSICS))
def test_math_intrinsic(target, name):
    p, x, b = intrinsic_results(target)
    row = list(INTRINSICS).index(name)
    torch.testing.assert_close(b[row], INTRINSICS[name](p, x), rtol=1e-5, atol=1e-6)


CAST_TARGETS = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3": torch.float8_e4m3fn,  # TileLang's spelling of the same type
    "float8_e5m2": torch.float8_e5m2,
}


def cast_probe_values():
    special = torch.tensor(
        [
            0.0, -0.0, 1.0, -1.0, 0.1, -0.3,
            448.0, 464.0, 479.0, 480.0, 500.0, 1e6, -1e6, float("inf"), float("-inf"),  # e4m3fn: saturates at 448
            57344.0, 61439.0, 61440.0, 65504.0, 65520.0, 3.4e38,  # e5m2 / float16 / bfloat16 edges
            2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-16, 2.0**-17, 1e-7, 1e-40,  # fp8 / fp16 subnormals, ties
            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4,  # ties at bf16 / fp8 precision
        ],
        dtype=torch.float32,
    )
    spread = torch.randn(256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-8, 5, 256)
    return torch.cat([special, spread])


@pytest.mark.parametrize("dtype", list(CAST_TARGETS))
def test_cast_float32_to_narrow_floats_bit_exact(target, dtype):
    a = cast_probe_values()
    N = a.numel()

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), dtype)):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = T.cast(A[i], dtype)

    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    expected = narrow_reference(a, CAST_TARGETS[dtype])
    assert b.dtype == expected.dtype
    bits = torch.int16 if expected.element_size() == 2 else torch.uint8
    mismatch = (b.view(bits) != expected.view(bits)).nonzero().flatten()
    assert mismatch.numel() == 0, f"{dtype}: {a[mismatch][:8].tolist()} -> {b[mismatch][:8].float().tolist()}"


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float16", "bfloat16"])
def test_cast_narrow_floats_to_float32_exact(target, dtype):
    # Every non-NaN bit pattern (for the 16-bit types, every 61st) widens exactly.
    torch_dtype = CAST_TARGETS[dtype]
    if torch_dtype.itemsize == 1:
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    else:
        bits = torch.arange(-(2**15), 2**15, 61, dtype=torch.int32).to(torch.int16)
    a = bits.view(torch_dtype)
    a = a[~a.float().isnan()].contiguous()
    N = a.numel()

    @T.prim_func
    def main(A: T.Tensor((N,), dtype), B: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = T.cast(A[i], "float32")

    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    assert torch.equal(b.view(torch.int32), a.float().view(torch.int32))


def test_cast_float_to_int_truncates(target):
    N = 8

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "int32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = T.cast(A[i], "int32")

    a = torch.tensor([2.7, -2.7, 0.5, -0.5, 100.99, -100.99, 0.0, 12345.5])
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    assert torch.equal(b, a.to(torch.int32))


def test_dtype_constants(target):
    @T.prim_func
    def main(F: T.Tensor((6,), "float32"), I: T.Tensor((2,), "int32"), H: T.Tensor((2,), "float16")):
        with T.Kernel(1):
            F[0] = T.infinity("float32")
            F[1] = -T.infinity("float32")
            F[2] = T.max_value("float32")
            F[3] = T.min_value("float32")
            F[4] = T.cast(T.max_value("bfloat16"), "float32")
            F[5] = T.cast(T.max_value(T.float8_e4m3fn), "float32")
            I[0] = T.max_value("int32")
            I[1] = T.min_value(T.int32)
            H[0] = T.max_value("float16")
            H[1] = -T.infinity(T.float16)

    f, i, h = tegula.compile(main, out_idx=[0, 1, 2], target=target)()
    fmax = torch.finfo(torch.float32).max
    assert f.tolist() == [float("inf"), float("-inf"), fmax, -fmax, torch.finfo(torch.bfloat16).max, 448.0]
    assert i.tolist() == [2**31 - 1, -(2**31)]
    assert h.tolist() == [65504.0, float("-inf")]


def test_dtype_objects_and_strings_mix(target):
    N = 8

    @T.prim_func
    def main(A: T.Tensor((N,), T.float16), B: T.Tensor((N,), "bfloat16"), C: T.Tensor((N,), T.float32)):
        with T.Kernel(1):
            acc = T.alloc_fragment((N,), T.float32)
            for i in T.Parallel(N):
                acc[i] = T.cast(A[i], T.float32) + T.cast(B[i], "float32")
            T.copy(acc, C)

    a, b = torch.randn(N).half(), torch.randn(N).bfloat16()
    c = tegula.compile(main, out_idx=[-1], target=target)(a, b)
    assert torch.equal(c, a.float() + b.float())


def test_float_is_an_alias_of_float32(target):
    # TileLang's own examples spell the accumulator type "float".
    N = 8

    @T.prim_func
    def main(A: T.Tensor((N,), "float"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            acc = T.alloc_fragment((N,), "float")
            T.copy(A, acc)
            T.copy(acc, B)

    a = torch.randn(N)
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    assert torch.equal(b, a)
