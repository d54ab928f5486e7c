"""Small utilities: chunked matmul, CUDA memory info, device choice."""
