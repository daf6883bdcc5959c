// The head-dim rounding of the sm90 kernels. Compiled in every build, CUDA or not: the Python
// package generates kernel modules from it at run time (python/cuflash/_jit.py) and the
// device dispatch picks its instantiations by it, so the two cannot disagree.
#include "cuflash/cuflash.hpp"

namespace cuflash {

KernelHeadDims kernel_head_dims(int head_dim, int head_dim_v) {
  // Q/K up to 192 with V up to 128 has its own kernel, so V is not padded to 192.
  if (head_dim > 128 && head_dim <= 192 && head_dim_v <= 128) return {192, 128};
  // Otherwise the smallest compiled tile that holds both; TMA zero-fills the extra columns of
  // Q/K/V and the stores write only the real ones.
  int const largest = head_dim > head_dim_v ? head_dim : head_dim_v;
  for (int d : {64, 96, 128, 192, 256}) {
    if (largest <= d) return {d, d};
  }
  return {};
}

}  // namespace cuflash
