// Study TU: all four fp16 hdim256 backward kernels.
#include "sm90/flash_bwd_launch_sm90.hpp"
namespace cuflash::sm90 {
void study_bwd256_fp16_all(BwdParams& params, cudaStream_t stream) { bwd::run_bwd<cutlass::half_t, 256, 256>(params, stream); }
}
