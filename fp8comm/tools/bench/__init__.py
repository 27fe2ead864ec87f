"""The benchmarks behind `fp8comm bench ...` (quant, comm, gemm) and the multi-node scaling benchmark (scaling)."""
