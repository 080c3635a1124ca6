"""The tile IR: dtypes, expressions, buffers with scopes, statements and tile ops; a printer; a verifier."""
from tegula.ir import dtypes, expr, stmt  # noqa: F401
from tegula.ir.buffer import Buffer, Region  # noqa: F401
from tegula.ir.dtypes import DType  # noqa: F401
from tegula.ir.stmt import PrimFunc  # noqa: F401
