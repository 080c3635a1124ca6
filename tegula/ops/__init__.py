"""Operator libraries written in T.*: each op is plain Python (argument checks, output allocation, kernel
selection) around kernels compiled with tegula.jit."""
