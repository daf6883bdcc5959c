// Block lists of a document mask, built on the GPU from its ids (ids[b, q] == ids[b, kv]), so
// that the flex kernels visit only the blocks whose rows and keys can share a document and skip
// the per-element check inside one (the lists are FlexAttention's: BlockSparseParams).
//
// Two kernels. The first takes, per sequence and block of block_m rows / block_n keys, the
// smallest and largest id in it. The second classes each (row block, column block) pair from
// those ranges and writes the forward's lists (per row block, columns in ascending order):
//   ranges disjoint                      -> not listed (no pair can match)
//   one id, the same, on both sides      -> full list (every pair matches)
//   otherwise                            -> mask list (mask_mod per element)
// This is exact for any ids: a pair can only match where the ranges overlap, and a full block is
// all one document. For ids that are sorted along the sequence (documents packed one after
// another) it lists exactly the blocks a document touches. Positions past the ids' length or the
// call's longest sequence are outside every block; a block with none left is not listed.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "api/kernels.hpp"
#include "api/params.hpp"
#include "api/workspace_layout.hpp"
#include "cuflash/error.hpp"

namespace cuflash::sm90 {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxGridY = 65535;  // sequences beyond it are taken by the same CTAs in turn

struct DocumentIds {
  int const* ids;
  long long stride;  // per sequence
  int length;        // ids per sequence
};

// Block reduce of (lo, hi) over kThreads threads; every thread gets the result.
__device__ void block_min_max(int& lo, int& hi) {
  __shared__ int warp_lo[kThreads / 32], warp_hi[kThreads / 32];
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  int const warp = int(threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) warp_lo[warp] = lo, warp_hi[warp] = hi;
  __syncthreads();
  lo = warp_lo[0], hi = warp_hi[0];
  for (int w = 1; w < kThreads / 32; ++w) lo = min(lo, warp_lo[w]), hi = max(hi, warp_hi[w]);
  __syncthreads();  // the buffers are reused by the next call
}

// The id range of positions [begin, min(begin + size, end)) of sequence `b`; empty: lo > hi.
__device__ int2 id_range(DocumentIds const& doc, int b, long long begin, int size, long long end) {
  int lo = INT_MAX, hi = INT_MIN;
  int const* row = doc.ids + b * doc.stride;
  long long const stop = min(begin + size, end);
  for (long long i = begin + threadIdx.x; i < stop; i += kThreads) {
    int const id = row[i];
    lo = min(lo, id);
    hi = max(hi, id);
  }
  block_min_max(lo, hi);
  return make_int2(lo, hi);
}

// grid (max(row blocks, column blocks), sequences up to kMaxGridY): block x's row range and column
// range of every gridDim.y-th sequence.
__global__ void __launch_bounds__(kThreads)
    document_block_ranges_kernel(DocumentIds doc, BlockSparseParams bs, int batch, int seqlen_q, int seqlen_k,
                                 int2* row_ranges, int2* col_ranges) {
  int const x = int(blockIdx.x);
  long long const q_end = min(seqlen_q, doc.length), k_end = min(seqlen_k, doc.length);
  for (int b = int(blockIdx.y); b < batch; b += int(gridDim.y)) {
    if (x < bs.num_row_blocks) {
      int2 const r = id_range(doc, b, (long long)x * bs.block_m, bs.block_m, q_end);
      if (threadIdx.x == 0) row_ranges[(long long)b * bs.num_row_blocks + x] = r;
    }
    if (x < bs.num_col_blocks) {
      int2 const r = id_range(doc, b, (long long)x * bs.block_n, bs.block_n, k_end);
      if (threadIdx.x == 0) col_ranges[(long long)b * bs.num_col_blocks + x] = r;
    }
  }
}

// grid (row blocks, sequences up to kMaxGridY): the lists of one row block of every gridDim.y-th
// sequence, compacted 128 columns at a time in ascending order (ballots within a warp, warp
// totals through shared memory).
__global__ void __launch_bounds__(kThreads)
    document_block_lists_kernel(BlockSparseParams bs, int batch, int2 const* row_ranges, int2 const* col_ranges,
                                int* mask_cnt, int* mask_idx, int* full_cnt, int* full_idx) {
  __shared__ int warp_mask[kThreads / 32], warp_full[kThreads / 32];
  for (int b = int(blockIdx.y); b < batch; b += int(gridDim.y)) {
    long long const list = (long long)b * bs.num_row_blocks + blockIdx.x;
    int const cols = bs.num_col_blocks;
    int2 const rows = row_ranges[list];
    int2 const* col_range = col_ranges + (long long)b * cols;
    int* const masks = mask_idx + list * cols;
    int* const fulls = full_idx + list * cols;
    int const lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
    unsigned const lanes_below = (1u << lane) - 1u;
    int masked = 0, full = 0;  // entries written so far (the same in every thread)
    for (int first = 0; first < cols; first += kThreads) {
      int const n = first + int(threadIdx.x);
      int block_class = 0;
      if (n < cols && rows.x <= rows.y) {
        int2 const c = col_range[n];
        if (c.x <= c.y && c.x <= rows.y && rows.x <= c.y)
          block_class = (rows.x == rows.y && c.x == c.y && c.x == rows.x) ? 2 : 1;
      }
      unsigned const mask_bits = __ballot_sync(0xffffffffu, block_class == 1);
      unsigned const full_bits = __ballot_sync(0xffffffffu, block_class == 2);
      if (lane == 0) warp_mask[warp] = __popc(mask_bits), warp_full[warp] = __popc(full_bits);
      __syncthreads();
      int mask_at = masked + __popc(mask_bits & lanes_below), full_at = full + __popc(full_bits & lanes_below);
      for (int w = 0; w < kThreads / 32; ++w) {
        if (w < warp) mask_at += warp_mask[w], full_at += warp_full[w];
        masked += warp_mask[w];
        full += warp_full[w];
      }
      if (block_class == 1) masks[mask_at] = n;
      if (block_class == 2) fulls[full_at] = n;
      __syncthreads();  // warp_mask / warp_full are rewritten by the next chunk
    }
    if (threadIdx.x == 0) mask_cnt[list] = masked, full_cnt[list] = full;
  }
}

struct ListsLayout {
  std::size_t row_ranges, col_ranges, mask_cnt, full_cnt, mask_idx, full_idx, total;
};

ListsLayout lists_layout(BlockSparseParams const& bs, int batch) {
  std::size_t const lists = std::size_t(batch) * bs.num_row_blocks;
  std::size_t const entries = lists * bs.num_col_blocks;
  WorkspaceLayoutBuilder buffers;
  ListsLayout l;
  l.row_ranges = buffers.take(sizeof(int2) * lists);
  l.col_ranges = buffers.take(sizeof(int2) * std::size_t(batch) * bs.num_col_blocks);
  l.mask_cnt = buffers.take(sizeof(int) * lists);
  l.full_cnt = buffers.take(sizeof(int) * lists);
  l.mask_idx = buffers.take(sizeof(int) * entries);
  l.full_idx = buffers.take(sizeof(int) * entries);
  l.total = buffers.total();
  return l;
}

void check_launch(const char* what) {
  cudaError_t const launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "mask_mod",
                std::string("cuflash: launching the document block-list kernel (") + what +
                    ") failed: " + cudaGetErrorString(launched));
  }
}

}  // namespace

std::size_t document_block_lists_bytes(BlockSparseParams const& bs, int batch) {
  return lists_layout(bs, batch).total;
}

void build_document_block_lists(BlockSparseParams& bs, ModParams const& mask_mod, int batch, int seqlen_q,
                                int seqlen_k, void* workspace, StreamHandle stream) {
  ListsLayout const l = lists_layout(bs, batch);
  char* const base = static_cast<char*>(workspace);
  auto* const row_ranges = reinterpret_cast<int2*>(base + l.row_ranges);
  auto* const col_ranges = reinterpret_cast<int2*>(base + l.col_ranges);
  auto* const mask_cnt = reinterpret_cast<int*>(base + l.mask_cnt);
  auto* const full_cnt = reinterpret_cast<int*>(base + l.full_cnt);
  auto* const mask_idx = reinterpret_cast<int*>(base + l.mask_idx);
  auto* const full_idx = reinterpret_cast<int*>(base + l.full_idx);
  bs.mask_block_cnt = mask_cnt;
  bs.mask_block_idx = mask_idx;
  bs.full_block_cnt = full_cnt;
  bs.full_block_idx = full_idx;
  if (batch == 0 || bs.num_row_blocks == 0) return;
  // The ids are (batch, L), rows contiguous (validated): the row stride is L.
  DocumentIds const doc{static_cast<int const*>(mask_mod.aux[0]), mask_mod.aux_cols[0],
                        int(std::min<std::int64_t>(mask_mod.aux_cols[0], INT_MAX))};
  auto const cuda_stream = static_cast<cudaStream_t>(stream);
  int const range_blocks = std::max(bs.num_row_blocks, bs.num_col_blocks);
  int const grid_y = std::min(batch, kMaxGridY);
  document_block_ranges_kernel<<<dim3(range_blocks, grid_y), kThreads, 0, cuda_stream>>>(
      doc, bs, batch, seqlen_q, seqlen_k, row_ranges, col_ranges);
  check_launch("ranges");
  document_block_lists_kernel<<<dim3(bs.num_row_blocks, grid_y), kThreads, 0, cuda_stream>>>(
      bs, batch, row_ranges, col_ranges, mask_cnt, mask_idx, full_cnt, full_idx);
  check_launch("lists");
}

}  // namespace cuflash::sm90
