"""The c target's grid: its blocks are one static function per T.Kernel, called directly when the grid gets one
thread (no OpenMP region) and from a parallel region otherwise; every block runs exactly once either way, with the
locals of the code around the kernel (scalars, loop variables, workspaces) passed in."""
import pytest
import torch

import tegula
import tegula.language as T
from tegula.errors import CompileError


def visits(nb):
    """Hits[r] += 1 for each block r of an nb-block grid launched twice in a loop, with outer locals in use."""
    @T.prim_func
    def grid(Hits: T.Tensor((nb,), "int32"), Out: T.Tensor((nb,), "int32"), s: T.int32):
        w = T.alloc_global((nb,), "int32")
        a = s * 2
        for j in T.serial(2):
            with T.Kernel(nb) as r:
                buf = T.alloc_fragment((4,), "int32")
                buf[0] = a + j
                w[r] = buf[0]
                T.atomic_add(Hits[r], 1)
        with T.Kernel(nb) as r:
            Out[r] = w[r] + r
    return grid


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("nb", [1, 3, 1000])
def test_every_block_runs_once(nb, threads):
    k = tegula.compile(visits(nb), target="c")
    k.program.lib.tg_set_num_threads(threads)
    try:
        hits, out = torch.zeros(nb, dtype=torch.int32), torch.zeros(nb, dtype=torch.int32)
        k(hits, out, 5)
        ref_hits, ref_out = torch.zeros(nb, dtype=torch.int32), torch.zeros(nb, dtype=torch.int32)
        tegula.compile(visits(nb), target="interp")(ref_hits, ref_out, 5)
        assert torch.equal(hits, torch.full((nb,), 2, dtype=torch.int32))
        assert torch.equal(hits, ref_hits) and torch.equal(out, ref_out)
        assert torch.equal(out, 11 + torch.arange(nb, dtype=torch.int32))
    finally:
        k.program.lib.tg_set_num_threads(0)


def test_each_grid_body_is_emitted_once():
    src = tegula.compile(visits(7), target="c").get_kernel_source()
    assert src.count("tg_atomic_add_i32(") == 1
    for g in ("tg_grid_grid0", "tg_grid_grid1"):
        assert src.count(f"static void {g}(") == 1
        assert src.count(f"{g}(Hits, Out, s") == 2   # called directly, and from the parallel region
    assert src.count("#pragma omp parallel num_threads(tg_nt)") == 2
    assert src == tegula.lower(visits(7), target="c").kernel_source   # deterministic


def test_a_kernel_cannot_assign_a_variable_of_the_code_around_it():
    @T.prim_func
    def bad(X: T.Tensor((4,), "int32")):
        a = T.cast(0, "int32")
        with T.Kernel(4) as r:
            a = a + 1
            X[r] = a
    with pytest.raises(CompileError, match="cannot assign a"):
        tegula.compile(bad, target="c")
