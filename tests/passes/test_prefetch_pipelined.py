"""prefetch_pipelined: on the c target a T.Pipelined(num_stages >= 2) loop prefetches what its global T.copy reads
one iteration later (temporaries inlined, address loads bounds-guarded); results never change."""
import torch

import tegula
import tegula.language as T
from tegula.passes.verify import verify


def paged_sum(num_stages, N=512, B=32, W=48):
    """Sums pages of A named by a page table, in page-table order (the table read inside the copy's start)."""
    @T.prim_func
    def main(A: T.Tensor((N, W), "float32"), Pages: T.Tensor((N // B,), "int32"), O: T.Tensor((N // B, W), "float32")):
        with T.Kernel(1):
            s = T.alloc_shared((B, W), "float32")
            acc = T.alloc_fragment((W,), "float32")
            T.clear(acc)
            for k in T.Pipelined(N // B, num_stages=num_stages):
                base = Pages[k] * B
                T.copy(A[base:base + B, :], s)
                T.reduce_sum(s, acc, dim=0, clear=False)
                for j in T.Parallel(W):
                    O[k, j] = acc[j]
    return main


def test_prefetch_of_the_next_page_is_guarded_and_inlined():
    low = tegula.lower(paged_sum(2), target="c")
    verify(low.lowered)
    text = low.lowered.script()
    assert "prefetch(A[((Pages[(k + 1)] * 32)" in text            # ``base`` inlined, k advanced by one
    assert "(k + 1) < 16" in text                                   # only when an iteration k + 1 exists
    assert "int64((k + 1)) < 16:int64" in text                      # and Pages[k + 1] is inside Pages
    assert "__builtin_prefetch(&A[" in low.kernel_source
    for stages in (0, 1):
        assert "prefetch" not in tegula.lower(paged_sum(stages), target="c").kernel_source


def test_prefetch_leaves_results_unchanged():
    a = torch.randn(512, 48)
    pages = torch.randperm(16).int()
    ref = a.view(16, 32, 48)[pages.long()].sum(1).cumsum(0)
    for target in ("c", "interp"):
        out = tegula.compile(paged_sum(2), out_idx=[2], target=target)(a, pages)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_prefetch_one_per_line_and_the_last_element():
    """Each row of the region (48 float32: 3 lines from its start) gets a prefetch every 16 elements, unclamped
    offsets from one address, then one of its last element (the line a row not starting on a line boundary ends
    in)."""
    text = tegula.lower(paged_sum(2), target="c").lowered.script()
    lines = [x.strip() for x in text.splitlines() if "prefetch(" in x or "pf" in x]
    assert lines == ["for pf0 in serial(0, +32):", "for pf1 in serial(0, +3):",
                     "prefetch(A[((Pages[(k + 1)] * 32) + pf0), (pf1 * 16)])",
                     "prefetch(A[((Pages[(k + 1)] * 32) + pf0), 47])"], lines
