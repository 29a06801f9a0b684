// The chain kernels, gemv_<mlp|tail>_<float|int8|int4>_<f32|f16|bf16>: a decode row's products between two
// attentions in one launch, each product's blocks waiting inside it for the one before (see gemv.cuh): the MLP
// with the add + norm after it, or the o product with its add + norm followed by the MLP.
#include "gemv.cuh"

ORIN_WITH_f32(ORIN_GEMV_CHAIN_KERNELS(f32, float))
ORIN_WITH_f16(ORIN_GEMV_CHAIN_KERNELS(f16, __half))
ORIN_WITH_bf16(ORIN_GEMV_CHAIN_KERNELS(bf16, __nv_bfloat16))
