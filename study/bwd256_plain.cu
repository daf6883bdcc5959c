// Study TU: only the plain (no window, no softcap) bf16 hdim256 backward kernel.
#include "sm90/flash_bwd_launch_sm90.hpp"
namespace cuflash::sm90 {
void study_bwd256(BwdParams& params, cudaStream_t stream) {
  bwd::run_bwd_config<cutlass::bfloat16_t, 256, 256, false, false>(params, stream);
}
}  // namespace cuflash::sm90
