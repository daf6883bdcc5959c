// The parts of a GPU test problem that the dense, varlen and flex tests lay out alike: random
// inputs, the rows each sequence owns, the views over them and the sequence arguments of a call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cuflash/cuflash.hpp"
#include "gpu_test_util.hpp"

namespace cuflash::gpu_testing {

// data = n normal draws rounded to the dtype. A problem fills all its tensors from one
// distribution: it keeps a spare draw between calls, so a fresh one per tensor would give other
// inputs for the same seed.
inline void fill_normal(std::vector<float>& data, std::size_t n, DType dtype,
                        std::normal_distribution<float>& normal, std::mt19937& rng) {
  data.resize(n);
  for (float& x : data) x = round_to(normal(rng), dtype);
}

// The causal / window / softcap options every case type carries under the same names.
template <class Case>
void set_window_options(AttentionOptions& opts, const Case& c) {
  opts.causal = c.causal;
  opts.window_left = c.window_left;
  opts.window_right = c.window_right;
  opts.softcap = c.softcap;
}

// Where a call reads the int32 sequence arrays (host vectors or device buffers).
struct SequencePointers {
  void* cu_q = nullptr;
  void* cu_k = nullptr;
  void* used_q = nullptr;
  void* used_k = nullptr;
};

// The rows of one problem: q, out, dout are (rows_q, H, D) and k, v (rows_k, H_kv, D), with
// rows = B * S for a dense call and the packed total for a varlen one.
struct RowLayout {
  int batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, heads_kv = 1;
  bool varlen = false;   // packed rows with cu_seqlens; lengths drawn up to seqlen_q / seqlen_k
  bool seqused = false;  // seqused_q / seqused_k cap each sequence below its length
  bool keyless_sequence = false;  // varlen: sequence 2 has no keys (every row fully masked)
  // seqused: even sequences hand the kernel their length plus this many rows, which it must cap
  // at the length (the reference sees the capped count).
  int seqused_past = 0;
  // varlen: max_seqlen_q / max_seqlen_k given with the device cu_seqlens. Without them the
  // longest sequence is not known on the host (the kernels walk their block lists).
  bool max_seqlen_hints = true;
  std::vector<int> len_q, len_k;    // rows each sequence owns
  std::vector<int> used_q, used_k;  // rows that take part (seqused caps)
  std::vector<int> given_q, given_k;  // seqused as handed to the kernel
  std::vector<int> start_q, start_k;
  int rows_q = 0, rows_k = 0;

  template <class Case>
  RowLayout(const Case& c, bool with_seqused, bool with_keyless_sequence)
      : batch(c.batch),
        seqlen_q(c.seqlen_q),
        seqlen_k(c.seqlen_k),
        heads(c.heads),
        heads_kv(c.heads_kv),
        varlen(c.varlen),
        seqused(with_seqused),
        keyless_sequence(with_keyless_sequence) {}

  // The first draws of a problem's rng. Varlen: sequence 0 is the longest one and sequence 1
  // has no queries, so both edges are always there.
  void draw_lengths(std::mt19937& rng) {
    std::uniform_int_distribution<int> any_q(0, seqlen_q), any_k(0, seqlen_k);
    for (int b = 0; b < batch; ++b) {
      int lq = varlen ? any_q(rng) : seqlen_q;
      int lk = varlen ? any_k(rng) : seqlen_k;
      if (varlen && b == 0) lq = seqlen_q, lk = seqlen_k;
      if (varlen && b == 1) lq = 0;
      if (varlen && keyless_sequence && b == 2) lk = 0;
      len_q.push_back(lq);
      len_k.push_back(lk);
      used_q.push_back(seqused ? std::uniform_int_distribution<int>(0, lq)(rng) : lq);
      used_k.push_back(seqused ? std::uniform_int_distribution<int>(0, lk)(rng) : lk);
      const bool past = seqused_past > 0 && b % 2 == 0;
      if (past) used_q.back() = lq, used_k.back() = lk;
      given_q.push_back(past ? lq + seqused_past : used_q.back());
      given_k.push_back(past ? lk + seqused_past : used_k.back());
      start_q.push_back(rows_q);
      start_k.push_back(rows_k);
      rows_q += lq;
      rows_k += lk;
    }
  }

  // NaN in the rows each sequence owns past its used ones (a cache's unfilled tail), in a
  // (rows, heads, dim) tensor over the query rows (`query`) or the key rows.
  void fill_unused_rows_with_nan(std::vector<float>& x, bool query, int heads_of_x, int dim) const {
    const std::vector<int>& len = query ? len_q : len_k;
    const std::vector<int>& used = query ? used_q : used_k;
    const std::vector<int>& start = query ? start_q : start_k;
    const std::size_t width = std::size_t(heads_of_x) * dim;
    for (int b = 0; b < batch; ++b) {
      for (int j = used[b]; j < len[b]; ++j) {
        std::fill_n(x.begin() + std::size_t(start[b] + j) * width, width, std::numeric_limits<float>::quiet_NaN());
      }
    }
  }

  std::int64_t outer_q() const { return varlen ? rows_q : batch; }
  std::int64_t outer_k() const { return varlen ? rows_k : batch; }
  // lse is dense (B, H, Sq) or packed (H, total_q).
  std::size_t lse_size() const {
    return varlen ? std::size_t(heads) * rows_q : std::size_t(batch) * heads * seqlen_q;
  }
  std::int64_t lse_index(int b, int h, int r) const {
    return varlen ? std::int64_t(h) * rows_q + start_q[b] + r
                  : (std::int64_t(b) * heads + h) * seqlen_q + r;
  }
  std::vector<int> cu_seqlens_q() const { return cu_seqlens(start_q, rows_q); }
  std::vector<int> cu_seqlens_k() const { return cu_seqlens(start_k, rows_k); }

  // (rows | batch, [seqlen,] heads, dim) over the query rows (q, out, dout and their gradients),
  // with `pad` unused elements after each head vector.
  TensorView query_view(void* data, DType dtype, int dim, Device device, int pad = 0) const {
    return view(data, dtype, outer_q(), seqlen_q, heads, dim, pad, device);
  }
  // The same over the key rows (k, v and their gradients).
  TensorView key_view(void* data, DType dtype, int dim, Device device, int pad = 0) const {
    return view(data, dtype, outer_k(), seqlen_k, heads_kv, dim, pad, device);
  }
  TensorView lse_view(void* data, Device device) const {
    if (varlen) return TensorView(data, DType::kFloat32, {heads, rows_q}, device);
    return TensorView(data, DType::kFloat32, {batch, heads, seqlen_q}, device);
  }

  // cu_seqlens and max_seqlen of a varlen call, seqused where the case caps the sequences.
  void set_sequences(SequenceLayout& seq, Device device, const SequencePointers& where) const {
    const std::int64_t B = batch;
    if (varlen) {
      seq.cu_seqlens_q = TensorView(where.cu_q, DType::kInt32, {B + 1}, device);
      seq.cu_seqlens_k = TensorView(where.cu_k, DType::kInt32, {B + 1}, device);
      if (max_seqlen_hints) {
        seq.max_seqlen_q = *std::max_element(len_q.begin(), len_q.end());
        seq.max_seqlen_k = *std::max_element(len_k.begin(), len_k.end());
      }
    }
    if (seqused) {
      seq.seqused_q = TensorView(where.used_q, DType::kInt32, {B}, device);
      seq.seqused_k = TensorView(where.used_k, DType::kInt32, {B}, device);
    }
  }

 private:
  static std::vector<int> cu_seqlens(const std::vector<int>& start, int total) {
    std::vector<int> cu = start;
    cu.push_back(total);
    return cu;
  }
  TensorView view(void* data, DType dtype, std::int64_t outer, std::int64_t seqlen,
                  std::int64_t view_heads, std::int64_t dim, std::int64_t pad,
                  Device device) const {
    const std::int64_t head_pitch = dim + pad, row_pitch = view_heads * head_pitch;
    if (varlen) {
      return TensorView(data, dtype, {outer, view_heads, dim}, {row_pitch, head_pitch, 1},
                        device);
    }
    return TensorView(data, dtype, {outer, seqlen, view_heads, dim},
                      {seqlen * row_pitch, row_pitch, head_pitch, 1}, device);
  }
};

// A varlen causal GQA case whose device seqused_q / seqused_k run 300 rows past every even
// sequence (the forward and backward lists both hold it).
template <class Case>
Case varlen_seqused_past_case() {
  Case c;
  c.label = "varlen_seqused_past_causal", c.batch = 4, c.seqlen_q = 190, c.seqlen_k = 260, c.heads = 2,
  c.heads_kv = 1, c.causal = true, c.varlen = true, c.seqused = true, c.seqused_past = 300;
  return c;
}

// Host copies of a layout's sequence arrays for a reference call (views need non-const data).
struct HostSequences {
  std::vector<int> cu_q, cu_k, used_q, used_k;
  explicit HostSequences(const RowLayout& rows)
      : cu_q(rows.cu_seqlens_q()),
        cu_k(rows.cu_seqlens_k()),
        used_q(rows.used_q),
        used_k(rows.used_k) {}
  SequencePointers pointers() { return {cu_q.data(), cu_k.data(), used_q.data(), used_k.data()}; }
};

// Device copies of a layout's sequence arrays for a kernel call (seqused as given, which may
// run past a sequence's rows: the kernels cap it).
struct DeviceSequences {
  DeviceBuffer cu_q, cu_k, used_q, used_k;
  explicit DeviceSequences(const RowLayout& rows)
      : cu_q(DeviceBuffer::from(rows.cu_seqlens_q())),
        cu_k(DeviceBuffer::from(rows.cu_seqlens_k())),
        used_q(DeviceBuffer::from(rows.given_q)),
        used_k(DeviceBuffer::from(rows.given_k)) {}
  SequencePointers pointers() const {
    return {cu_q.data(), cu_k.data(), used_q.data(), used_k.data()};
  }
};

}  // namespace cuflash::gpu_testing
