"""fp8 for PyTorch: the fp8 linear (`matmul`), quantisation (`quantize`) on the rule's torch
ops (`rule`) and the fused kernels (`fused`, `triton_kernels`), and `Fp8Linear` /
`convert_to_fp8` (`convert`)."""
