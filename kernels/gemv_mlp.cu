// The MLP kernels, gemv_mlp_<float|int8|int4>_<f32|f16|bf16>: a decode row's gate/up product with its SwiGLU,
// then the down product with the residual add and norm after it, in one launch (see gemv.cuh).
#include "gemv.cuh"

ORIN_GEMV_MLP_KERNELS_E(f32, float)
ORIN_GEMV_MLP_KERNELS_E(f16, __half)
ORIN_GEMV_MLP_KERNELS_E(bf16, __nv_bfloat16)
