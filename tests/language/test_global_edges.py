"""Element accesses of global tensors past their edge: a load reads 0, a store does nothing (TileLang's safe
memory access), so a grid that overhangs a tensor needs no hand-written guard. Where the indices provably stay
inside, no guard is emitted."""
import torch

import tegula
import tegula.language as T


def scale_rows(M, block=16, dynamic=False):
    m = T.dynamic("m") if dynamic else M

    @T.prim_func
    def main(A: T.Tensor((m, 8), "float32"), B: T.Tensor((m, 8), "float32")):
        with T.Kernel(T.ceildiv(m, block)) as bx:
            for i, j in T.Parallel(block, 8):
                B[bx * block + i, j] = A[bx * block + i, j] * 2.0 + 1.0
    return main


def test_overhanging_grid_reads_zero_and_skips_stores(target):
    for M, dynamic in ((70, False), (37, True)):
        a = torch.randn(M, 8)
        b = tegula.compile(scale_rows(M, dynamic=dynamic), out_idx=[1], target=target)(a)
        assert torch.equal(b, a * 2 + 1)


def test_loads_past_the_edge_are_zero(target):
    # each block sums a window of 16 that runs past the end for the last rows: the missing terms are 0
    @T.prim_func
    def main(A: T.Tensor((20,), "float32"), S: T.Tensor((20,), "float32")):
        with T.Kernel(20) as r:
            acc = T.alloc_var("float32")
            acc = 0.0
            for k in T.serial(16):
                acc += A[r + k]
            S[r] = acc

    a = torch.randn(20)
    s = tegula.compile(main, out_idx=[1], target=target)(a)
    ref = torch.stack([a[r:r + 16].sum() for r in range(20)])
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)


def test_gather_through_an_index_tensor(target):
    # indices past the table read 0; indices read past the end of Idx read 0 too (so they gather row 0)
    @T.prim_func
    def main(Table: T.Tensor((5, 4), "float32"), Idx: T.Tensor((6,), "int32"), Out: T.Tensor((8, 4), "float32")):
        with T.Kernel(1):
            for i, j in T.Parallel(8, 4):
                Out[i, j] = Table[Idx[i], j]

    table = torch.randn(5, 4)
    idx = torch.tensor([4, 0, 7, -1, 2, 1], dtype=torch.int32)
    out = tegula.compile(main, out_idx=[2], target=target)(table, idx)
    ref = torch.stack([table[k] if 0 <= k < 5 else torch.zeros(4) for k in idx.tolist() + [0, 0]])
    assert torch.equal(out, ref)


def test_no_guard_where_the_indices_stay_inside():
    for text, guarded in ((tegula.lower(scale_rows(64), target="c").lowered.script(), False),
                          (tegula.lower(scale_rows(70), target="c").lowered.script(), True)):
        assert ("select(" in text or "if " in text) == guarded, text


def test_a_hand_written_guard_is_enough():
    @T.prim_func
    def main(A: T.Tensor((70,), "float32"), B: T.Tensor((70,), "float32")):
        with T.Kernel(T.ceildiv(70, 32)) as bx:
            for i in T.Parallel(32):
                row = bx * 32 + i
                if row < 70:
                    B[row] = A[row]

    text = tegula.lower(main, target="c").lowered.script()
    assert text.count("if ") == 1 and "select(" not in text, text


def chunked_copy():
    n = T.dynamic("n")

    @T.prim_func
    def main(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32")):
        with T.Kernel(1):
            for c in T.serial(T.ceildiv(n, 64)):
                if c * 64 + 63 < n:  # a whole chunk: every index c * 64 + j is inside
                    for j in T.Parallel(64):
                        B[c * 64 + j] = A[c * 64 + j] + 1.0
                else:
                    for j in T.Parallel(64):
                        B[c * 64 + j] = A[c * 64 + j] + 2.0
    return main


def test_a_whole_chunk_condition_proves_the_chunk_inside(target):
    # the condition bounds the chunk's last index; the loop offsets j stay below it, so the then-branch has no
    # guard (the else branch keeps its own); the partial last chunk still skips its stores past the edge
    text = tegula.lower(chunked_copy(), target="c").lowered.script()
    assert text.count("if ") == 2 and text.count("select(") == 1, text
    a = torch.randn(150)
    b = torch.zeros(150)
    tegula.compile(chunked_copy(), target=target)(a, b)
    assert torch.equal(b, torch.cat([a[:128] + 1, a[128:] + 2]))


def test_element_atomics_past_the_edge_do_nothing(target):
    # scatter-add through an index tensor whose entries may point past the end (a sentinel), from a T.Parallel
    @T.prim_func
    def main(Idx: T.Tensor((8,), "int32"), Val: T.Tensor((8,), "float32"), Acc: T.Tensor((4,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(8):
                T.atomic_add(Acc[Idx[i]], Val[i])

    idx = torch.tensor([0, 4, 1, 9, 1, 3, 4, 2], dtype=torch.int32)
    val, acc = torch.arange(8.0), torch.zeros(4)
    tegula.compile(main, target=target)(idx, val, acc)
    ref = torch.zeros(4)
    for k, v in zip(idx.tolist(), val.tolist()):
        if k < 4:
            ref[k] += v
    assert torch.equal(acc, ref)
