// The varlen forward's row-block list: the (sequence, row block) pairs of packed queries
// (cu_seqlens_q) that hold rows, built on the device before the forward kernel.
//
// Without it the tile list is batch x ceil(seqlen_q / kBlockM) row blocks per head, with seqlen_q
// the longest sequence. Where the lengths are on the device and no max_seqlen_q is given, that is
// total_q (the seed's bound too), so for 64 sequences of 1k nearly every tile is empty and is
// still walked to be skipped (decode, length reads, handoff): 524k tiles for 8k with rows at 16
// heads. With the list the scheduler walks ceil(total_q / kBlockM) + batch entries per head (a
// bound on the row blocks with rows, known on the host without reading cu_seqlens_q), and each
// tile reads its (sequence, row block) from the list; the entries past the last row block are
// empty ones that every role skips alike. FlashAttention-3 bounds its varlen grid the same way,
// with a prefix sum over the sequences' block counts.
//
// Order: sequence by sequence, so that a sequence's K/V stay in L2 over its row blocks; the
// scheduler walks the heads (and splits) of an entry before the next entry, so a GQA group's
// heads read the same K/V one after another. With causal-like masks a sequence's last row
// blocks, which see the most keys, come first (longest-processing-time first within the
// sequence; the dynamic scheduler balances the rest).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

#include <cub/block/block_scan.cuh>

#include "api/params.hpp"

namespace cuflash::sm90 {

struct VarlenRowBlocksParams {
  int const* cu_seqlens_q = nullptr;  // (batch + 1,)
  int batch = 0;
  int rows_per_query = 1;  // packed GQA: the query heads of a group share a tile's rows
  int block_m = 128;
  // The rectangle's row blocks per sequence, ceil(seqlen_q * rows_per_query / block_m): a
  // max_seqlen_q hint below a sequence's length is trusted, as without the list (the rows past
  // it are not computed, and per-row data sized by the hint, such as block lists, not read).
  int max_blocks = 0;
  int num_entries = 0;    // entries the scheduler walks: fwd_row_block_list_entries
  int empty_m_block = 0;  // the row block of an empty entry: past sequence 0's rows
  bool longest_first = false;
  int2* entries = nullptr;  // (num_entries,): {sequence, row block}
};

// One CTA: the sequences in chunks of kThreads, each chunk's block counts scanned into the
// entries' offsets, then the chunk's entries written by all threads (a sequence of many row
// blocks is not left to one thread). cu_seqlens_q is not checked here (the API checks it on the
// host where it can, CUFLASH_CHECK_INPUTS): a decreasing pair counts no blocks, and no entry is
// written past num_entries.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) build_varlen_row_blocks_sm90(VarlenRowBlocksParams p) {
  using BlockScan = cub::BlockScan<long long, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  // The chunk's sequences' first entries, then its end (64-bit: counts from malformed lengths
  // may pass int before they are cut at num_entries).
  __shared__ long long first_entry[kThreads + 1];
  int const tid = int(threadIdx.x);
  long long chunk_first = 0;  // the first entry of the current chunk
  for (int chunk = 0; chunk < p.batch && chunk_first < p.num_entries; chunk += kThreads) {
    int const seq = chunk + tid;
    long long blocks = 0;
    if (seq < p.batch) {
      long long const rows = ((long long)p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq]) * p.rows_per_query;
      blocks = rows > 0 ? min((rows + p.block_m - 1) / p.block_m, (long long)p.max_blocks) : 0;
    }
    long long offset, chunk_blocks;
    BlockScan(scan_storage).ExclusiveSum(blocks, offset, chunk_blocks);
    first_entry[tid] = chunk_first + offset;
    if (tid == 0) first_entry[kThreads] = chunk_first + chunk_blocks;
    __syncthreads();
    int const chunk_end = int(min(first_entry[kThreads], (long long)p.num_entries));
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
  for (int entry = int(min(chunk_first, (long long)p.num_entries)) + tid; entry < p.num_entries;
       entry += kThreads) {
    p.entries[entry] = make_int2(0, p.empty_m_block);
  }
}

inline void launch_build_varlen_row_blocks(VarlenRowBlocksParams const& p, cudaStream_t stream) {
  constexpr int kThreads = 512;
  build_varlen_row_blocks_sm90<kThreads><<<1, kThreads, 0, stream>>>(p);
}

}  // namespace cuflash::sm90
