// cuflash::kernel_head_dims: the head dims of the compiled kernel that runs a call. Forward and
// backward dispatch and the kernel modules compiled at run time all take them from here, so a
// change to the rule shows up in this table.
#include <gtest/gtest.h>

#include <utility>

#include "cuflash/cuflash.hpp"

namespace cuflash {
namespace {

struct Case {
  int head_dim, head_dim_v;
  int expected, expected_v;
};

TEST(KernelHeadDims, RoundsUpToTheCompiledDims) {
  const Case cases[] = {
      {8, 8, 64, 64},       {64, 64, 64, 64},     {72, 64, 96, 96},     {80, 80, 96, 96},
      {96, 96, 96, 96},     {104, 104, 128, 128}, {128, 64, 128, 128},  {64, 128, 128, 128},
      {128, 128, 128, 128}, {192, 192, 192, 192}, {128, 192, 192, 192}, {200, 256, 256, 256},
      {256, 256, 256, 256}, {64, 256, 256, 256},  {256, 64, 256, 256},
  };
  for (const Case& c : cases) {
    KernelHeadDims const dims = kernel_head_dims(c.head_dim, c.head_dim_v);
    EXPECT_EQ(dims.head_dim, c.expected) << c.head_dim << " / " << c.head_dim_v;
    EXPECT_EQ(dims.head_dim_v, c.expected_v) << c.head_dim << " / " << c.head_dim_v;
  }
}

// Q/K in (128, 192] with V at most 128 runs the 192x128 kernel; V over 128 or Q/K outside that
// range does not.
TEST(KernelHeadDims, Hdim192x128) {
  const Case cases[] = {
      {136, 128, 192, 128}, {160, 128, 192, 128}, {192, 128, 192, 128}, {192, 64, 192, 128},
      {192, 8, 192, 128},   {128, 128, 128, 128}, {192, 136, 192, 192}, {200, 128, 256, 256},
  };
  for (const Case& c : cases) {
    KernelHeadDims const dims = kernel_head_dims(c.head_dim, c.head_dim_v);
    EXPECT_EQ(dims.head_dim, c.expected) << c.head_dim << " / " << c.head_dim_v;
    EXPECT_EQ(dims.head_dim_v, c.expected_v) << c.head_dim << " / " << c.head_dim_v;
  }
}

TEST(KernelHeadDims, NoneOver256) {
  for (auto [d, dv] : {std::pair{264, 64}, std::pair{64, 264}, std::pair{512, 512}}) {
    KernelHeadDims const dims = kernel_head_dims(d, dv);
    EXPECT_EQ(dims.head_dim, 0) << d << " / " << dv;
    EXPECT_EQ(dims.head_dim_v, 0) << d << " / " << dv;
  }
}

// Every valid pair (multiples of 8 up to 256) gets a compiled kernel that holds it, and the
// smallest such: apart from the 192x128 kernel, both dims round to the next compiled one.
TEST(KernelHeadDims, EveryValidPairFitsItsKernel) {
  const int compiled[] = {64, 96, 128, 192, 256};
  auto next_compiled = [&](int d) {
    for (int c : compiled)
      if (d <= c) return c;
    return 0;
  };
  for (int d = 8; d <= 256; d += 8) {
    for (int dv = 8; dv <= 256; dv += 8) {
      KernelHeadDims const dims = kernel_head_dims(d, dv);
      EXPECT_GE(dims.head_dim, d) << d << " / " << dv;
      EXPECT_GE(dims.head_dim_v, dv) << d << " / " << dv;
      bool const split = dims.head_dim == 192 && dims.head_dim_v == 128;
      EXPECT_EQ(split, d > 128 && d <= 192 && dv <= 128) << d << " / " << dv;
      if (!split) {
        EXPECT_EQ(dims.head_dim, dims.head_dim_v) << d << " / " << dv;
        EXPECT_EQ(dims.head_dim, next_compiled(d > dv ? d : dv)) << d << " / " << dv;
      }
    }
  }
}

}  // namespace
}  // namespace cuflash
