// Backward postprocess for sm90: fp32 accumulators (dQ, and dK / dV when query heads share a
// kv head) to fp16/bf16 with scaling. Each CTA reads one fragment-order chunk exactly as the
// main kernel's MMA threads wrote it (see mainloop_bwd_sm90.hpp), places the values by the
// same MMA partitioning into a row-major smem tile, then writes rows with 16-byte stores.
// With counters (BwdParams::dq_done, dQ only) it runs as the main kernel's programmatic dependent:
// its CTAs start on the SMs the main kernel's last wave leaves idle, and each waits until every
// main-kernel CTA of its (batch, head) has added its dQ, instead of waiting for the whole main
// kernel.
#pragma once

#include <cute/tensor.hpp>

#include "sm90/mainloop_bwd_sm90.hpp"

namespace cuflash::sm90::bwd {

struct PostprocessParams {
  float const* accum;  // (H, rows_padded, kCols) in chunks of kRows * kCols
  void* out;           // (B, S, H, D) or packed (total, H, D)
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  int rows_padded;
  int seqlen;  // dense length, or max length when packed
  int cols;    // actual head dim
  float scale;
  int const* cu_seqlens;
  // (B, H) counters of the main kernel's CTAs whose sums have landed, or null (the sums are
  // complete at launch); a head's sums are complete at `done_expected`.
  int const* done;
  int done_expected;
  int num_heads;  // the counters' heads: done[batch * num_heads + head]
  // First-writer tickets of the sums (BwdParams::dq_tickets), one per warpgroup per row block of
  // the workspace rows, or null (the sums were cleared before the main kernel): a ticket at 0
  // marks a half that no column block wrote, read as zeros.
  int const* tickets;
  // The block list of the packed rows (BwdParams::row_block_list or col_block_list, {sequence,
  // block}), or null: the grid's x is an entry of the list and its z is 1.
  int2 const* blocks;
  // With the main kernel's column-block list (done only): a sequence's sums are complete at its
  // own count of column blocks, as the list holds them (VarlenBlockListParams::counts), since
  // the list has no CTA for another sequence's blocks; null: done_expected.
  int const* done_counts;
};

// The CTA last in launch order waits for the whole main kernel, so that this kernel does not
// complete before it: work ordered after this kernel in the stream then sees dK / dV as well.
CUTE_DEVICE void join_main_kernel(PostprocessParams const& p) {
  if (p.done != nullptr && blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
  }
}

// Overlapped with the main kernel (PostprocessParams::done): thread 0 waits for this (batch,
// head)'s sums; the caller synchronizes the other threads with it.
CUTE_DEVICE void await_sums(PostprocessParams const& p, int head, int batch) {
  if (p.done == nullptr) return;
  int const* counter = p.done + int64_t(batch) * p.num_heads + head;
  int const expected = p.done_counts != nullptr ? p.done_counts[batch] : p.done_expected;
  int landed;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(landed) : "l"(counter) : "memory");
    if (landed >= expected) break;
    __nanosleep(512);
  }
}

// The rows of a batch in the sums (PostprocessParams::accum) and in the output.
template <int kRows>
struct ConvertRows {
  int offset;         // first row of the batch in the output (packed) or 0
  int offset_padded;  // first row of the batch in the sums
  int capacity;       // rows the batch owns: every one is written (rows past seqused hold zero sums)
  CUTE_DEVICE static ConvertRows make(PostprocessParams const& p, int batch) {
    bool const varlen = p.cu_seqlens != nullptr;
    ConvertRows r;
    r.offset = varlen ? p.cu_seqlens[batch] : 0;
    r.offset_padded = varlen ? (r.offset + batch * kRows) / kRows * kRows : batch * ((p.seqlen + kRows - 1) / kRows * kRows);
    r.capacity = varlen ? p.cu_seqlens[batch + 1] - r.offset : p.seqlen;
    return r;
  }
};

// Converts row block `block` of (batch, head): size(TiledMma) threads (thread_idx among them),
// `tile` a kRows x (kCols + kPad) smem tile, `sync` a barrier of exactly those threads. Each reads
// one fragment-order chunk exactly as the main kernel's MMA threads wrote it (see
// mainloop_bwd_sm90.hpp), places the values by the same MMA partitioning into the row-major
// tile, then writes rows with 16-byte stores. `Swapped`: the accumulator holds the (cols, rows)
// transpose.
template <class Element, class TiledMma, bool Swapped, int kRows, int kCols, int kPad, class Sync>
CUTE_DEVICE void convert_block(PostprocessParams const& p, ConvertRows<kRows> const& rows_of, int block, int head,
                               int batch, int thread_idx, Element (*tile)[kCols + kPad], Sync const& sync) {
  using namespace cute;
  constexpr int NumThreads = decltype(size(TiledMma{}))::value;
  bool const varlen = p.cu_seqlens != nullptr;
  using AccShape = std::conditional_t<!Swapped, Shape<Int<kRows>, Int<kCols>>, Shape<Int<kCols>, Int<kRows>>>;
  auto thr_mma = TiledMma{}.get_thread_slice(thread_idx);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(AccShape{}));
  constexpr int kValues = decltype(size(coords))::value;
  constexpr int kWgChunk = kValues * cutlass::NumThreadsPerWarpGroup;
  int64_t const row_block = workspace_row_block(head, p.rows_padded, rows_of.offset_padded, kRows, block);
  float const* chunk = p.accum + row_block * (kRows * kCols) + (thread_idx / cutlass::NumThreadsPerWarpGroup) * kWgChunk;
  float4 const* src = reinterpret_cast<float4 const*>(chunk) + thread_idx % cutlass::NumThreadsPerWarpGroup;
  bool written = true;
  if (p.tickets != nullptr) {
    constexpr int kWarpgroups = NumThreads / cutlass::NumThreadsPerWarpGroup;
    written = __ldcg(p.tickets + row_block * kWarpgroups + thread_idx / cutlass::NumThreadsPerWarpGroup) != 0;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kValues / 4; ++i) {
    // L2: the sums were added there. Loaded whatever the ticket says (an unwritten chunk holds
    // stale workspace, read and dropped), so that these loads do not wait for the ticket's.
    // compute-sanitizer's initcheck reports those reads; memcheck and racecheck do not.
    float4 v = __ldcg(src + i * cutlass::NumThreadsPerWarpGroup);
    if (!written) { v = make_float4(0.f, 0.f, 0.f, 0.f); }
    float const vals[4] = {v.x, v.y, v.z, v.w};
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) {
      auto const c = coords(4 * i + j);
      int const row = get<Swapped ? 1 : 0>(c);
      int const col = get<Swapped ? 0 : 1>(c);
      tile[row][col] = Element(vals[j] * p.scale);
    }
  }
  sync();

  Element* out = static_cast<Element*>(p.out) + (varlen ? 0 : batch * p.out_batch_stride) +
                 (int64_t(rows_of.offset) + int64_t(block) * kRows) * p.out_row_stride + head * p.out_head_stride;
  int const rows = rows_of.capacity - block * kRows;
  constexpr int kChunks = kCols / 8;
  for (int idx = thread_idx; idx < kRows * kChunks; idx += NumThreads) {
    int const row = idx / kChunks;
    int const col = (idx % kChunks) * 8;
    if (row < rows && col < p.cols) {
      *reinterpret_cast<uint4*>(out + row * p.out_row_stride + col) = *reinterpret_cast<uint4 const*>(&tile[row][col]);
    }
  }
}

// Grid (ceil(seqlen / kRows), heads, B), or (block list entries, heads, 1); size(TiledMma)
// threads.
template <class Element, class TiledMma, bool Swapped, int kRows, int kCols>
__global__ void __launch_bounds__(decltype(size(TiledMma{}))::value)
    flash_bwd_postprocess_sm90(PostprocessParams const p) {
  constexpr int kPad = 8;  // breaks smem bank conflicts between rows
  __shared__ alignas(16) Element tile[kRows][kCols + kPad];
  int block = blockIdx.x;
  int const head = blockIdx.y;
  int batch = blockIdx.z;
  if (p.blocks != nullptr) {  // the list's empty entries lie past sequence 0's rows
    int2 const entry = __ldg(p.blocks + blockIdx.x);
    batch = entry.x;
    block = entry.y;
  }
  ConvertRows<kRows> const rows_of = ConvertRows<kRows>::make(p, batch);
  join_main_kernel(p);
  if (block * kRows >= rows_of.capacity) { return; }
  if (threadIdx.x == 0) { await_sums(p, head, batch); }
  __syncthreads();
  convert_block<Element, TiledMma, Swapped, kRows, kCols, kPad>(p, rows_of, block, head, batch, int(threadIdx.x), tile,
                                                                 [] { __syncthreads(); });
}

}  // namespace cuflash::sm90::bwd
