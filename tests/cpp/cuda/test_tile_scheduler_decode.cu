// The forward's tile decode (PersistentTileSchedulerSm90::tile, by multiply and shift) against
// the plain divisions it replaced, over a grid of shapes: every index of every shape. Host only:
// compiled by nvcc for the CUTLASS headers, run on the CPU.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace cuflash::sm90
