// GPU forward kernel with paged K/V against the CPU reference (DESIGN.md section 5): k/v live in
// a pool of pages (num_pages, page_size, H_kv, D) reached through a random page table (shuffled
// pages, pages shared between sequences, spare pages nobody uses). Page sizes that hold whole
// n-blocks take the TMA path, the others the gathered one; both are covered for every head dim
// this build has. Outputs are poisoned before each run and every element is checked.
#include <gtest/gtest.h>

#if CUFLASH_HAS_CUDA  // a build without the CUDA toolkit has no device kernels to test

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuflash/cuflash.hpp"
#include "gpu_test_problem.hpp"
#include "gpu_test_util.hpp"

namespace cuflash {
namespace {

using gpu_testing::DeviceBuffer;
using gpu_testing::expect_output_close;
using gpu_testing::from_device_16bit, gpu_testing::to_device_16bit;
using gpu_testing::kCpu, gpu_testing::kCuda, gpu_testing::kNegInf;

struct PagedCase {
  std::string label;
  DType dtype = DType::kBFloat16;
  int batch = 1, seqlen_q = 1, heads = 1, heads_kv = 1, head_dim = 128, head_dim_v = 128;
  int page_size = 16;
  int max_pages = 1;  // page_table columns: each sequence holds up to max_pages * page_size keys
  bool causal = false;
  int window_left = -1, window_right = -1;
  bool seqused = false;       // seqused_k caps each sequence's keys (some mid-page, one empty)
  bool packed_q = false;      // q packed with cu_seqlens_q, lengths drawn up to seqlen_q
  bool shared_pages = false;  // sequence 1 starts with sequence 0's pages (a shared prefix)
  // Every pool row that holds no used key is NaN (the unfilled tail of a sequence's last page,
  // spare pages): the kernel must not let it into the output (CUFLASH_FWD_ZERO_V_TAIL=auto, the
  // default, zeroes the V tail of paged calls).
  bool nan_tail = false;
  int num_splits = 1;         // split-KV; <= 0 lets cuflash choose
  float softcap = 0.f;
  // Built-in mods (the flex_paged kernels): ALiBi with fixed small slopes per head; mask scalars as
  // MaskMod::scalars.
  ScoreModKind score_mod = ScoreModKind::kNone;
  MaskModKind mask_mod = MaskModKind::kNone;
  std::vector<double> mask_scalars;
  std::optional<bool> pack_gqa;  // packed GQA tiles; unset: cuflash chooses
  unsigned seed = 1;
};

std::string case_name(const PagedCase& c) {
  return gpu_testing::case_name(c.label + "_page" + std::to_string(c.page_size), c.dtype,
                                c.head_dim, c.head_dim_v);
}

// Host copy of one problem: q as packed rows (rows_q, H, D) (dense is B * Sq rows), the page
// pool as (num_pages, page_size, H_kv, D), and the page table.
struct Problem {
  PagedCase c;
  std::vector<int> len_q, start_q;
  std::vector<int> used_k;  // keys each sequence attends to
  int rows_q = 0, num_pages = 0;
  std::vector<int> page_table;  // (B, max_pages)
  std::vector<float> q, k, v;   // values already rounded to the input dtype
  std::vector<float> slopes;    // ALiBi, (H,)
  std::vector<int> doc_ids;     // document mask, (B, doc_len): documents of 1..300 positions in order
  int doc_len = 0;
  float scale = 1.f;

  explicit Problem(const PagedCase& pc) : c(pc) {
    std::mt19937 rng(c.seed);
    const int capacity = c.max_pages * c.page_size;
    std::uniform_int_distribution<int> any_q(0, c.seqlen_q), any_k(0, capacity);
    for (int b = 0; b < c.batch; ++b) {
      int lq = c.packed_q ? any_q(rng) : c.seqlen_q;
      if (c.packed_q && b == 0) lq = c.seqlen_q;  // the longest one is always there
      len_q.push_back(lq);
      start_q.push_back(rows_q);
      rows_q += lq;
      int lk = c.seqused ? any_k(rng) : capacity;
      if (c.seqused && b == 0) lk = capacity;  // a full sequence
      if (c.seqused && b == 1) lk = 0;         // and one without keys (out 0, lse -inf)
      used_k.push_back(lk);
    }
    // Pool: every sequence's pages plus a few spare ones, handed out in a random order.
    // Entries past a sequence's used keys point far outside the pool: a kernel that reads a
    // page it should not faults instead of passing by luck.
    const int spare = 3;
    num_pages = c.batch * c.max_pages + spare;
    std::vector<int> order(num_pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    page_table.assign(std::size_t(c.batch) * c.max_pages, num_pages + (1 << 20));
    int next = 0;
    for (int b = 0; b < c.batch; ++b) {
      const int pages_used = (used_k[b] + c.page_size - 1) / c.page_size;
      for (int p = 0; p < pages_used; ++p) {
        const bool shared = c.shared_pages && b == 1 && p < c.max_pages / 2;
        page_table[std::size_t(b) * c.max_pages + p] = shared ? page_table[p] : order[next++];
      }
    }
    std::normal_distribution<float> normal(0.f, 1.f);
    using gpu_testing::fill_normal;
    fill_normal(q, std::size_t(rows_q) * c.heads * c.head_dim, c.dtype, normal, rng);
    const std::size_t pool_rows = std::size_t(num_pages) * c.page_size;
    fill_normal(k, pool_rows * c.heads_kv * c.head_dim, c.dtype, normal, rng);
    fill_normal(v, pool_rows * c.heads_kv * c.head_dim_v, c.dtype, normal, rng);
    if (c.nan_tail) {
      std::vector<bool> used(pool_rows, false);
      for (int b = 0; b < c.batch; ++b)
        for (int j = 0; j < used_k[b]; ++j) used[key_row(b, j)] = true;
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (std::size_t row = 0; row < pool_rows; ++row) {
        if (used[row]) continue;
        std::fill_n(k.begin() + row * c.heads_kv * c.head_dim, c.heads_kv * c.head_dim, nan);
        std::fill_n(v.begin() + row * c.heads_kv * c.head_dim_v, c.heads_kv * c.head_dim_v, nan);
      }
    }
    scale = 1.f / std::sqrt(float(c.head_dim));
    // Small slopes (2^-7 .. 2^-10): over the decode cases' 1500 keys a larger bias would leave the
    // dtype-rounded naive scores with an error so large that the accuracy rule could not catch a
    // wrong kernel.
    for (int h = 0; h < c.heads; ++h) slopes.push_back(std::ldexp(1.f, -(h % 4) - 7));
    if (c.mask_mod == MaskModKind::kDocument) {
      doc_len = std::max(c.seqlen_q, capacity);
      std::uniform_int_distribution<int> doc_length(1, 300);
      for (int b = 0; b < c.batch; ++b) {
        int doc = 0, left = doc_length(rng);
        for (int i = 0; i < doc_len; ++i) {
          if (left-- == 0) ++doc, left = doc_length(rng);
          doc_ids.push_back(doc);
        }
      }
    }
  }

  // The built-in mods at query i, key j of head h (positions in their sequence).
  float modded(float s, int h, int i, int j) const {
    return c.score_mod == ScoreModKind::kAlibi ? s + slopes[h] * float(j - i) : s;
  }
  bool mask_mod_keeps(int b, int i, int j) const {
    switch (c.mask_mod) {
      case MaskModKind::kDocument:
        return doc_ids[std::size_t(b) * doc_len + i] == doc_ids[std::size_t(b) * doc_len + j];
      case MaskModKind::kSlidingWindow:
        return i - j <= c.mask_scalars[0] && j - i <= c.mask_scalars[1];
      case MaskModKind::kPrefixLM:
        return j <= i || j < c.mask_scalars[0];
      default:
        return true;
    }
  }

  // Row of the pool that holds key j of sequence b.
  std::size_t key_row(int b, int j) const {
    return std::size_t(page_table[std::size_t(b) * c.max_pages + j / c.page_size]) * c.page_size +
           j % c.page_size;
  }
  std::int64_t lse_index(int b, int h, int r) const {
    return c.packed_q ? std::int64_t(h) * rows_q + start_q[b] + r
                      : (std::int64_t(b) * c.heads + h) * c.seqlen_q + r;
  }
  std::size_t lse_size() const {
    return c.packed_q ? std::size_t(c.heads) * rows_q : std::size_t(c.batch) * c.heads * c.seqlen_q;
  }
  std::vector<int> cu_seqlens_q() const {
    std::vector<int> out = start_q;
    out.push_back(rows_q);
    return out;
  }
};

struct Result {
  std::vector<double> out;  // (rows_q, H, Dv)
  std::vector<double> lse;  // dense (B, H, Sq) or packed (H, total_q)
};

// The same attention computed naively in the input dtype (scaled q, scores, probabilities and
// output each rounded), reading keys through the page table.
Result naive_low_precision(const Problem& pb) {
  const PagedCase& c = pb.c;
  Result result;
  result.out.assign(std::size_t(pb.rows_q) * c.heads * c.head_dim_v, 0.0);
  result.lse.assign(pb.lse_size(), kNegInf);
  const int group = c.heads / c.heads_kv;
  const int right = c.causal ? 0 : c.window_right;
  std::vector<float> qs(c.head_dim), scores;
  for (int b = 0; b < c.batch; ++b) {
    const int sq = pb.len_q[b], sk = pb.used_k[b];
    for (int h = 0; h < c.heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const float* qrow = &pb.q[(std::size_t(pb.start_q[b] + i) * c.heads + h) * c.head_dim];
        for (int d = 0; d < c.head_dim; ++d)
          qs[d] = gpu_testing::round_to(qrow[d] * pb.scale, c.dtype);
        scores.assign(sk, kNegInf);
        float row_max = kNegInf;
        for (int j = 0; j < sk; ++j) {
          const int diag = i + sk - sq;
          if ((right >= 0 && j > diag + right) || (c.window_left >= 0 && j < diag - c.window_left))
            continue;
          if (!pb.mask_mod_keeps(b, i, j)) continue;
          const float* krow = &pb.k[(pb.key_row(b, j) * c.heads_kv + hk) * c.head_dim];
          float dot = 0.f;
          for (int d = 0; d < c.head_dim; ++d) dot += qs[d] * krow[d];
          scores[j] = gpu_testing::round_to(dot, c.dtype);
          if (c.softcap > 0.f)
            scores[j] = gpu_testing::round_to(c.softcap * std::tanh(scores[j] / c.softcap), c.dtype);
          if (c.score_mod != ScoreModKind::kNone)
            scores[j] = gpu_testing::round_to(pb.modded(scores[j], h, i, j), c.dtype);
          row_max = std::max(row_max, scores[j]);
        }
        if (row_max == kNegInf) continue;  // nothing visible: out 0, lse -inf
        float denom = 0.f;
        for (int j = 0; j < sk; ++j) denom += std::exp(scores[j] - row_max);
        result.lse[pb.lse_index(b, h, i)] = row_max + std::log(denom);
        double* orow = &result.out[(std::size_t(pb.start_q[b] + i) * c.heads + h) * c.head_dim_v];
        std::vector<float> acc(c.head_dim_v, 0.f);
        for (int j = 0; j < sk; ++j) {
          if (scores[j] == kNegInf) continue;
          const float p = gpu_testing::round_to(std::exp(scores[j] - row_max) / denom, c.dtype);
          const float* vrow = &pb.v[(pb.key_row(b, j) * c.heads_kv + hk) * c.head_dim_v];
          for (int d = 0; d < c.head_dim_v; ++d) acc[d] += p * vrow[d];
        }
        for (int d = 0; d < c.head_dim_v; ++d) orow[d] = gpu_testing::round_to(acc[d], c.dtype);
      }
    }
  }
  return result;
}

// ForwardArgs for data at `device`: q/out/lse/k/v pointers, the int arrays page_table,
// cu_seqlens_q, seqused_k, and the ALiBi slopes.
struct ArgPointers {
  void *q, *k, *v, *out, *lse, *page_table, *cu_seqlens_q, *seqused_k, *slopes, *doc_ids;
};

ForwardArgs make_args(const Problem& pb, DType dtype, Device device, const ArgPointers& ptr) {
  const PagedCase& c = pb.c;
  const std::int64_t B = c.batch, H = c.heads, Hkv = c.heads_kv;
  ForwardArgs args;
  if (c.packed_q) {
    args.q = TensorView(ptr.q, dtype, {pb.rows_q, H, c.head_dim}, device);
    args.out = TensorView(ptr.out, dtype, {pb.rows_q, H, c.head_dim_v}, device);
    args.lse = TensorView(ptr.lse, DType::kFloat32, {H, pb.rows_q}, device);
    args.seq.cu_seqlens_q = TensorView(ptr.cu_seqlens_q, DType::kInt32, {B + 1}, device);
    args.seq.max_seqlen_q = *std::max_element(pb.len_q.begin(), pb.len_q.end());
  } else {
    args.q = TensorView(ptr.q, dtype, {B, c.seqlen_q, H, c.head_dim}, device);
    args.out = TensorView(ptr.out, dtype, {B, c.seqlen_q, H, c.head_dim_v}, device);
    args.lse = TensorView(ptr.lse, DType::kFloat32, {B, H, c.seqlen_q}, device);
  }
  args.k = TensorView(ptr.k, dtype, {pb.num_pages, c.page_size, Hkv, c.head_dim}, device);
  args.v = TensorView(ptr.v, dtype, {pb.num_pages, c.page_size, Hkv, c.head_dim_v}, device);
  args.seq.page_table = TensorView(ptr.page_table, DType::kInt32, {B, c.max_pages}, device);
  if (c.seqused) args.seq.seqused_k = TensorView(ptr.seqused_k, DType::kInt32, {B}, device);
  gpu_testing::set_window_options(args.opts, c);
  args.opts.score_mod.kind = c.score_mod;
  if (c.score_mod == ScoreModKind::kAlibi)
    args.opts.score_mod.aux = {TensorView(ptr.slopes, DType::kFloat32, {H}, device)};
  args.opts.mask_mod.kind = c.mask_mod;
  args.opts.mask_mod.scalars = c.mask_scalars;
  if (c.mask_mod == MaskModKind::kDocument)
    args.opts.mask_mod.aux = {TensorView(ptr.doc_ids, DType::kInt32, {B, pb.doc_len}, device)};
  return args;
}

Result run_reference(const Problem& pb) {
  std::vector<float> q = pb.q, k = pb.k, v = pb.v;
  std::vector<float> out(std::size_t(pb.rows_q) * pb.c.heads * pb.c.head_dim_v, std::nanf(""));
  std::vector<float> lse(pb.lse_size(), std::nanf(""));
  std::vector<int> page_table = pb.page_table, cu_q = pb.cu_seqlens_q(), used_k = pb.used_k;
  std::vector<float> slopes = pb.slopes;
  std::vector<int> doc_ids = pb.doc_ids;
  forward(make_args(pb, DType::kFloat32, kCpu,
                    {q.data(), k.data(), v.data(), out.data(), lse.data(), page_table.data(),
                     cu_q.data(), used_k.data(), slopes.data(), doc_ids.data()}));
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

Result run_gpu(const Problem& pb) {
  const PagedCase& c = pb.c;
  DeviceBuffer q = to_device_16bit(pb.q, c.dtype), k = to_device_16bit(pb.k, c.dtype),
               v = to_device_16bit(pb.v, c.dtype);
  DeviceBuffer out =
      gpu_testing::poisoned_16bit(std::size_t(pb.rows_q) * c.heads * c.head_dim_v);
  DeviceBuffer lse = gpu_testing::poisoned_fp32(pb.lse_size());
  DeviceBuffer page_table = DeviceBuffer::from(pb.page_table);
  DeviceBuffer cu_q = DeviceBuffer::from(pb.cu_seqlens_q());
  DeviceBuffer used_k = DeviceBuffer::from(pb.used_k);
  DeviceBuffer slopes = DeviceBuffer::from(pb.slopes);
  DeviceBuffer doc_ids = DeviceBuffer::from(pb.doc_ids);
  ForwardArgs args = make_args(pb, c.dtype, kCuda,
                               {q.data(), k.data(), v.data(), out.data(), lse.data(), page_table.data(),
                                cu_q.data(), used_k.data(), slopes.data(), doc_ids.data()});
  args.num_splits = c.num_splits;
  args.pack_gqa = c.pack_gqa;
  std::optional<gpu_testing::ScopedEnv> zero_v_tail;
  // The default: seqused_k and page tables get the V tail zeroed.
  if (c.nan_tail) zero_v_tail.emplace("CUFLASH_FWD_ZERO_V_TAIL", "auto");
  forward(args);
  gpu_testing::check_cuda(cudaDeviceSynchronize(), "paged forward kernel");
  Result result;
  result.out = from_device_16bit(out, c.dtype);
  for (float x : lse.to_host<float>()) result.lse.push_back(x);
  return result;
}

class GpuForwardPaged : public ::testing::TestWithParam<PagedCase> {};

TEST_P(GpuForwardPaged, MatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const PagedCase& c = GetParam();
  const Problem pb(c);
  const std::optional<Result> gpu = gpu_testing::run_if_built([&] { return run_gpu(pb); });
  if (!gpu) return;
  const Result ref = run_reference(pb);
  const Result naive = naive_low_precision(pb);
  expect_output_close("out", gpu->out, naive.out, ref.out);
  expect_output_close("lse", gpu->lse, naive.lse, ref.lse);
}

std::vector<PagedCase> paged_cases() {
  std::vector<PagedCase> cases;
  unsigned seed = 1;
  auto add = [&](PagedCase c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  // Every page size on hdim 128: 1, 3, 16, 64 gather rows; 128 and 256 hold whole 128-row
  // n-blocks and go through TMA.
  for (int page_size : {1, 3, 16, 64, 128, 256}) {
    auto pages_for = [&](int keys) { return (keys + page_size - 1) / page_size; };
    PagedCase c;
    c = {};
    c.label = "dense_gqa", c.batch = 2, c.seqlen_q = 100, c.heads = 4, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(300);
    add(c);
    c = {};
    c.label = "causal_seqused", c.batch = 3, c.seqlen_q = 70, c.heads = 2, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(333), c.causal = true, c.seqused = true;
    add(c);
    c = {};
    c.label = "local_shared_pages", c.batch = 2, c.seqlen_q = 150, c.heads = 2, c.heads_kv = 1,
    c.page_size = page_size, c.max_pages = pages_for(520), c.window_left = 90, c.window_right = 10,
    c.shared_pages = true;
    add(c);
    c = {};
    c.label = "packed_q_causal", c.batch = 4, c.seqlen_q = 90, c.heads = 3, c.heads_kv = 3,
    c.page_size = page_size, c.max_pages = pages_for(260), c.causal = true, c.packed_q = true,
    c.seqused = true;
    add(c);
    // Decode: 1..8 new queries per sequence against a long cache, GQA 8.
    for (int sq : {1, 4, 8}) {
      c = {};
      c.label = "decode_sq" + std::to_string(sq), c.batch = 3, c.seqlen_q = sq, c.heads = 8,
      c.heads_kv = 1, c.page_size = page_size, c.max_pages = pages_for(1000), c.causal = true,
      c.seqused = true;
      add(c);
    }
    c = {};
    c.label = "decode_split3", c.batch = 2, c.seqlen_q = 2, c.heads = 8, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(1500), c.causal = true, c.seqused = true,
    c.num_splits = 3;
    add(c);
    c = {};
    c.label = "decode_split_auto", c.batch = 2, c.seqlen_q = 1, c.heads = 4, c.heads_kv = 1,
    c.page_size = page_size, c.max_pages = pages_for(2000), c.shared_pages = true, c.num_splits = 0;
    add(c);
    // Softcap (the softcap_paged and softcap_paged_split kernels).
    c = {};
    c.label = "softcap_causal_seqused_gqa", c.batch = 3, c.seqlen_q = 90, c.heads = 4, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(350), c.causal = true, c.seqused = true,
    c.softcap = 20.f;
    add(c);
    c = {};
    c.label = "softcap_decode_split3", c.batch = 2, c.seqlen_q = 1, c.heads = 8, c.heads_kv = 1,
    c.page_size = page_size, c.max_pages = pages_for(1500), c.seqused = true, c.shared_pages = true,
    c.num_splits = 3, c.softcap = 30.f;
    add(c);
    // Softcap with packed GQA over pages (softcap_paged_packgqa, softcap_paged_split_packgqa):
    // decoding a softcapped GQA model from a paged cache.
    c = {};
    c.label = "softcap_packgqa_decode", c.batch = 3, c.seqlen_q = 2, c.heads = 8, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(600), c.seqused = true, c.causal = true,
    c.softcap = 30.f, c.pack_gqa = true;
    add(c);
    c.label = "softcap_packgqa_decode_split3", c.num_splits = 3, c.max_pages = pages_for(1500);
    add(c);
  }
  // The other head dims (and fp16), when built: a gathered and a TMA page size for each
  // (whole n-blocks: 128 rows for d64, 160 for d96, 128 for d192x128, 112 for d192, 80 for d256;
  // the d64 softcap kernel's n-blocks are 192 rows, so its pages are gathered at both sizes).
  const struct {
    int d, dv, tma_page;
  } dims[] = {{64, 64, 128}, {96, 96, 160}, {192, 128, 128}, {192, 192, 112}, {256, 256, 80}};
  for (auto [d, dv, tma_page] : dims) {
    for (int page_size : {16, tma_page}) {
      PagedCase c;
      c.label = "causal_seqused_gqa", c.batch = 3, c.seqlen_q = 130, c.heads = 4, c.heads_kv = 2,
      c.head_dim = d, c.head_dim_v = dv, c.page_size = page_size,
      c.max_pages = (400 + page_size - 1) / page_size, c.causal = true, c.seqused = true;
      add(c);
      c.label = "decode_split_auto", c.seqlen_q = 3,
      c.max_pages = (1200 + page_size - 1) / page_size, c.num_splits = 0;
      add(c);
      c.label = "softcap_decode_split_auto", c.softcap = 25.f;
      add(c);
    }
  }
  for (int page_size : {3, 128}) {
    PagedCase c;
    c.label = "dense_fp16", c.dtype = DType::kFloat16, c.batch = 2, c.seqlen_q = 77, c.heads = 2,
    c.heads_kv = 1, c.page_size = page_size, c.max_pages = (400 + page_size - 1) / page_size,
    c.seqused = true;
    add(c);
  }
  // A head dim between the compiled ones (d80 runs on the d96 kernel, 160-row n-blocks): the
  // extra columns are zero-filled on both paths.
  for (int page_size : {16, 160}) {
    PagedCase c;
    c.label = "odd_head_dim", c.batch = 2, c.seqlen_q = 60, c.heads = 2, c.heads_kv = 2,
    c.head_dim = 80, c.head_dim_v = 80, c.page_size = page_size,
    c.max_pages = (300 + page_size - 1) / page_size, c.causal = true;
    add(c);
  }
  // Built-in mods (the flex_paged and flex_paged_split kernels): ALiBi with a sliding-window
  // mask_mod over shared pages, a prefix-LM mask with softcap and seqused, and ALiBi decode split
  // three ways; at every head dim (and fp16 at 128), with gathered pages and with pages of whole
  // flex n-blocks (128 keys, 64 at head dims 192 and 256), which go through TMA.
  const struct {
    int d, dv;
    DType dtype;
    std::vector<int> page_sizes;
  } mod_kernels[] = {{128, 128, DType::kBFloat16, {1, 3, 16, 128, 256}},
                     {128, 128, DType::kFloat16, {16, 128}},
                     {64, 64, DType::kBFloat16, {16, 128}},
                     {96, 96, DType::kBFloat16, {16, 128}},
                     {192, 128, DType::kBFloat16, {16, 128}},
                     {192, 192, DType::kBFloat16, {16, 64}},
                     {256, 256, DType::kBFloat16, {16, 64}}};
  for (const auto& kernel : mod_kernels) {
    for (int page_size : kernel.page_sizes) {
      auto pages_for = [&](int keys) { return (keys + page_size - 1) / page_size; };
      PagedCase c;
      c.label = "alibi_sliding_shared_pages", c.batch = 2, c.seqlen_q = 140, c.heads = 4,
      c.heads_kv = 2, c.page_size = page_size, c.max_pages = pages_for(400), c.shared_pages = true,
      c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kSlidingWindow,
      c.mask_scalars = {120, 20};
      c.head_dim = kernel.d, c.head_dim_v = kernel.dv, c.dtype = kernel.dtype;
      add(c);
      c = {};
      c.label = "prefix_lm_softcap_seqused", c.batch = 3, c.seqlen_q = 200, c.heads = 2,
      c.heads_kv = 2, c.page_size = page_size, c.max_pages = pages_for(260), c.seqused = true,
      c.softcap = 20.f, c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {50};
      c.head_dim = kernel.d, c.head_dim_v = kernel.dv, c.dtype = kernel.dtype;
      add(c);
      // Documents over the pages: the lists built from the ids count max_pages * page_size keys.
      c = {};
      c.label = "document_seqused_gqa", c.batch = 2, c.seqlen_q = 300, c.heads = 4, c.heads_kv = 2,
      c.page_size = page_size, c.max_pages = pages_for(700), c.seqused = true, c.mask_mod = MaskModKind::kDocument;
      c.head_dim = kernel.d, c.head_dim_v = kernel.dv, c.dtype = kernel.dtype;
      add(c);
      c = {};
      c.label = "alibi_decode_split3", c.batch = 2, c.seqlen_q = 2, c.heads = 8, c.heads_kv = 1,
      c.page_size = page_size, c.max_pages = pages_for(1500), c.seqused = true, c.causal = true,
      c.score_mod = ScoreModKind::kAlibi, c.num_splits = 3;
      c.head_dim = kernel.d, c.head_dim_v = kernel.dv, c.dtype = kernel.dtype;
      add(c);
    }
  }
  // Packed GQA with mods over pages (flex_paged_packgqa, flex_paged_split_packgqa): decoding
  // with ALiBi and a sliding window, a group of 3, split three ways; gathered pages and pages
  // of whole n-blocks, at head dims 64, 128 and 256.
  for (int d : {64, 128, 256}) {
    for (int page_size : {16, d == 128 ? 128 : 64}) {
      auto pages_for = [&](int keys) { return (keys + page_size - 1) / page_size; };
      PagedCase c;
      c.label = "packgqa_alibi_sliding_decode", c.batch = 3, c.seqlen_q = 4, c.heads = 8,
      c.heads_kv = 2, c.page_size = page_size, c.max_pages = pages_for(700), c.seqused = true,
      c.causal = true, c.score_mod = ScoreModKind::kAlibi,
      c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {300, 0}, c.pack_gqa = true;
      c.head_dim = c.head_dim_v = d;
      add(c);
      c = {};
      c.label = "packgqa_group3_prefix_lm_softcap_split3", c.batch = 2, c.seqlen_q = 50,
      c.heads = 6, c.heads_kv = 2, c.page_size = page_size, c.max_pages = pages_for(1200),
      c.seqused = true, c.shared_pages = true, c.softcap = 25.f,
      c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {400}, c.num_splits = 3,
      c.pack_gqa = true;
      c.head_dim = c.head_dim_v = d;
      add(c);
    }
  }
  // NaN in every pool row that holds no used key (a last page's unfilled tail, spare pages):
  // gathered pages (16) zero-fill them, whole pages (128, 256) go through TMA; plain, split
  // three ways and with ALiBi (flex_paged).
  for (int page_size : {16, 128, 256}) {
    auto pages_for = [&](int keys) { return (keys + page_size - 1) / page_size; };
    PagedCase c;
    c.label = "nan_tail_seqused", c.batch = 3, c.seqlen_q = 70, c.heads = 4, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(333), c.seqused = true, c.nan_tail = true;
    add(c);
    c.label = "nan_tail_seqused_split3", c.seqlen_q = 3, c.num_splits = 3, c.causal = true;
    add(c);
    // Three sequences: the first full, the second without keys, the third (219 / 277 / 369 keys
    // at pages 16 / 128 / 256) ending inside a key block, whose V rows past it hold NaN.
    c = {};
    c.label = "nan_tail_alibi", c.batch = 3, c.seqlen_q = 90, c.heads = 2, c.heads_kv = 2,
    c.page_size = page_size, c.max_pages = pages_for(300), c.seqused = true, c.nan_tail = true,
    c.score_mod = ScoreModKind::kAlibi;
    add(c);
    // The hdim256 flex kernel (its own register budget), packed GQA and split too.
    c.head_dim = c.head_dim_v = 256;
    add(c);
    c.label = "nan_tail_alibi_packgqa_split3", c.heads = 4, c.pack_gqa = true, c.num_splits = 3;
    add(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Pages, GpuForwardPaged, ::testing::ValuesIn(paged_cases()),
                         gpu_testing::CaseName());

}  // namespace
}  // namespace cuflash

#endif  // CUFLASH_HAS_CUDA
