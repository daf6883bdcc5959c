// The forward's tile decode (PersistentTileSchedulerSm90::tile, by multiply and shift) against
// the plain divisions it replaced, over a grid of shapes: every index of every shape. Host only:
// compiled by nvcc for the CUTLASS headers, run on the CPU.
#include <gtest/gtest.h>

#include <vector>

#include "sm90/tile_scheduler_sm90.hpp"

namespace cuflash::sm90 {
namespace {

// Tiles are (m_block, head, batch, split) in sections of section_size (batch, head) pairs, the
// last section holding the rest; m-block fastest, or (longest_first) the last m-block of every
// pair of the section first.
FwdTile decode_by_division(int index, int num_m_blocks, int num_heads, int num_splits,
                           int pairs, bool longest_first, int section_size) {
  int const tiles_per_section = num_m_blocks * section_size;
  int const section = index / tiles_per_section;
  int const first = section * section_size;
  int const here = std::min(section_size, pairs - first);
  int const rest = index - section * tiles_per_section;
  int const m_block = longest_first ? num_m_blocks - 1 - rest / here : rest % num_m_blocks;
  int const pair = first + (longest_first ? rest % here : rest / num_m_blocks);
  int const batch_split = pair / num_heads;
  return {m_block, pair % num_heads, batch_split / num_splits, batch_split % num_splits};
}

TEST(TileSchedulerDecode, MatchesDivisions) {
  long long checked = 0;
  for (int m : {1, 2, 3, 16, 33})
    for (int heads : {1, 3, 16})
      for (int batch : {1, 2, 5})
        for (int splits : {1, 3})
          for (bool longest_first : {false, true})
            for (int section : {1, 2, 3, 7, 64}) {
              auto const s =
                  PersistentTileSchedulerSm90::make(m, heads, batch, splits, longest_first, section);
              int const pairs = heads * batch * splits;
              for (int i = 0; i < s.num_tiles(); ++i) {
                FwdTile const got = s.tile(i);
                FwdTile const want =
                    decode_by_division(i, m, heads, splits, pairs, longest_first, section);
                ASSERT_EQ(got.m_block, want.m_block) << "tile " << i;
                ASSERT_EQ(got.head, want.head) << "tile " << i;
                ASSERT_EQ(got.batch, want.batch) << "tile " << i;
                ASSERT_EQ(got.split, want.split) << "tile " << i;
                ++checked;
              }
            }
  EXPECT_GT(checked, 100000);
}

// The varlen list's heads order (list_heads_order): every index below listed x pairs is one
// {entry, pair}, each once; a section's pairs go over every entry before the next section; within
// a section, an entry's pairs are consecutive.
TEST(TileSchedulerDecode, ListHeadsOrderIsOneWalk) {
  for (int listed : {1, 2, 7, 40})
    for (int pairs : {1, 3, 8, 48})
      for (int section : {1, 2, 3, 4, 8, 64}) {
        std::vector<int> seen(std::size_t(listed) * pairs, 0);
        int last_section = 0;
        for (int i = 0; i < listed * pairs; ++i) {
          int2 const at = PersistentTileSchedulerSm90::list_heads_order(i, listed, section, pairs);
          ASSERT_GE(at.x, 0);
          ASSERT_LT(at.x, listed);
          ASSERT_GE(at.y, 0);
          ASSERT_LT(at.y, pairs);
          ++seen[std::size_t(at.x) * pairs + at.y];
          int const pair_section = at.y / section;
          ASSERT_GE(pair_section, last_section) << "index " << i;  // sections one after another
          last_section = pair_section;
          if (i > 0) {
            int2 const before = PersistentTileSchedulerSm90::list_heads_order(i - 1, listed, section, pairs);
            if (before.y / section == pair_section) {  // within a section: entry by entry
              ASSERT_TRUE(at.x == before.x ? at.y == before.y + 1 : at.x == before.x + 1) << "index " << i;
            }
          }
        }
        for (int count : seen) ASSERT_EQ(count, 1);
      }
}

}  // namespace
}  // namespace cuflash::sm90
