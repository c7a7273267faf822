"""GPU kernels (Triton) for the hot paths of decode; each has a slow twin in torch."""
