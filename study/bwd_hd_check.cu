// Check TU: hdim 128 and 192 plain + causal/softcap bf16 backward (unchanged head dims).
#include "sm90/flash_bwd_launch_sm90.hpp"
namespace cuflash::sm90 {
void check_bwd128(BwdParams& params, cudaStream_t stream) {
  bwd::run_bwd_config<cutlass::bfloat16_t, 128, 128, false, false>(params, stream);
  bwd::run_bwd_config<cutlass::bfloat16_t, 128, 128, true, true>(params, stream);
  bwd::run_bwd_config<cutlass::bfloat16_t, 64, 64, false, false>(params, stream);
}
}
