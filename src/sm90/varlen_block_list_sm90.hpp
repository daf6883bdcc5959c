// The varlen block lists: the (sequence, block) pairs of packed rows (cu_seqlens) that hold
// rows, built on the device before the kernels that walk them. The forward walks the row blocks
// of the queries; the backward the column blocks of the keys (main kernel, dK / dV conversion)
// and the row blocks of the queries (preprocess, dQ conversion).
//
// Without a list the work is batch x ceil(seqlen / block) blocks per head, with seqlen the
// longest sequence. Where the lengths are on the device and no max_seqlen hint is given, that is
// the total (the seed's bound too), so for 64 sequences of 1k nearly every block is empty and is
// still walked or launched to be skipped: 524k forward tiles for 8k with rows at 16 heads, and
// in the backward as many 200 KB CTAs started and stopped one per SM at a time. With a list the
// kernels walk ceil(total / block) + batch entries per head (a bound on the blocks with rows,
// known on the host without reading cu_seqlens), and each reads its (sequence, block) from the
// list; the entries past the last block are empty ones that every role skips alike.
// FlashAttention-3 bounds its varlen forward grid the same way, with a prefix sum over the
// sequences' block counts.
//
// Order: sequence by sequence, so that a sequence's K/V (forward) or Q/dO (backward) stay in L2
// over its blocks; a sequence's blocks ascending, or descending with longest_first (the forward's
// causal-like masks: a sequence's last row blocks see the most keys; the backward's deterministic
// causal / local launch order, in which the column blocks a block waits on launch first).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

#include <algorithm>

#include <cub/block/block_scan.cuh>

#include "api/params.hpp"

namespace cuflash::sm90 {

struct VarlenBlockListParams {
  int const* cu_seqlens = nullptr;  // (batch + 1,)
  int batch = 0;
  int rows_per_token = 1;  // the forward's packed GQA: the query heads of a group share a tile's rows
  int block = 128;         // rows per block
  // The rectangle's blocks per sequence, ceil(seqlen * rows_per_token / block): a max_seqlen
  // hint below a sequence's length is trusted, as without the list (the rows past it are not
  // computed, and per-row data sized by the hint, such as block lists, not read).
  int max_blocks = 0;
  int num_entries = 0;  // entries the kernels walk: varlen_block_list_entries
  int empty_block = 0;  // the block of an empty entry: past sequence 0's rows
  bool longest_first = false;
  int2* entries = nullptr;  // (num_entries,): {sequence, block}
  // (batch,) or null: each sequence's entries as listed, its blocks (at most max_blocks), or
  // fewer where malformed lengths ran past num_entries, so that a kernel waiting for a
  // sequence's blocks (the backward's dQ conversion) waits for the CTAs that exist.
  int* counts = nullptr;
  // (1,) or null: how many entries the builder listed, those with a block; the rest, after them,
  // are empty. The forward's persistent tiles stop there rather than claim and skip each.
  int* listed = nullptr;
};

// One CTA: the sequences in chunks of kThreads, each chunk's block counts scanned into the
// entries' offsets, then the chunk's entries written by all threads (a sequence of many
// blocks is not left to one thread). cu_seqlens is not checked here (the API checks it on the
// host where it can, CUFLASH_CHECK_INPUTS): a decreasing pair counts no blocks, and no entry is
// written past num_entries.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) build_varlen_block_list_sm90(VarlenBlockListParams p) {
  using BlockScan = cub::BlockScan<long long, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  // The chunk's sequences' first entries, then its end (64-bit: counts from malformed lengths
  // may pass int before they are cut at num_entries).
  __shared__ long long first_entry[kThreads + 1];
  int const tid = int(threadIdx.x);
  long long chunk_first = 0;  // the first entry of the current chunk
  int chunk = 0;
  for (; chunk < p.batch && chunk_first < p.num_entries; chunk += kThreads) {
    int const seq = chunk + tid;
    long long blocks = 0;
    if (seq < p.batch) {
      long long const rows = ((long long)p.cu_seqlens[seq + 1] - p.cu_seqlens[seq]) * p.rows_per_token;
      blocks = rows > 0 ? min((rows + p.block - 1) / p.block, (long long)p.max_blocks) : 0;
    }
    long long offset, chunk_blocks;
    BlockScan(scan_storage).ExclusiveSum(blocks, offset, chunk_blocks);
    first_entry[tid] = chunk_first + offset;
    if (tid == 0) first_entry[kThreads] = chunk_first + chunk_blocks;
    __syncthreads();
    int const chunk_end = int(min(first_entry[kThreads], (long long)p.num_entries));
    if (p.counts != nullptr && seq < p.batch) {
      p.counts[seq] = int(min(first_entry[tid + 1], (long long)p.num_entries) -
                          min(first_entry[tid], (long long)p.num_entries));
    }
    for (int entry = int(chunk_first) + tid; entry < chunk_end; entry += kThreads) {
      // The last sequence of the chunk whose first entry is at or before this one: the one that
      // holds it (a sequence with no blocks shares its first entry with the next).
      int lo = 0, hi = kThreads;  // first_entry[lo] <= entry < first_entry[hi]
      while (hi - lo > 1) {
        int const mid = (lo + hi) >> 1;
        if (first_entry[mid] <= entry) lo = mid; else hi = mid;
      }
      int const index = int(entry - first_entry[lo]);
      int const count = int(first_entry[lo + 1] - first_entry[lo]);
      p.entries[entry] = make_int2(chunk + lo, p.longest_first ? count - 1 - index : index);
    }
    chunk_first += chunk_blocks;
    __syncthreads();  // first_entry and the scan storage are rewritten by the next chunk
  }
  if (p.listed != nullptr && tid == 0) *p.listed = int(min(chunk_first, (long long)p.num_entries));
  for (int seq = chunk + tid; p.counts != nullptr && seq < p.batch; seq += kThreads) {
    p.counts[seq] = 0;  // past num_entries: none listed
  }
  for (int entry = int(min(chunk_first, (long long)p.num_entries)) + tid; entry < p.num_entries;
       entry += kThreads) {
    p.entries[entry] = make_int2(0, p.empty_block);
  }
}

// The list of the blocks of `block` rows over cu_seqlens (times rows_per_token) of `total_rows`
// rows in all (the tokens times rows_per_token), at most max_blocks per sequence, in `entries`
// (varlen_block_list_entries of them); no counts or listed count (a caller that wants them sets
// `counts` / `listed`).
inline VarlenBlockListParams make_varlen_block_list(int const* cu_seqlens, int batch, int rows_per_token,
                                                    long long total_rows, int block, int max_blocks,
                                                    bool longest_first, int2* entries) {
  VarlenBlockListParams list;
  list.cu_seqlens = cu_seqlens;
  list.batch = batch;
  list.rows_per_token = rows_per_token;
  list.block = block;
  list.max_blocks = max_blocks;
  list.num_entries = int(varlen_block_list_entries(total_rows, batch, block));
  list.empty_block = int(std::max<long long>((total_rows + block - 1) / block, 1));
  list.longest_first = longest_first;
  list.entries = entries;
  return list;
}

inline void launch_build_varlen_block_list(VarlenBlockListParams const& p, cudaStream_t stream) {
  constexpr int kThreads = 512;
  build_varlen_block_list_sm90<kThreads><<<1, kThreads, 0, stream>>>(p);
}

}  // namespace cuflash::sm90
