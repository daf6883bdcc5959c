// Tile scheduler for the forward kernel, three ways (the launch chooses,
// flash_fwd_launch_sm90.hpp):
// - static persistent: one CTA per SM, each walks the tile list with a stride of the grid size;
//   the next tile's loads overlap the current tile's epilogue. For tiles of equal cost.
// - dynamic persistent: one CTA per SM; a CTA's first tile is blockIdx.x, every later one is
//   claimed from a global counter, so CTAs that drew short tiles take more of them. For tiles
//   of unequal cost; keeps the overlap of the persistent loop.
// - one CTA per tile (the stride walk with grid = tiles): the hardware hands out tiles as SMs
//   free up; no overlap between tiles. Kept for comparison (CUFLASH_FWD_SCHEDULER).
// Tiles are (m_block, head, batch, split); split-KV splits count as more (batch, head) pairs.
// With the varlen row-block list (varlen_block_list_sm90.hpp) the "batch" is an entry of the
// list, one m-block per pair, and the tile takes its sequence and row block from the entry.
// Tile order: (batch, head) pairs in sections whose K/V fit in L2 together. Without causal/local
// masking, m-block fastest within a section; with it, the m-blocks that see the most keys (the
// last ones, bottom-right alignment) come first for every head of the section, so that the
// short ones fill the tail (longest-processing-time first).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

#include <algorithm>

#include "api/params.hpp"

namespace cuflash::sm90 {

struct FwdTile {
  int m_block, head, batch;
  int split;  // split-KV: which part of the key range (0 without split-KV)
};

// Dynamic scheduling: one thread of the producer (the writer) claims each next tile from the
// global counter and hands its index to every other thread that walks the tiles (the readers:
// the MMA threads, and the other producer threads when they gather paged K/V) through a
// two-slot ring in shared memory.
// Handoff h (h = 0, 1, ...: the index of this CTA's tile h + 1) uses slot h % 2 and phase h / 2
// of that slot's barriers:
//   writer: waits for phase h / 2 - 1 of empty[slot] to complete (every reader has taken handoff
//           h - 2 from the slot; for h < 2 that wait is on the phase before a fresh barrier's
//           first, which passes at once), stores the index, arrives on full[slot] (arrival
//           count 1), completing its phase h / 2;
//   reader: waits for phase h / 2 of full[slot], loads the index, arrives on empty[slot]
//           (arrival count: the number of readers).
// Only parities are waited on, so h modulo 4 is all either side needs. mbarrier arrive releases
// and its wait acquires (CTA scope): the store is visible to the readers, and their loads are
// done before the slot is written again. Every role takes every handoff, including the last,
// whose index (past num_walked_tiles) ends every role's loop alike, so all see the same tiles
// and the same end. The writer waits only for readers to take handoff h - 2, which needs nothing
// from it beyond what it did before handoff h - 1 (the loads of tiles up to h - 1): no cycle,
// hence no deadlock; the writer runs at most two tiles ahead of the slowest reader.
struct TileHandoff {
  cutlass::arch::ClusterBarrier full[2];
  cutlass::arch::ClusterBarrier empty[2];
  int tile_index[2];

  CUTLASS_DEVICE void init(int num_readers) {
    for (int slot = 0; slot < 2; ++slot) {
      full[slot].init(1);
      empty[slot].init(uint32_t(num_readers));
    }
  }

  CUTLASS_DEVICE void publish(int handoff, int index) {
    int const slot = handoff & 1;
    empty[slot].wait(uint32_t(((handoff >> 1) & 1) ^ 1));
    // The barrier asm has no memory clobber: keep the compiler from moving the store across it.
    asm volatile("" ::: "memory");
    *reinterpret_cast<int volatile*>(&tile_index[slot]) = index;
    asm volatile("" ::: "memory");
    full[slot].arrive();
  }

  CUTLASS_DEVICE int take(int handoff) {
    int const slot = handoff & 1;
    full[slot].wait(uint32_t((handoff >> 1) & 1));
    asm volatile("" ::: "memory");
    int const index = *reinterpret_cast<int volatile*>(&tile_index[slot]);
    asm volatile("" ::: "memory");
    empty[slot].arrive();
    return index;
  }
};

struct PersistentTileSchedulerSm90 {
  int num_m_blocks, num_heads, batch, num_splits;
  bool longest_first;
  // (batch, head) pairs are walked in sections of this many, so that the K/V being read at
  // any time stay within L2 (host side: a fraction of L2 over one head's K/V bytes).
  int section_size;
  // Dynamic scheduling: a device int that is 0 at launch (the launch zeroes it); every claim
  // adds 1. Null: the stride walk (static persistent or one CTA per tile).
  int* tile_counter;
  // The varlen row-block list (device memory, read by tile() on the device only): entry e is
  // {sequence, row block} of the tiles with "batch" e. Null: the batch x num_m_blocks rectangle.
  int2 const* row_blocks;
  // With the list: how many of its entries hold a row block (written by the list's builder); the
  // tiles of the entries after them are empty. Null: every entry is walked.
  int const* listed_entries;
  // With the list walked in the heads order (FwdRowBlockListOrder::kHeads): the (head, split)
  // pairs of a section, walked over every listed entry before the next section (the query heads
  // of one kv head; 1 for MHA and packed GQA). 0: the entries order, every pair of an entry
  // before the next entry.
  int list_section_pairs;
  // The divisions of tile(), by multiply and shift (make fills them): a consumer decodes its next
  // tile between two tiles, where a chain of integer divisions held up the next tile's first
  // Q K^T (a few hundred cycles per tile, bench/NOTES.md).
  cutlass::FastDivmod div_section_tiles;  // by num_m_blocks * section_size
  cutlass::FastDivmod div_section;        // by section_size
  cutlass::FastDivmod div_last_section;   // by the last section's (batch, head) pairs
  cutlass::FastDivmod div_m_blocks, div_heads, div_splits;

  static PersistentTileSchedulerSm90 make(int num_m_blocks, int num_heads, int batch,
                                          int num_splits, bool longest_first, int section_size) {
    PersistentTileSchedulerSm90 s;
    s.num_m_blocks = num_m_blocks;
    s.num_heads = num_heads;
    s.batch = batch;
    s.num_splits = num_splits;
    s.longest_first = longest_first;
    s.section_size = section_size;
    s.tile_counter = nullptr;
    s.row_blocks = nullptr;
    s.listed_entries = nullptr;
    s.list_section_pairs = 0;
    int const pairs = s.num_heads_batches();
    int const sections = (pairs + section_size - 1) / section_size;
    s.div_section_tiles = cutlass::FastDivmod(std::max(1, num_m_blocks * section_size));
    s.div_section = cutlass::FastDivmod(std::max(1, section_size));
    s.div_last_section = cutlass::FastDivmod(std::max(1, pairs - (sections - 1) * section_size));
    s.div_m_blocks = cutlass::FastDivmod(std::max(1, num_m_blocks));
    s.div_heads = cutlass::FastDivmod(std::max(1, num_heads));
    s.div_splits = cutlass::FastDivmod(std::max(1, num_splits));
    return s;
  }

  CUTLASS_HOST_DEVICE int num_heads_batches() const { return num_heads * batch * num_splits; }
  CUTLASS_HOST_DEVICE int num_tiles() const { return num_m_blocks * num_heads_batches(); }

  // The tiles a CTA walks: with the list, those of its listed entries only. One m-block per
  // entry and the heads and splits of an entry before the next (tile()), so a tile's index is
  // (entry x splits + split) x heads + head: the listed entries' tiles come first. Every role of
  // a CTA reads the same count, so producer and consumers stop at the same tile.
  CUTLASS_DEVICE int num_walked_tiles() const {
    if (listed_entries == nullptr) return num_tiles();
    // Clamped to the list, so that no count can overflow the product (the builder writes at most
    // the entries the list holds).
    int const listed = min(max(*listed_entries, 0), batch);
    return min(num_tiles(), listed * num_heads * num_splits);
  }

  // The heads order's tile `index` over `listed` entries (listed > 0) and `pairs` (head, split)
  // pairs in sections of section_pairs: {entry, pair}. A section's tiles are its pairs of one
  // entry, then of the next; the last section holds the pairs left. Every index below listed x
  // pairs is one tile, each once (tested on the host). Two divisions by values only the device
  // knows (listed), at one tile's start; the entries order needs none.
  CUTLASS_HOST_DEVICE static int2 list_heads_order(int index, int listed, int section_pairs, int pairs) {
    int const per_section = listed * section_pairs;
    int const section = index / per_section;
    int const rest = index - section * per_section;
    int const first_pair = section * section_pairs;
    int const pairs_here = pairs - first_pair < section_pairs ? pairs - first_pair : section_pairs;
    int const entry = rest / pairs_here;
    return make_int2(entry, first_pair + rest - entry * pairs_here);
  }

  static dim3 grid_shape(int num_tiles, int num_sm) {
    return dim3(unsigned(std::max(1, std::min(num_tiles, num_sm))));
  }

  static int choose_section_size(long long kv_bytes_per_head, int heads_per_kv_head,
                                 int num_heads_batches) {
    long long const kv_heads =
        std::max(1ll, kFwdKvL2BudgetBytes / std::max(1ll, kv_bytes_per_head));
    return int(std::max(1ll, std::min<long long>(kv_heads * heads_per_kv_head, num_heads_batches)));
  }

  CUTLASS_DEVICE bool is_dynamic() const { return tile_counter != nullptr; }

  // Dynamic: the writer claims the tile after the current one, once per tile (also for tiles
  // it skips). The first gridDim.x tiles are the CTAs' first ones, so claim c of the whole grid
  // gets tile gridDim.x + c; each CTA's last claim is past the walked tiles (num_walked_tiles:
  // as many claims in all).
  CUTLASS_DEVICE int claim() const {
    return is_dynamic() ? atomicAdd(tile_counter, 1) + int(gridDim.x) : 0;
  }

  // The tile after `index`, this CTA's handoff-th (any number congruent modulo 4): the stride
  // walk, or (dynamic) the writer's claim, made at the start of the tile so that the atomic's
  // latency hides under the tile's loads, handed to the readers through `ring`.
  // kMayBeDynamic false: kernels built without dynamic scheduling (no handoff code at all).
  template <bool kMayBeDynamic>
  CUTLASS_DEVICE int next_tile(TileHandoff& ring, int handoff, int index, int claimed,
                               bool writer) const {
    if (!kMayBeDynamic || !is_dynamic()) return index + int(gridDim.x);
    if (writer) {
      ring.publish(handoff, claimed);
      return claimed;
    }
    return ring.take(handoff);
  }

  // kListHeadsOrder: the kernel may walk its list in the heads order (list_section_pairs); a
  // kernel built without it carries none of that decode.
  template <bool kListHeadsOrder = false>
  CUTLASS_HOST_DEVICE FwdTile tile(int index) const {
#if defined(__CUDA_ARCH__)
    if (kListHeadsOrder && row_blocks != nullptr && list_section_pairs > 0) {
      int const listed = listed_entries != nullptr ? min(max(*listed_entries, 1), batch) : batch;
      int2 const at = list_heads_order(index, listed, list_section_pairs, num_heads * num_splits);
      int split, head;
      div_heads(split, head, at.y);
      int2 const entry = row_blocks[at.x];
      return {entry.y, head, entry.x, split};
    }
#endif
    int section, rest;
    div_section_tiles(section, rest, index);
    int const first_head_batch = section * section_size;
    // Every section holds section_size (batch, head) pairs but the last, which holds the rest.
    bool const last = first_head_batch + section_size >= num_heads_batches();
    int m_block, head_batch, quotient, remainder;
    if (longest_first) {
      (last ? div_last_section : div_section)(quotient, remainder, rest);
      m_block = num_m_blocks - 1 - quotient;
      head_batch = first_head_batch + remainder;
    } else {
      div_m_blocks(quotient, remainder, rest);
      m_block = remainder;
      head_batch = first_head_batch + quotient;
    }
    int batch_split, head, batch, split;
    div_heads(batch_split, head, head_batch);
    div_splits(batch, split, batch_split);
#if defined(__CUDA_ARCH__)
    if (row_blocks != nullptr) {
      int2 const entry = row_blocks[batch];
      batch = entry.x;
      m_block = entry.y;
    }
#endif
    return {m_block, head, batch, split};
  }
};

}  // namespace cuflash::sm90
