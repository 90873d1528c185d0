"""CPU matrix-product kernels (C++, AVX-512 VNNI / AVX2) called through XLA's FFI; see README.md."""
