// Checks of index tensors in device memory (CUDA builds only), for CUFLASH_CHECK_INPUTS=1.
//
// Validation reads the values of index tensors (cu_seqlens offsets, seqused lengths, page
// numbers, block-list counts and indices) only where they live in host memory: reading device
// memory would wait for the device on every call. With the setting on, a device call copies them
// back on its stream, after the work queued before it, and runs the same checks as for host
// tensors, so that bad values fail with an error naming the argument before any kernel runs
// (instead of reads out of bounds or a hang). For debugging: a synchronisation per call.
#pragma once

#include "cuflash/cuflash.hpp"

namespace cuflash::detail {

void check_index_values_on_host(const ForwardArgs& args, StreamHandle stream);
void check_index_values_on_host(const BackwardArgs& args, StreamHandle stream);
void check_index_values_on_host(const CombineArgs& args, StreamHandle stream);

}  // namespace cuflash::detail
