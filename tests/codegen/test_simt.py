"""The SIMT lowering (opencl, cuda) as text: where barriers go, what lives in registers and what in shared memory,
how reductions combine across threads, and the errors and checks around the two targets. Nothing here needs a
device or a compiler: these read the generated source (tegula.lower).
"""
import re

import pytest
import torch

import tegula
import tegula.language as T
from tegula.runtime import launch

SIMT = ["opencl", "cuda"]
BARRIER = {"opencl": "barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);", "cuda": "__syncthreads();"}


def body_lines(source):
    """The kernel's statements, one per line, without indentation."""
    return [ln.strip() for ln in source.split("{", 1)[1].splitlines() if ln.strip()]


def staged_copy(N=256):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128):
            s = T.alloc_shared((N,), "float32")
            T.copy(A, s)
            for i in T.Parallel(N):
                B[i] = s[N - 1 - i] * 2.0  # each thread reads what another wrote

    return main


@pytest.mark.parametrize("target", SIMT)
def test_a_barrier_follows_a_shared_write_before_another_thread_reads(target):
    lines = body_lines(tegula.lower(staged_copy(), target=target).kernel_source)
    write = next(k for k, ln in enumerate(lines) if re.match(r"s\[.*\] = ", ln))
    read = next(k for k, ln in enumerate(lines) if "B[" in ln and "s[" in ln)
    assert BARRIER[target] in lines[write:read], "\n".join(lines)
    assert sum(BARRIER[target] in ln for ln in lines) == 1


def register_only(M=32, N=64):
    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128):
            a = T.alloc_fragment((M, N), "float32")
            T.copy(A, a)
            for i, j in T.Parallel(M, N):
                a[i, j] = a[i, j] * a[i, j]
            T.copy(a, B)

    return main


@pytest.mark.parametrize("target", SIMT)
def test_fragments_are_per_thread_registers_and_need_no_barrier(target):
    src = tegula.lower(register_only(), target=target).kernel_source
    assert BARRIER[target] not in src
    assert re.search(r"^\s*float a\[16\];", src, re.M), src  # 32*64 elements over 128 threads
    assert "__local" not in src and "tg_smem" not in src


def row_sums(M=8, N=128):
    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), S: T.Tensor((M,), "float32")):
        with T.Kernel(1, threads=128):
            a = T.alloc_fragment((M, N), "float32")
            s = T.alloc_fragment((M,), "float32")
            T.copy(A, a)
            T.reduce_sum(a, s, dim=1)
            T.copy(s, S)

    return main


def test_cuda_reduction_across_threads_uses_warp_shuffles():
    src = tegula.lower(row_sums(), target="cuda").kernel_source
    assert "__shfl_xor_sync" in src
    assert BARRIER["cuda"] not in src


def test_opencl_reduction_across_threads_goes_through_local_memory_once():
    src = tegula.lower(row_sums(), target="opencl").kernel_source
    assert re.search(r"__local float red_float32\[\d+\];", src)
    assert src.count(BARRIER["opencl"]) == 1  # partial sums written, then every thread reads its row's


def serial_reader():
    @T.prim_func
    def main(A: T.Tensor((4, 8), "float32"), B: T.Tensor((4,), "float32")):
        with T.Kernel(4, threads=32) as bx:
            row = T.alloc_fragment((8,), "float32")
            T.copy(A[bx, :], row)
            B[bx] = row[0] + row[7]  # serial code reads elements other threads loaded

    return main


def test_a_fragment_read_by_serial_code_lives_in_shared_memory_and_one_thread_stores():
    src = tegula.lower(serial_reader(), target="opencl").kernel_source
    assert "__local float row[8];" in src
    lines = body_lines(src)
    store = next(k for k, ln in enumerate(lines) if ln.startswith("B["))
    assert lines[store - 1] == "if ((tid == 0)) {"
    assert BARRIER["opencl"] in lines[:store]


def gemm_in_registers(M=64, N=64, K=32, dtype="float16"):
    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128):
            a = T.alloc_shared((M, K), dtype)
            b = T.alloc_shared((K, N), dtype)
            c = T.alloc_fragment((M, N), "float32")
            T.copy(A, a)
            T.copy(B, b)
            T.gemm(a, b, c, clear_accum=True)
            T.copy(c, C)

    return main


@pytest.mark.parametrize("target", SIMT)
def test_gemm_accumulates_a_micro_tile_per_thread(target):
    src = tegula.lower(gemm_in_registers(), target=target).kernel_source
    assert re.search(r"^\s*float c\[32\];", src, re.M)  # 64*64 / 128 threads: 32 accumulators each
    # cuda: fp16 on tensor cores (tests/codegen/test_simt_mma.py); opencl: the portable per-thread FMA tile
    assert ("mma.sync.aligned.m16n8k16" if target == "cuda" else "fmaf(") in src
    assert src.count(BARRIER[target]) == 1  # A and B staged, then the GEMM reads them


@pytest.mark.parametrize("target", SIMT)
def test_pipelined_loop_orders_the_next_stage_after_the_gemm(target):
    M = N = 32
    K = T.dynamic("K")

    @T.prim_func
    def main(A: T.Tensor((M, K), "float32"), B: T.Tensor((K, N), "float32"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=64):
            a = T.alloc_shared((M, 16), "float32")
            b = T.alloc_shared((16, N), "float32")
            c = T.alloc_fragment((M, N), "float32")
            T.clear(c)
            for k in T.Pipelined(T.ceildiv(K, 16), num_stages=2):
                T.copy(A[0, k * 16], a)
                T.copy(B[k * 16, 0], b)
                T.gemm(a, b, c)
            T.copy(c, C)

    lines = body_lines(tegula.lower(main, target=target).kernel_source)
    loop = next(k for k, ln in enumerate(lines) if ln.startswith("for (int32_t k = 0"))
    first_write = next(k for k in range(loop, len(lines)) if re.match(r"a\[.*\] = ", lines[k]))
    # the tiles of step k+1 overwrite what the GEMM of step k read: a barrier opens each step
    assert BARRIER[target] in lines[loop:first_write]


def test_launch_description_carries_grid_threads_and_arguments():
    M = T.dynamic("M")

    @T.prim_func
    def main(A: T.Tensor((M, 64), "float32"), B: T.Tensor((M, 64), "float32"), scale: T.float32):
        with T.Kernel(T.ceildiv(M, 16), threads=64) as bx:
            for i, j in T.Parallel(16, 64):
                B[bx * 16 + i, j] = A[bx * 16 + i, j] * scale

    meta = launch.parse(tegula.lower(main, target="opencl").kernel_source)
    (kernel,) = meta["kernels"]
    assert kernel["threads"] == 64 and kernel["name"] == "tg_main"
    assert meta["params"] == ["p:float32", "p:float32", "float32", "int32"]
    assert meta["writes"] == [1]
    assert launch.grid(kernel, [None, None, 2.0, 100]) == (7, 1, 1)


@pytest.mark.parametrize("view", ["tensor_over_data", "reshape"])
def test_writes_through_a_view_mark_the_parameter_written(view):
    # A discrete OpenCL device copies back only the written parameters: a store through a view of C must count
    # as a store to C (an NVIDIA H200 returned C's uninitialised host memory before this was so).
    @T.prim_func
    def main(A: T.Tensor((8, 16), "float32"), C: T.Tensor((8, 16), "float32")):
        with T.Kernel(1, threads=128):
            flat = T.Tensor((128,), "float32", C.data) if view == "tensor_over_data" else T.reshape(C, (128,))
            for i in T.Parallel(128):
                flat[i] = A[i // 16, i % 16] + 1.0

    meta = launch.parse(tegula.lower(main, target="opencl").kernel_source)
    assert meta["writes"] == [1]


def test_narrow_floats_are_raw_bits_in_opencl():
    src = tegula.lower(gemm_in_registers(dtype="bfloat16"), target="opencl").kernel_source
    assert "__global tg_bf16 *restrict A" in src and "tg_bf16_to_f32(" in src


# errors and checks -----------------------------------------------------------------------------


def host_code():
    @T.prim_func
    def main(A: T.Tensor((8,), "float32")):
        A[0] = 1.0  # error: host-code
        with T.Kernel(1):
            for i in T.Parallel(8):
                A[i] = A[i] + 1.0

    return main


def too_many_threads():
    @T.prim_func
    def main(A: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=2048):  # error: threads
            for i in T.Parallel(8):
                A[i] = 1.0

    return main


def grid_from_memory():
    @T.prim_func
    def main(N: T.Tensor((1,), "int32"), A: T.Tensor((64,), "float32")):
        with T.Kernel(N[0]) as bx:  # error: grid
            A[bx] = 1.0

    return main


def line_of(tag):
    with open(__file__) as f:
        for number, text in enumerate(f, start=1):
            if text.rstrip().endswith(f"# error: {tag}"):
                return number


@pytest.mark.parametrize("target", SIMT)
@pytest.mark.parametrize("factory, tag, words", [
    (host_code, "host-code", "inside a T.Kernel"),
    (too_many_threads, "threads", "2048 threads"),
    (grid_from_memory, "grid", "grid size"),
])
def test_simt_compile_errors_point_at_the_line(target, factory, tag, words):
    with pytest.raises(tegula.CompileError) as info:
        tegula.lower(factory(), target=target)
    assert f"test_simt.py:{line_of(tag)}:" in str(info.value), str(info.value)
    assert words in str(info.value)


def test_cuda_archs_give_a_cubin_or_a_fat_binary():
    from tegula.runtime import cuda
    one = cuda.flags("sm_80")
    assert "-cubin" in one and "-arch=sm_80" in one
    two = cuda.flags("sm_80,sm_90a")
    assert "-fatbin" in two and "-gencode=arch=compute_90a,code=sm_90a" in two


def test_cuda_compiles_without_a_device_and_says_so_when_called(monkeypatch):
    from tegula import runtime
    rt = runtime.get("cuda")
    if not rt.can_compile()[0]:
        pytest.skip("nvcc not found")
    if rt.devices():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.setenv("TEGULA_CUDA_ARCH", "sm_80")
    kernel = tegula.compile(staged_copy(), out_idx=[-1], target="cuda")
    assert "__global__" in kernel.get_kernel_source()
    with pytest.raises(RuntimeError, match="cannot run here"):
        kernel(torch.randn(256))
