"""Triton kernels with host wrappers and plain-torch references (installed as `tieredkv.kernels`)."""
