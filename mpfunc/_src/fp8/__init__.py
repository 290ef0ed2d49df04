"""fp8 for JAX: the fp8 matmul (`matmul`), quantisation (`quantize`), `convert_to_fp8`
(`convert`) and its way through stacked layers and scans (`stacked`)."""
