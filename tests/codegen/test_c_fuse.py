"""Loop fusion on the c target (tegula/codegen/c_fuse.py): adjacent loops over one range become one loop only where
no read can see a different value, fragments written and read in one iteration become scalars, and T.copy's edge
tests of one tile become one. Every kernel runs on c and interp; elementwise kernels must agree bit for bit."""
import re

import pytest
import torch

import tegula
import tegula.language as T


def _run_both(prim, *args):
    outs = []
    for target in ("interp", "c"):
        a = [x.clone() for x in args]
        tegula.compile(prim, target=target)(*a)
        outs.append(a)
    return outs


def _loops(prim) -> int:
    src = tegula.compile(prim, target="c").get_kernel_source()
    return len(re.findall(r"\bfor \(int32_t", src))


def rmsnorm(M, H, block_M):
    @T.prim_func
    def k(X: T.Tensor((M, H), "bfloat16"), W: T.Tensor((H,), "bfloat16"), Y: T.Tensor((M, H), "bfloat16")):
        with T.Kernel(T.ceildiv(M, block_M)) as bx:
            x = T.alloc_fragment((block_M, H), "float32")
            sq = T.alloc_fragment((block_M, H), "float32")
            ss = T.alloc_fragment((block_M,), "float32")
            T.copy(X[bx * block_M, 0], x)
            for i, j in T.Parallel(block_M, H):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(block_M):
                ss[i] = T.rsqrt(ss[i] / H + 1e-6)
            for i, j in T.Parallel(block_M, H):
                x[i, j] = x[i, j] * ss[i] * W[j]
            T.copy(x, Y[bx * block_M, 0])
    return k


@pytest.mark.parametrize("M", [8, 7])  # 7: the last block crosses the edge (the guarded path)
def test_rmsnorm_fused_matches_interp(M):
    H = 96
    x, w = torch.randn(M, H).bfloat16(), torch.randn(H).bfloat16()
    (_, _, yi), (_, _, yc) = _run_both(rmsnorm(M, H, 2), x, w, torch.zeros(M, H, dtype=torch.bfloat16))
    torch.testing.assert_close(yc.float(), yi.float(), rtol=1e-2, atol=1e-2)


def test_rmsnorm_is_two_passes_per_row():
    src = tegula.compile(rmsnorm(8, 96, 2), target="c").get_kernel_source()
    body = src.split("tg_k", 1)[1]
    assert not re.search(r"\bsq\[", body)  # the squares live in a register
    # fast and slow paths (one edge test): each a row loop around two column loops
    assert _loops(rmsnorm(8, 96, 2)) == 6


def softmax(M, N, bm):
    @T.prim_func
    def k(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(M, bm)) as bx:
            x = T.alloc_fragment((bm, N), "float32")
            mx = T.alloc_fragment((bm,), "float32")
            sm = T.alloc_fragment((bm,), "float32")
            T.copy(X[bx * bm, 0], x)
            T.reduce_max(x, mx, dim=1)
            for i, j in T.Parallel(bm, N):
                x[i, j] = T.exp(x[i, j] - mx[i])
            T.reduce_sum(x, sm, dim=1)
            for i, j in T.Parallel(bm, N):
                x[i, j] = x[i, j] / sm[i]
            T.copy(x, Y[bx * bm, 0])
    return k


def test_softmax_fused_matches_torch():
    x = torch.randn(10, 200)
    y = torch.zeros(10, 200)
    tegula.compile(softmax(10, 200, 4), target="c")(x, y)
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert _loops(softmax(10, 200, 4)) == 8  # two paths x (row loop + three column passes)


def reversed_read(N):
    """The second loop reads the first one's output in reverse: only the row loops may fuse."""
    @T.prim_func
    def k(X: T.Tensor((4, N), "float32"), Y: T.Tensor((4, N), "float32")):
        with T.Kernel(1) as bx:
            a = T.alloc_fragment((4, N), "float32")
            b = T.alloc_fragment((4, N), "float32")
            for i, j in T.Parallel(4, N):
                a[i, j] = X[i, j] * 2.0
            for i, j in T.Parallel(4, N):
                b[i, j] = a[i, N - 1 - j] + a[i, j]
            for i, j in T.Parallel(4, N):
                Y[i, j] = b[i, j]
    return k


def shifted_rows(N):
    """The second loop reads the next row of the first one's output: nothing may fuse."""
    @T.prim_func
    def k(X: T.Tensor((4, N), "float32"), Y: T.Tensor((4, N), "float32")):
        with T.Kernel(1) as bx:
            a = T.alloc_fragment((4, N), "float32")
            for i, j in T.Parallel(4, N):
                a[i, j] = X[i, j] + 1.0
            for i, j in T.Parallel(4, N):
                Y[i, j] = a[(i + 1) % 4, j] * a[i, j]
    return k


def transposed(N):
    @T.prim_func
    def k(X: T.Tensor((N, N), "float32"), Y: T.Tensor((N, N), "float32")):
        with T.Kernel(1) as bx:
            a = T.alloc_fragment((N, N), "float32")
            b = T.alloc_fragment((N, N), "float32")
            for i, j in T.Parallel(N, N):
                a[i, j] = X[i, j] * 3.0
            for i, j in T.Parallel(N, N):
                b[i, j] = a[j, i] - X[i, j]   # reads what the first loop wrote, transposed
            for i, j in T.Parallel(N, N):
                Y[i, j] = b[i, j]
    return k


def in_place_reuse(N):
    """A buffer rewritten by the second loop after the first read it elsewhere (write after read)."""
    @T.prim_func
    def k(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(1) as bx:
            a = T.alloc_fragment((N,), "float32")
            b = T.alloc_fragment((N,), "float32")
            for j in T.Parallel(N):
                a[j] = X[j]
            for j in T.Parallel(N):
                b[j] = a[(j + 1) % N]
            for j in T.Parallel(N):
                a[j] = b[j] * 0.5
            for j in T.Parallel(N):
                Y[j] = a[j] + b[j]
    return k


def scalar_between(N):
    """A 1-element fragment updated by one loop and read by the next: the second must see the final value."""
    @T.prim_func
    def k(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(1) as bx:
            s = T.alloc_fragment((1,), "float32")
            s[0] = 0.0
            for j in T.serial(N):
                s[0] = s[0] + X[j]
            for j in T.Parallel(N):
                Y[j] = X[j] - s[0]
    return k


@pytest.mark.parametrize("make,args", [
    (reversed_read, lambda n: (torch.randn(4, n), torch.zeros(4, n))),
    (shifted_rows, lambda n: (torch.randn(4, n), torch.zeros(4, n))),
    (transposed, lambda n: (torch.randn(n, n), torch.zeros(n, n))),
    (in_place_reuse, lambda n: (torch.randn(n), torch.zeros(n))),
    (scalar_between, lambda n: (torch.randn(n), torch.zeros(n))),
], ids=["reversed", "shifted_rows", "transposed", "in_place_reuse", "scalar_between"])
def test_dependences_are_kept(make, args):
    n = 24
    prim = make(n)
    (_, yi), (_, yc) = _run_both(prim, *args(n))
    if make is scalar_between:
        torch.testing.assert_close(yc, yi, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(yc, yi)


def test_what_fuses_in_the_dependence_cases():
    assert _loops(reversed_read(24)) == 3      # one row loop: column loops 1 | 2+3
    assert _loops(shifted_rows(24)) == 4       # nothing fuses
    assert _loops(transposed(24)) == 4         # 1 | 2+3
    assert _loops(in_place_reuse(24)) == 3     # 1 | 2 | 3+4


def guarded_twice():
    @T.prim_func
    def k(Y: T.Tensor((4,), "float32"), flag: T.int32):
        with T.Kernel(1) as _b:
            if flag > 0:
                Y[0] = 1.0
            Y[1] = 2.0  # runs whatever flag is, between two ifs of one condition
            if flag > 0:
                Y[2] = 3.0
    return k


@pytest.mark.parametrize("flag", [0, 1])
def test_statements_between_merged_ifs_still_run_when_the_condition_fails(flag):
    prim = guarded_twice()
    for target in ("interp", "c"):
        y = torch.zeros(4)
        tegula.compile(prim, target=target)(y, flag)
        assert y.tolist() == ([1.0, 2.0, 3.0, 0.0] if flag else [0.0, 2.0, 0.0, 0.0]), target


def condition_updated_in_first_branch():
    @T.prim_func
    def k(X: T.Tensor((4,), "int32"), Y: T.Tensor((4,), "int32")):
        with T.Kernel(1) as _b:
            ok = X[0] > 0
            if ok:
                Y[0] = 1
                ok = X[1] > 0  # the next if reads this value
            else:
                Y[0] = 2
            if ok:
                Y[1] = 3
            else:
                Y[1] = 4
    return k


@pytest.mark.parametrize("x0,x1", [(1, 0), (1, 1), (0, 1)])
def test_ifs_do_not_merge_when_the_first_updates_the_condition(x0, x1):
    """Two ifs on one variable do not become one where the first's branch assigns that variable (the merged form
    tested the old value twice: rows with an infinite product took rmsnorm's fused cast)."""
    want = [1, 3 if x1 > 0 else 4] if x0 > 0 else [2, 4]
    for target in ("interp", "c"):
        y = torch.zeros(4, dtype=torch.int32)
        tegula.compile(condition_updated_in_first_branch(), target=target)(torch.tensor([x0, x1, 0, 0],
                                                                                        dtype=torch.int32), y)
        assert y[:2].tolist() == want, target
