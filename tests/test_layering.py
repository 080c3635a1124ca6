"""DESIGN.md's layering rule, enforced: each module imports only from the layers above it, runtime never sees
the IR, codegen never imports runtime, and `import tegula` touches no device library or compiler."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tegula")
ORDER = ["config", "errors", "ir", "language", "passes", "tileops", "codegen", "runtime", "jit", "autotune", "ops",
         "ep", "models", "cli"]
RANK = {"config": 0, "errors": 0, "ir": 1, "language": 2, "passes": 2, "tileops": 2, "codegen": 3, "runtime": 4,
        "jit": 5, "autotune": 5, "ops": 6, "ep": 7, "models": 8, "cli": 9}
HEAVY = ("torch", "pyopencl", "cuda", "cupy", "numpy", "ml_dtypes")


def _layer(path: str) -> str:
    rel = os.path.relpath(path, ROOT)
    head = rel.split(os.sep)[0]
    return head[:-3] if head.endswith(".py") else head


def _imports(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        top_level = node in tree.body
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, top_level
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, top_level
            for a in node.names:
                yield f"{node.module}.{a.name}", top_level


def _modules():
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


@pytest.mark.parametrize("path", sorted(_modules()), ids=lambda p: os.path.relpath(p, ROOT))
def test_imports_follow_the_layers(path):
    layer = _layer(path)
    if layer == "__init__":
        return
    for mod, top in _imports(path):
        parts = mod.split(".")
        if parts[0] == "tegula" and len(parts) > 1 and parts[1] in RANK:
            other = parts[1]
            if layer in ("language", "passes", "tileops") and other in ("language", "passes", "tileops"):
                continue  # the three share a layer
            assert RANK[other] <= RANK[layer], f"{layer} imports {mod}, a lower layer"
            if layer == "runtime":
                assert other not in ("ir", "language", "passes", "tileops"), f"runtime imports {mod} (sees the IR)"
            if layer == "codegen":
                assert other != "runtime", f"codegen imports {mod}"
        if top and parts[0] in HEAVY and layer in ("ir", "language", "passes", "tileops", "codegen"):
            pytest.fail(f"{os.path.relpath(path, ROOT)} imports {mod} at module level")


def test_import_tegula_is_cheap():
    code = ("import sys, tegula, tegula.language as T; "
            "bad = [m for m in ('torch', 'numpy', 'pyopencl', 'ml_dtypes', 'ctypes', 'subprocess') if m in sys.modules];"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import tegula loaded {out}"
