"""The vectorisable float32 math of tegula_rt.h: error bounds against float64, special values, and that gcc
vectorises the loops that use them."""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

PRELUDE = os.path.join(os.path.dirname(__file__), "..", "..", "tegula", "codegen", "prelude")
CC = os.environ.get("TEGULA_CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler")
FUNCS = ["expf", "exp2f", "logf", "log2f", "tanhf", "sigmoidf"]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("math")
    src = d / "m.c"
    body = '#include "tegula_rt.h"\n'
    for f in FUNCS:
        body += (f"void run_{f}(const float *x, float *y, int n) {{\n#pragma omp simd\n"
                 f"  for (int i = 0; i < n; ++i) y[i] = tg_{f}(x[i]);\n}}\n")
    src.write_text(body)
    out = d / "m.so"
    cmd = [CC, "-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fwrapv", "-ffp-contract=off",
           "-fno-math-errno", "-fopenmp", "-I", PRELUDE, str(src), "-o", str(out), "-lm", "-fopt-info-vec-optimized"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(out))
    for f in FUNCS:
        getattr(lib, f"run_{f}").argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.vector_report = r.stderr
    return lib


def _run(lib, name, x):
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty_like(x)
    getattr(lib, f"run_{name}")(x.ctypes.data, y.ctypes.data, ctypes.c_int(x.size))
    return y


def _ulp_err(got, want64):
    want = want64.astype(np.float32)
    ok = np.isfinite(want) & (np.abs(want) >= np.finfo(np.float32).tiny)
    spacing = np.spacing(np.abs(want[ok])).astype(np.float64)
    return np.max(np.abs(got[ok].astype(np.float64) - want64[ok]) / spacing) if ok.any() else 0.0


REFS = {
    "expf": (np.exp, (-103.0, 88.7)), "exp2f": (np.exp2, (-149.0, 127.9)), "logf": (np.log, (1e-30, 3e38)),
    "log2f": (np.log2, (1e-30, 3e38)), "tanhf": (np.tanh, (-10.0, 10.0)),
    "sigmoidf": (lambda x: 1 / (1 + np.exp(-x)), (-80.0, 80.0)),
}
BOUND = {"expf": 2, "exp2f": 2, "logf": 3, "log2f": 4, "tanhf": 4, "sigmoidf": 3}


@pytest.mark.parametrize("name", FUNCS)
def test_error_bound(lib, name):
    ref, (lo, hi) = REFS[name]
    rng = np.random.default_rng(0)
    if lo > 0:
        x = np.exp(rng.uniform(np.log(lo), np.log(hi), 200_000)).astype(np.float32)
    else:
        x = rng.uniform(lo, hi, 200_000).astype(np.float32)
    x = np.concatenate([x, np.linspace(lo, hi, 50_001, dtype=np.float32)])
    got = _run(lib, name, x)
    err = _ulp_err(got, ref(x.astype(np.float64)))
    assert err <= BOUND[name], f"{name}: {err:.2f} ulp"


def test_special_values(lib):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1000.0, -1000.0], np.float32)
    e = _run(lib, "expf", x)
    np.testing.assert_array_equal(e[[0, 1, 3, 4, 5, 6]], [np.inf, 0, 1, 1, np.inf, 0])
    assert np.isnan(e[2])
    e2 = _run(lib, "exp2f", x)
    np.testing.assert_array_equal(e2[[0, 1, 3, 5, 6]], [np.inf, 0, 1, np.inf, 0])
    lg = _run(lib, "logf", np.array([0.0, -1.0, np.inf, np.nan, 1.0, 1e-45], np.float32))
    assert lg[0] == -np.inf and np.isnan(lg[1]) and lg[2] == np.inf and np.isnan(lg[3]) and lg[4] == 0
    assert abs(lg[5] - np.log(1.4e-45)) < 1e-4 * abs(np.log(1.4e-45))  # denormal input
    # exp underflows gradually into denormals, like libm
    d = _run(lib, "expf", np.array([-100.0, -103.0], np.float32))
    want = np.exp(np.array([-100.0, -103.0])).astype(np.float32)
    np.testing.assert_allclose(d, want, rtol=0, atol=2 * np.finfo(np.float32).smallest_subnormal)
    t = _run(lib, "tanhf", np.array([0.0, -0.0, 1e-8, np.inf, -np.inf], np.float32))
    np.testing.assert_array_equal(t, np.array([0, -0.0, 1e-8, 1, -1], np.float32))


@pytest.mark.skipif(os.uname().machine != "x86_64" or "gcc" not in subprocess.run(
    [CC, "--version"], capture_output=True, text=True).stdout.lower() and "free software" not in subprocess.run(
    [CC, "--version"], capture_output=True, text=True).stdout.lower(), reason="checked with gcc on x86_64")
def test_loops_vectorise(lib):
    report = lib.vector_report
    for f in FUNCS:
        assert any(f"run_{f}" in line or "loop vectorized" in line for line in report.splitlines())
    assert report.count("loop vectorized") >= len(FUNCS)
