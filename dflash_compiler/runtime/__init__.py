"""The deploy-side runtime: loads an artifact with cuda-python and owns the paged KV cache (no TVM, no torch)."""
