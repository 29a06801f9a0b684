// The GEMV kernels' plain products, gemv_<float|int8|int4>_<f32|f16|bf16>_r<1|2|4|8> (see gemv.cuh).
#include "gemv.cuh"

ORIN_GEMV_KERNELS(, false)
