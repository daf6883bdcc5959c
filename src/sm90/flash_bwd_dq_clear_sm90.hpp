// Backward, flex kernels with block lists outside deterministic mode: dq_accum cleared on the
// device, or left to the first writers' stores, by what the lists say (dq_list_max_writers in
// dq_accum_start_sm90.hpp). The host cannot read the lists without a sync, so the launch always
// hands the main kernel its tickets and runs this kernel after the preprocess (which zeroed
// them): where some row block lists more column blocks than first stores pay for, it zeroes
// dq_accum as the memset would and sets every ticket to kDqTicketLanded, so that the postprocess
// reads every row block, and the main kernel (reading the same maximum) runs without the ticket
// code; otherwise it leaves at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/dq_accum_start_sm90.hpp"

namespace cuflash::sm90::bwd {

struct DqClearParams {
  float4* dq_accum;          // the whole accumulator, as the memset clears it
  std::int64_t num_float4;   // its size in float4
  int* tickets;              // every ticket of the accumulator's row blocks
  std::int64_t num_tickets;
  int const* max_row_writers;  // BlockSparseParams::max_row_writers
  int max_writers;             // dq_list_max_writers: at most this many, first stores
};

// Whether the clear kernel cleared dq_accum (the lists name more writers than first stores pay
// for): the one test that the clear kernel and the main kernel's dQ warps (with_ticket_code) both
// make, on the same int, so that they always agree.
__device__ __forceinline__ bool dq_list_cleared(int const* max_row_writers, int max_writers) {
  return *max_row_writers > max_writers;
}

// Grid-stride over kThreads-thread CTAs, 16-byte stores. (A template, as the other kernels of
// the headers that several instantiation files include.)
template <int kThreads>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_clear_sm90(DqClearParams const p) {
  if (!dq_list_cleared(p.max_row_writers, p.max_writers)) { return; }
  std::int64_t const stride = std::int64_t(gridDim.x) * blockDim.x;
  std::int64_t const first = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  float4 const zero = make_float4(0.f, 0.f, 0.f, 0.f);
  for (std::int64_t i = first; i < p.num_float4; i += stride) { p.dq_accum[i] = zero; }
  for (std::int64_t i = first; i < p.num_tickets; i += stride) { p.tickets[i] = kDqTicketLanded; }
}

}  // namespace cuflash::sm90::bwd
