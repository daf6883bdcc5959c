#include "sm90/flash_bwd_launch_sm90.hpp"
using namespace cuflash::sm90::bwd;
using ML = MainloopBwdSm90<cutlass::bfloat16_t, 256, 256, false, false>;
using K = FlashBwdKernelSm90<ML, EpilogueBwdSm90<ML>>;
template <int A, int B, int C> struct Show;
Show<K::kSharedStorageSize, ML::kDqViaSmem, ML::kStagesdS> s;
