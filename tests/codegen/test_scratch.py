"""The c target's on-chip buffers of more than 64 KiB a thread (codegen/c.py's heap path): each thread keeps one
block per kernel library between calls (tegula_rt.h tg_scratch / tg_scratch_done: page aligned, grown for a
larger grid, freed when the thread exits); requests over TG_SCRATCH_MAX take the heap each call. Results equal
interp's with the block reused, grown, and used from several threads at once."""
import ctypes

import pytest
import torch
from prelude_driver import build

import tegula
import tegula.language as T
from tegula.codegen.c import HEAP_THRESHOLD
from tests._threads import run_in_threads

DRIVER = r"""
#include "tegula_rt.h"

static void *worker(void *arg) {
  void *p = tg_scratch(4096);
  *(void **)arg = p;
  tg_scratch_done(p, 4096);
  return NULL;
}

/* out: [page aligned, reused, grown block page aligned, grown block reused, over-max 64-byte aligned,
 *       over-max not the kept block, kept block still returned after it, another thread's block differs] */
void probe(int64_t *out) {
  char *a = tg_scratch(1000);
  memset(a, 1, 1000);
  tg_scratch_done(a, 1000);
  char *b = tg_scratch(1000);
  out[0] = (intptr_t)a % 4096 == 0;
  out[1] = a == b && b[999] == 1;
  tg_scratch_done(b, 1000);
  char *c = tg_scratch(200000);
  memset(c, 2, 200000);
  tg_scratch_done(c, 200000);
  char *d = tg_scratch(1000);
  out[2] = (intptr_t)c % 4096 == 0;
  out[3] = c == d && d[0] == 2;
  tg_scratch_done(d, 1000);
  char *e = tg_scratch(TG_SCRATCH_MAX + 1);
  memset(e, 3, TG_SCRATCH_MAX + 1);
  out[4] = (intptr_t)e % 64 == 0;
  out[5] = e != c;
  tg_scratch_done(e, TG_SCRATCH_MAX + 1);
  char *f = tg_scratch(5000);
  out[6] = f == c;
  void *theirs = NULL;
  pthread_t t;
  pthread_create(&t, NULL, worker, &theirs);
  pthread_join(t, NULL);
  out[7] = theirs != NULL && theirs != (void *)f;
  tg_scratch_done(f, 5000);
}
"""


def test_scratch_blocks_kept_grown_and_per_thread(tmp_path):
    lib = build(tmp_path, DRIVER, [])
    out = (ctypes.c_int64 * 8)()
    lib.probe(out)
    assert list(out) == [1] * 8


def reverse_doubled(M, N):
    """B[r, N - 1 - i] = 2 A[r, i] + 1 through an N-element float32 buffer (4N bytes a thread)."""
    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((M, N), "float32")):
        with T.Kernel(M) as r:
            s = T.alloc_shared((N,), "float32")
            for i in T.Parallel(N):
                s[i] = A[r, i] * 2.0
            for i in T.Parallel(N):
                B[r, i] = s[N - 1 - i] + 1.0
    return main


@pytest.mark.parametrize("n", [HEAP_THRESHOLD // 4 + 16, 300000])   # kept per thread; over TG_SCRATCH_MAX
def test_kernels_with_large_buffers_reuse_them_across_calls_and_threads(n):
    k = tegula.compile(reverse_doubled(3, n), target="c")
    src = k.get_kernel_source()
    assert "tg_scratch(" in src and "tg_scratch_done(tg_smem" in src and "free(tg_smem)" not in src
    want = lambda a: (a * 2 + 1).flip(1)   # noqa: E731
    for _ in range(3):
        a, b = torch.randn(3, n), torch.empty(3, n)
        k(a, b)
        assert torch.equal(b, want(a))
    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(5):
            a, b = torch.randn(3, n, generator=g), torch.empty(3, n)
            k(a, b)   # the GIL is released in the kernel: threads run it at the same time
            assert torch.equal(b, want(a))
    run_in_threads(work, range(4))


def test_a_larger_grid_grows_the_kept_block():
    """Two grids in one kernel, the second with 4x the buffer: the block kept after the first is grown."""
    n = HEAP_THRESHOLD // 4 + 16

    @T.prim_func
    def two(A: T.Tensor((2, 4 * n), "float32"), B: T.Tensor((2, 4 * n), "float32")):
        with T.Kernel(2) as r:
            s = T.alloc_shared((n,), "float32")
            for i in T.Parallel(n):
                s[i] = A[r, i] + 1.0
            for i in T.Parallel(n):
                B[r, i] = s[n - 1 - i]
        with T.Kernel(2) as r:
            t = T.alloc_shared((4 * n,), "float32")
            for i in T.Parallel(4 * n):
                t[i] = A[r, i] * 3.0
            for i in T.Parallel(3 * n):
                B[r, n + i] = t[4 * n - 1 - i]
    k = tegula.compile(two, target="c")
    assert k.get_kernel_source().count("tg_scratch(") == 2
    for _ in range(2):
        a, b = torch.randn(2, 4 * n), torch.empty(2, 4 * n)
        k(a, b)
        assert torch.equal(b[:, :n], (a[:, :n] + 1).flip(1)) and torch.equal(b[:, n:], (a[:, n:] * 3).flip(1))
