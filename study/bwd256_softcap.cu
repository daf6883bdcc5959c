// Study TU: only the bf16 hdim256 backward kernel with HasWindow=false, HasSoftcap=true.
#include "sm90/flash_bwd_launch_sm90.hpp"
namespace cuflash::sm90 {
void study_bwd256_softcap(BwdParams& params, cudaStream_t stream) {
  bwd::run_bwd_config<cutlass::bfloat16_t, 256, 256, false, true>(params, stream);
}
}  // namespace cuflash::sm90
