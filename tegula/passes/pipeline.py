"""The pass order of each target family."""
from __future__ import annotations

from tegula.passes import (
    check_program,
    distribute_threads,
    elide_staging,
    fuse_gemm_scale,
    guard_global_access,
    infer_layouts,
    insert_barriers,
    lower_tile_ops,
    prefetch_pipelined,
    read_gathered_rows,
    widen_gemm_k,
)

PIPELINES = {
    "interp": [check_program.run, guard_global_access.run],
    "cpu": [check_program.run, guard_global_access.run, widen_gemm_k.run, prefetch_pipelined.run, elide_staging.run,
            read_gathered_rows.run, fuse_gemm_scale.run, lower_tile_ops.run],
    "simt": [check_program.run, guard_global_access.run, lower_tile_ops.run, infer_layouts.run, distribute_threads.run,
             insert_barriers.run],
}


def run_pipeline(func, target):
    """Run ``target.family``'s passes over ``func``; with TEGULA_DEBUG>=2 the verifier runs after each."""
    from tegula import config
    debug = config.get().debug >= 2
    for p in PIPELINES[target.family]:
        func = p(func, target)
        if debug:
            from tegula.passes.verify import verify
            verify(func, after=p.__module__)
    return func
