"""S4 KV int4 paged KV-cache formats: torch reference and Triton kernels."""
