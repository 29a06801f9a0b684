// The GEMV kernels with the SwiGLU epilogue, gemv_<float|int8|int4>_swiglu_<f32|f16|bf16>_r<1|2|4|8>, for
// the MLP's fused gate/up projection (see gemv.cuh).
#include "gemv.cuh"

ORIN_GEMV_KERNELS(_swiglu, true)
