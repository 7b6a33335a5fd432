"""Host-side kernels: each Cython module sits beside a NumPy reference of the same function."""
