"""Compute kernels below the MoE strategies: the fused GPU gather-GEMV (Triton) with its torch
twin, the torch expert paths every strategy shares, activations by name."""
