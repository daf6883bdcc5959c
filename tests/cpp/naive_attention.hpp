// Test-only oracle for the reference implementation: a deliberately simple attention that
// builds the full score matrix of one sequence in double, with its own visibility predicate
// (written apart from src/reference/mask.cpp), plus the helpers the reference tests share:
// host tensors in any dtype and layout, random inputs, NaN poisoning, tolerant comparison,
// and AttentionCase, which builds every input of one attention call from a CaseConfig.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuflash/cuflash.hpp"
#include "reference/reference.hpp"

namespace cuflash::testing {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// 16-bit floats, converted arithmetically (not with the bit tricks of src/reference).

inline double half_to_double(std::uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? kNaN : kInf;
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return (bits & 0x8000) ? -magnitude : magnitude;
}

inline std::uint16_t double_to_half(double x) {
  if (std::isnan(x)) return 0x7e00;
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) {
    return sign | static_cast<std::uint16_t>(std::nearbyint(a * std::ldexp(1.0, 24)));
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e with f in [0.5, 1)
  int exponent = e - 1;
  double mantissa = std::nearbyint((std::ldexp(a, -exponent) - 1.0) * 1024.0);
  if (mantissa == 1024.0) {
    mantissa = 0.0;
    ++exponent;
  }
  return sign | static_cast<std::uint16_t>(((exponent + 15) << 10) | static_cast<int>(mantissa));
}

inline double bf16_to_double(std::uint16_t bits) {
  const std::uint32_t word = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

inline std::uint16_t double_to_bf16(double x) {
  const float f = static_cast<float>(x);
  if (std::isnan(f)) return 0x7fc0;
  std::uint32_t word;
  std::memcpy(&word, &f, sizeof(word));
  std::uint32_t upper = word >> 16;
  const std::uint32_t lower = word & 0xffff;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) ++upper;
  return static_cast<std::uint16_t>(upper);
}

// ---------------------------------------------------------------------------------------------
// Host tensors.

enum class Layout {
  kContiguous,
  // Padded in every dim and stored heads-outermost; last dim contiguous (what the API accepts).
  kStrided,
  // kStrided with a last-dim stride of 2 (the CPU reference accepts it).
  kStridedLastDim,
};

using Index = std::vector<std::int64_t>;

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Index shape, Layout layout = Layout::kContiguous)
      : dtype_(dtype), shape_(std::move(shape)), stride_(shape_.size()) {
    const int ndim = static_cast<int>(shape_.size());
    std::vector<int> order(ndim);  // outermost first
    std::iota(order.begin(), order.end(), 0);
    if (layout != Layout::kContiguous && ndim >= 3) {
      order.clear();
      order.push_back(ndim - 2);
      for (int d = 0; d < ndim - 2; ++d) order.push_back(d);
      order.push_back(ndim - 1);
    }
    const std::int64_t pad = layout == Layout::kContiguous ? 0 : 1;
    std::int64_t running = layout == Layout::kStridedLastDim ? 2 : 1;
    for (int o = ndim - 1; o >= 0; --o) {
      stride_[order[o]] = running;
      running *= shape_[order[o]] + pad;
    }
    storage_size_ = std::max<std::int64_t>(running, 1);
    words_.assign((storage_size_ * dtype_size(dtype) + 3) / 4, 0);
  }

  TensorView view() const {
    TensorView t;
    t.data = const_cast<std::uint32_t*>(words_.data());
    t.dtype = dtype_;
    t.ndim = static_cast<int>(shape_.size());
    for (int d = 0; d < t.ndim; ++d) {
      t.shape[d] = shape_[d];
      t.stride[d] = stride_[d];
    }
    return t;
  }

  DType dtype() const { return dtype_; }
  const Index& shape() const { return shape_; }
  std::int64_t storage_size() const { return storage_size_; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t s : shape_) n *= s;
    return n;
  }

  std::int64_t offset(const Index& index) const {
    std::int64_t result = 0;
    for (std::size_t d = 0; d < index.size(); ++d) result += index[d] * stride_[d];
    return result;
  }

  double load(std::int64_t offset) const {
    const void* base = words_.data();
    switch (dtype_) {
      case DType::kFloat16:
        return half_to_double(static_cast<const std::uint16_t*>(base)[offset]);
      case DType::kBFloat16:
        return bf16_to_double(static_cast<const std::uint16_t*>(base)[offset]);
      case DType::kFloat32:
        return static_cast<const float*>(base)[offset];
      case DType::kInt32:
        return static_cast<const std::int32_t*>(base)[offset];
    }
    return kNaN;
  }

  void store(std::int64_t offset, double value) {
    void* base = words_.data();
    switch (dtype_) {
      case DType::kFloat16:
        static_cast<std::uint16_t*>(base)[offset] = double_to_half(value);
        break;
      case DType::kBFloat16:
        static_cast<std::uint16_t*>(base)[offset] = double_to_bf16(value);
        break;
      case DType::kFloat32:
        static_cast<float*>(base)[offset] = static_cast<float>(value);
        break;
      case DType::kInt32:
        static_cast<std::int32_t*>(base)[offset] = static_cast<std::int32_t>(value);
        break;
    }
  }

  double at(const Index& index) const { return load(offset(index)); }
  void set(const Index& index, double value) { store(offset(index), value); }

  // Calls fn(index) for every logical element, last dim fastest.
  void for_each(const std::function<void(const Index&)>& fn) const {
    if (numel() == 0) return;
    Index index(shape_.size(), 0);
    while (true) {
      fn(index);
      int d = static_cast<int>(shape_.size()) - 1;
      for (; d >= 0; --d) {
        if (++index[d] < shape_[d]) break;
        index[d] = 0;
      }
      if (d < 0) return;
    }
  }

  // Every storage element, padding included, becomes NaN (int32: a large negative id).
  void poison() {
    for (std::int64_t i = 0; i < storage_size_; ++i)
      store(i, dtype_ == DType::kInt32 ? -77777 : kNaN);
  }

  void fill_normal(std::mt19937& rng, double mean = 0.0, double stddev = 1.0) {
    std::normal_distribution<double> dist(mean, stddev);
    for_each([&](const Index& index) { set(index, dist(rng)); });
  }

  // Storage elements that belong to no logical element are still NaN.
  bool padding_poisoned() const {
    std::vector<bool> logical(storage_size_, false);
    for_each([&](const Index& index) { logical[offset(index)] = true; });
    for (std::int64_t i = 0; i < storage_size_; ++i) {
      if (!logical[i] && !std::isnan(load(i))) return false;
    }
    return true;
  }

 private:
  DType dtype_ = DType::kFloat32;
  Index shape_;
  Index stride_;
  std::int64_t storage_size_ = 0;
  std::vector<std::uint32_t> words_;  // 4-byte words keep fp32 / int32 data aligned
};

inline HostTensor int_tensor(const Index& shape, const std::vector<int>& values) {
  HostTensor t(DType::kInt32, shape);
  for (std::size_t i = 0; i < values.size(); ++i) t.store(static_cast<std::int64_t>(i), values[i]);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Comparison.

struct Tolerance {
  double atol;
  double rtol;
};

// The reference accumulates in double, so its only error is the final rounding to the dtype.
inline Tolerance dtype_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return {1e-6, std::ldexp(1.0, -10)};
    case DType::kBFloat16:
      return {1e-6, std::ldexp(1.0, -7)};
    default:
      return {1e-6, 2e-6};
  }
}
constexpr Tolerance kLseTolerance{1e-6, 2e-6};

// Collects mismatches of many elements into one assertion.
class Comparison {
 public:
  explicit Comparison(std::string name) : name_(std::move(name)) {}

  // expected NaN means "must be left untouched" (the output was poisoned with NaN);
  // an infinite expected value must match exactly.
  void expect(double actual, double expected, Tolerance tol, const std::string& where) {
    ++checked_;
    bool ok;
    if (std::isnan(expected)) {
      ok = std::isnan(actual);
    } else if (std::isinf(expected) || std::isinf(actual)) {
      ok = actual == expected;
    } else {
      const double error = std::fabs(actual - expected);
      ok = !std::isnan(actual) && error <= tol.atol + tol.rtol * std::fabs(expected);
      if (!std::isnan(actual)) max_error_ = std::max(max_error_, error);
    }
    if (!ok) {
      if (failures_ < 8) {
        messages_ << "\n  " << name_ << where << ": got " << actual << ", expected " << expected;
      }
      ++failures_;
    }
  }

  ::testing::AssertionResult result() const {
    if (checked_ == 0) return ::testing::AssertionFailure() << name_ << ": nothing was compared";
    if (failures_ == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << name_ << ": " << failures_ << " of " << checked_ << " elements differ (max error "
           << max_error_ << ")" << messages_.str();
  }

  std::int64_t checked() const { return checked_; }

 private:
  std::string name_;
  std::int64_t checked_ = 0;
  std::int64_t failures_ = 0;
  double max_error_ = 0.0;
  std::ostringstream messages_;
};

inline std::string index_string(const Index& index) {
  std::ostringstream os;
  os << "[";
  for (std::size_t d = 0; d < index.size(); ++d) os << (d ? ", " : "") << index[d];
  os << "]";
  return os.str();
}

// Compares every logical element of `actual` with `expected`, which is indexed by storage
// offset (NaN: must be untouched), and checks that the padding of `actual` is untouched.
inline ::testing::AssertionResult compare_tensor(const std::string& name, const HostTensor& actual,
                                                 const std::vector<double>& expected,
                                                 Tolerance tol) {
  Comparison cmp(name);
  actual.for_each([&](const Index& index) {
    const std::int64_t offset = actual.offset(index);
    cmp.expect(actual.load(offset), expected[offset], tol, index_string(index));
  });
  if (!actual.padding_poisoned()) {
    return ::testing::AssertionFailure() << name << ": padding between elements was written";
  }
  return cmp.result();
}

// ---------------------------------------------------------------------------------------------
// The naive oracle.

struct NaiveSpec {
  int heads = 1, heads_kv = 1, head_dim = 1, head_dim_v = 1;
  double scale = 1.0;
  bool causal = false;
  int window_left = -1, window_right = -1;  // negative: unbounded
  double softcap = 0.0;
  ScoreModKind score_mod = ScoreModKind::kNone;
  std::vector<double> alibi_slopes;                // [h]
  std::vector<std::vector<double>> relative_bias;  // [h][2R + 1]
  MaskModKind mask_mod = MaskModKind::kNone;
  std::vector<double> mask_scalars;
  std::vector<std::vector<int>> documents;  // [b][position]
  std::vector<double> sink;                 // [h]; empty: no sink
  // Block sparsity (unset: off). block_state(b, h, row block, column block): 0 skipped,
  // 1 visible where the mask_mod keeps it, 2 visible.
  std::function<int(int, int, std::int64_t, std::int64_t)> block_state;
  int block_m = 128, block_n = 128;
};

// One sequence, row-major [position][head][dim].
struct NaiveSequence {
  int seqlen_q = 0, seqlen_k = 0;
  std::vector<double> q, k, v;
  std::vector<double> out, dout;  // backward: the forward output under test and its gradient
  std::vector<double> dlse;       // [h * seqlen_q + i], the gradient of lse; empty: none
};

inline bool naive_visible(const NaiveSpec& spec, int b, int h, std::int64_t i, std::int64_t j,
                          std::int64_t seqlen_q, std::int64_t seqlen_k) {
  // Causal and window count from the bottom-right corner: query i sits at key position
  // i + (seqlen_k - seqlen_q).
  const std::int64_t aligned_i = i + (seqlen_k - seqlen_q);
  const std::int64_t ahead = j - aligned_i;  // > 0: key lies in the query's future
  if (spec.causal && ahead > 0) return false;
  if (!spec.causal && spec.window_right >= 0 && ahead > spec.window_right) return false;
  if (spec.window_left >= 0 && -ahead > spec.window_left) return false;

  bool use_mask_mod = true;
  if (spec.block_state) {
    const int state = spec.block_state(b, h, i / spec.block_m, j / spec.block_n);
    if (state == 0) return false;
    use_mask_mod = state == 1;
  }
  if (!use_mask_mod) return true;
  switch (spec.mask_mod) {
    case MaskModKind::kNone:
      return true;
    case MaskModKind::kCausal:
      return !(j > i);
    case MaskModKind::kSlidingWindow: {
      const double left = spec.mask_scalars[0], right = spec.mask_scalars[1];
      if (left >= 0 && i - j > left) return false;
      if (right >= 0 && j - i > right) return false;
      return true;
    }
    case MaskModKind::kPrefixLM:
      return j < spec.mask_scalars[0] || j <= i;
    case MaskModKind::kDocument:
      return spec.documents[b][i] == spec.documents[b][j];
    case MaskModKind::kExpression:  // not modelled: expression programs are tested against
      break;                        // the built-ins they reproduce
  }
  return true;
}

// Final score from the dot product; *derivative: d score / d (scale * dot).
inline double naive_score(const NaiveSpec& spec, int h, std::int64_t i, std::int64_t j, double dot,
                          double* derivative) {
  double s = spec.scale * dot;
  *derivative = 1.0;
  if (spec.softcap > 0) {
    const double t = std::tanh(s / spec.softcap);
    s = spec.softcap * t;
    *derivative = 1.0 - t * t;
  }
  if (spec.score_mod == ScoreModKind::kAlibi) {
    s += spec.alibi_slopes[h] * static_cast<double>(j - i);
  } else if (spec.score_mod == ScoreModKind::kRelativeBias) {
    const std::vector<double>& table = spec.relative_bias[h];
    const std::int64_t radius = (static_cast<std::int64_t>(table.size()) - 1) / 2;
    s += table[std::max(-radius, std::min(radius, j - i)) + radius];
  }
  return s;
}

// Scores (hidden: -inf), derivatives and lse of head h of one sequence.
struct NaiveHead {
  std::vector<std::vector<double>> s, ds_draw;
  std::vector<double> lse;
};

inline NaiveHead naive_head(const NaiveSpec& spec, int b, int h, const NaiveSequence& seq) {
  const int kv = h / (spec.heads / spec.heads_kv);
  NaiveHead head;
  head.s.assign(seq.seqlen_q, std::vector<double>(seq.seqlen_k, -kInf));
  head.ds_draw.assign(seq.seqlen_q, std::vector<double>(seq.seqlen_k, 0.0));
  head.lse.assign(seq.seqlen_q, -kInf);
  for (int i = 0; i < seq.seqlen_q; ++i) {
    for (int j = 0; j < seq.seqlen_k; ++j) {
      if (!naive_visible(spec, b, h, i, j, seq.seqlen_q, seq.seqlen_k)) continue;
      double dot = 0.0;
      for (int d = 0; d < spec.head_dim; ++d) {
        dot += seq.q[(i * spec.heads + h) * spec.head_dim + d] *
               seq.k[(j * spec.heads_kv + kv) * spec.head_dim + d];
      }
      head.s[i][j] = naive_score(spec, h, i, j, dot, &head.ds_draw[i][j]);
    }
    std::vector<double> logits = head.s[i];
    if (!spec.sink.empty()) logits.push_back(spec.sink[h]);
    const double max = logits.empty() ? -kInf : *std::max_element(logits.begin(), logits.end());
    if (max == -kInf) continue;
    double sum = 0.0;
    for (double x : logits) sum += std::exp(x - max);
    head.lse[i] = max + std::log(sum);
  }
  return head;
}

struct NaiveForward {
  std::vector<double> out;  // [i][h][dv]
  std::vector<double> lse;  // [h][i]
};

inline NaiveForward naive_forward(const NaiveSpec& spec, int b, const NaiveSequence& seq) {
  NaiveForward result;
  result.out.assign(static_cast<std::size_t>(seq.seqlen_q) * spec.heads * spec.head_dim_v, 0.0);
  result.lse.assign(static_cast<std::size_t>(spec.heads) * seq.seqlen_q, -kInf);
  for (int h = 0; h < spec.heads; ++h) {
    const int kv = h / (spec.heads / spec.heads_kv);
    const NaiveHead head = naive_head(spec, b, h, seq);
    for (int i = 0; i < seq.seqlen_q; ++i) {
      result.lse[h * seq.seqlen_q + i] = head.lse[i];
      for (int j = 0; j < seq.seqlen_k; ++j) {
        if (head.s[i][j] == -kInf) continue;
        const double p = std::exp(head.s[i][j] - head.lse[i]);
        for (int d = 0; d < spec.head_dim_v; ++d) {
          result.out[(i * spec.heads + h) * spec.head_dim_v + d] +=
              p * seq.v[(j * spec.heads_kv + kv) * spec.head_dim_v + d];
        }
      }
    }
  }
  return result;
}

struct NaiveBackward {
  std::vector<double> dq, dk, dv;  // layouts of q, k, v
  std::vector<double> d_sink;      // [h]
};

inline NaiveBackward naive_backward(const NaiveSpec& spec, int b, const NaiveSequence& seq) {
  const int H = spec.heads, Hkv = spec.heads_kv, D = spec.head_dim, Dv = spec.head_dim_v;
  NaiveBackward result;
  result.dq.assign(seq.q.size(), 0.0);
  result.dk.assign(seq.k.size(), 0.0);
  result.dv.assign(seq.v.size(), 0.0);
  result.d_sink.assign(H, 0.0);
  for (int h = 0; h < H; ++h) {
    const int kv = h / (H / Hkv);
    const NaiveHead head = naive_head(spec, b, h, seq);
    for (int i = 0; i < seq.seqlen_q; ++i) {
      if (head.lse[i] == -kInf) continue;
      const double* dout = &seq.dout[(i * H + h) * Dv];
      const double* out = &seq.out[(i * H + h) * Dv];
      double delta = 0.0;
      for (int d = 0; d < Dv; ++d) delta += dout[d] * out[d];
      // d lse_i / d s_ij = p_ij and d lse_i / d sink = p_sink: dlse joins -delta.
      if (!seq.dlse.empty()) delta -= seq.dlse[h * seq.seqlen_q + i];
      if (!spec.sink.empty()) result.d_sink[h] -= std::exp(spec.sink[h] - head.lse[i]) * delta;
      for (int j = 0; j < seq.seqlen_k; ++j) {
        if (head.s[i][j] == -kInf) continue;
        const double p = std::exp(head.s[i][j] - head.lse[i]);
        double dp = 0.0;
        for (int d = 0; d < Dv; ++d) dp += dout[d] * seq.v[(j * Hkv + kv) * Dv + d];
        const double ds = p * (dp - delta) * head.ds_draw[i][j] * spec.scale;
        for (int d = 0; d < D; ++d) {
          result.dq[(i * H + h) * D + d] += ds * seq.k[(j * Hkv + kv) * D + d];
          result.dk[(j * Hkv + kv) * D + d] += ds * seq.q[(i * H + h) * D + d];
        }
        for (int d = 0; d < Dv; ++d) result.dv[(j * Hkv + kv) * Dv + d] += p * dout[d];
      }
    }
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// One attention call, built from a description.

// Which entry points the tests call. The public API validates first (and so rejects a
// non-contiguous last dim); the reference entry points take any strides.
enum class Entry { kPublic, kReference };

inline void call_forward(const ForwardArgs& args, Entry entry) {
  if (entry == Entry::kPublic) {
    cuflash::forward(args);
  } else {
    cuflash::reference::forward(args);
  }
}
inline void call_backward(const BackwardArgs& args, Entry entry) {
  if (entry == Entry::kPublic) {
    cuflash::backward(args);
  } else {
    cuflash::reference::backward(args);
  }
}
inline void call_combine(const CombineArgs& args, Entry entry) {
  if (entry == Entry::kPublic) {
    cuflash::combine(args);
  } else {
    cuflash::reference::combine(args);
  }
}

struct CaseConfig {
  DType dtype = DType::kFloat32;
  int batch = 2;
  int seqlen_q = 5, seqlen_k = 7;  // dense lengths; paged: seqlen_k sets max_pages
  int heads = 2, heads_kv = 2, head_dim = 8, head_dim_v = 8;
  std::vector<int> packed_q, packed_k;    // non-empty: packed layout with these lengths
  std::vector<int> seqused_q, seqused_k;  // non-empty: seqused
  int page_size = 0;                      // > 0: paged k / v
  bool share_pages = false;               // batch 1 reuses batch 0's first page
  Layout layout = Layout::kContiguous;    // of q, k, v, out, lse, dout and the gradients
  bool with_lse = true;
  bool with_dlse = false;  // backward: a random gradient of lse too (the loss adds sum(lse * dlse))
  std::optional<DType> sink_dtype;
  double sink_mean = 0.0;
  std::optional<float> softmax_scale;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  ScoreModKind score_mod = ScoreModKind::kNone;
  int relative_radius = 3;
  MaskModKind mask_mod = MaskModKind::kNone;
  std::vector<double> mask_scalars;
  bool block_sparse = false;
  int block_m = 4, block_n = 4;
  bool block_broadcast_heads = false;  // block lists with head dim 1
  bool block_full_lists = true, block_mask_lists = true, block_backward_lists = true;
  int num_splits = 1;
  std::optional<bool> pack_gqa;
  bool deterministic = false;
  Entry entry = Entry::kPublic;
  unsigned seed = 1;
};

// One line naming a configuration, for SCOPED_TRACE.
inline std::string describe(const CaseConfig& c) {
  std::ostringstream os;
  os << dtype_name(c.dtype) << " B=" << c.batch << " Sq=" << c.seqlen_q << " Sk=" << c.seqlen_k
     << " H=" << c.heads << "/" << c.heads_kv << " D=" << c.head_dim << "/" << c.head_dim_v
     << " causal=" << c.causal << " window=(" << c.window_left << ", " << c.window_right << ")"
     << " softcap=" << c.softcap << " splits=" << c.num_splits << " page=" << c.page_size
     << " seed=" << c.seed;
  return os.str();
}

class AttentionCase {
 public:
  explicit AttentionCase(const CaseConfig& cfg) : config(cfg), rng(cfg.seed) {
    build_sequences();
    build_inputs();
    build_options();
  }

  ForwardArgs forward_args() const {
    ForwardArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
    if (config.with_lse) args.lse = lse.view();
    if (config.sink_dtype) args.learnable_sink = sink.view();
    args.seq = layout();
    args.opts = options();
    args.num_splits = config.num_splits;
    args.pack_gqa = config.pack_gqa;
    return args;
  }

  BackwardArgs backward_args() const {
    BackwardArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
    args.dout = dout.view();
    args.lse = lse.view();
    if (config.with_dlse) args.dlse = dlse.view();
    args.dq = dq.view();
    args.dk = dk.view();
    args.dv = dv.view();
    if (config.sink_dtype) {
      args.learnable_sink = sink.view();
      args.d_sink = d_sink.view();
    }
    args.seq = layout();
    args.opts = options();
    args.deterministic = config.deterministic;
    return args;
  }

  void run_forward() {
    out.poison();
    lse.poison();
    call_forward(forward_args(), config.entry);
  }

  // Runs the forward pass (for out and lse) and then the backward pass on fresh dout.
  void run_backward() {
    run_forward();
    dout.poison();
    for (int b = 0; b < batch; ++b) {
      for (int i = 0; i < q_len[b]; ++i) {
        for (int h = 0; h < config.heads; ++h) {
          for (int d = 0; d < config.head_dim_v; ++d) dout.set(q_index(b, i, h, d), normal());
        }
      }
    }
    dlse.poison();  // rows past the sequences stay poisoned: no backward may read them
    if (config.with_dlse) {
      for (int b = 0; b < batch; ++b) {
        for (int i = 0; i < q_len[b]; ++i) {
          for (int h = 0; h < config.heads; ++h) dlse.set(lse_index(b, i, h), normal());
        }
      }
    }
    dq.poison();
    dk.poison();
    dv.poison();
    d_sink.poison();
    call_backward(backward_args(), config.entry);
  }

  // Sum of out * dout (and with dlse of lse * dlse, over rows with a visible key) over the rows
  // in use, in double: the loss whose gradient backward gives.
  double loss() const {
    double total = 0.0;
    for (int b = 0; b < batch; ++b) {
      for (int i = 0; i < q_len[b]; ++i) {
        for (int h = 0; h < config.heads; ++h) {
          for (int d = 0; d < config.head_dim_v; ++d) {
            const Index index = q_index(b, i, h, d);
            total += out.at(index) * dout.at(index);
          }
          if (config.with_dlse) {
            const double row_lse = lse.at(lse_index(b, i, h));
            if (row_lse != -kInf) total += row_lse * dlse.at(lse_index(b, i, h));
          }
        }
      }
    }
    return total;
  }

  // ---- token addressing (written apart from src/reference/sequence.cpp) ----
  Index q_index(int b, std::int64_t pos, std::int64_t h, std::int64_t d) const {
    if (packed_q()) return {q_start[b] + pos, h, d};
    return {b, pos, h, d};
  }
  Index k_index(int b, std::int64_t pos, std::int64_t h, std::int64_t d) const {
    if (paged()) return {pages[b][pos / config.page_size], pos % config.page_size, h, d};
    if (packed_k()) return {k_start[b] + pos, h, d};
    return {b, pos, h, d};
  }
  Index lse_index(int b, std::int64_t pos, std::int64_t h) const {
    if (packed_q()) return {h, q_start[b] + pos};
    return {b, h, pos};
  }
  bool packed_q() const { return !config.packed_q.empty(); }
  bool packed_k() const { return !config.packed_k.empty(); }
  bool paged() const { return config.page_size > 0; }

  NaiveSpec naive_spec() const {
    NaiveSpec spec;
    spec.heads = config.heads;
    spec.heads_kv = config.heads_kv;
    spec.head_dim = config.head_dim;
    spec.head_dim_v = config.head_dim_v;
    spec.scale = config.softmax_scale ? *config.softmax_scale : 1.0 / std::sqrt(config.head_dim);
    spec.causal = config.causal;
    spec.window_left = config.window_left;
    spec.window_right = config.window_right;
    spec.softcap = config.softcap;
    spec.score_mod = config.score_mod;
    for (int h = 0; h < config.heads; ++h) {
      if (config.score_mod == ScoreModKind::kAlibi) spec.alibi_slopes.push_back(score_aux.at({h}));
      if (config.score_mod == ScoreModKind::kRelativeBias) {
        spec.relative_bias.emplace_back();
        for (int r = 0; r < 2 * config.relative_radius + 1; ++r) {
          spec.relative_bias.back().push_back(score_aux.at({h, r}));
        }
      }
      if (config.sink_dtype) spec.sink.push_back(sink.at({h}));
    }
    spec.mask_mod = config.mask_mod;
    spec.mask_scalars = config.mask_scalars;
    if (config.mask_mod == MaskModKind::kDocument) {
      for (int b = 0; b < batch; ++b) {
        spec.documents.emplace_back();
        for (std::int64_t p = 0; p < documents.shape()[1]; ++p) {
          spec.documents.back().push_back(static_cast<int>(documents.at({b, p})));
        }
      }
    }
    if (config.block_sparse) {
      const std::vector<int> states = block_states;
      const int heads = block_heads, rows = row_blocks, cols = col_blocks;
      spec.block_state = [states, heads, rows, cols](int b, int h, std::int64_t m, std::int64_t n) {
        if (m >= rows || n >= cols) return 0;
        const int hb = heads == 1 ? 0 : h;
        return states[((static_cast<std::int64_t>(b) * heads + hb) * rows + m) * cols + n];
      };
      spec.block_m = config.block_m;
      spec.block_n = config.block_n;
    }
    return spec;
  }

  // Gathers sequence b from the physical tensors (with out / dout for the backward oracle).
  NaiveSequence naive_sequence(int b) const {
    NaiveSequence seq;
    seq.seqlen_q = q_len[b];
    seq.seqlen_k = k_len[b];
    const int H = config.heads, Hkv = config.heads_kv;
    for (int i = 0; i < seq.seqlen_q; ++i) {
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < config.head_dim; ++d) seq.q.push_back(q.at(q_index(b, i, h, d)));
        for (int d = 0; d < config.head_dim_v; ++d) {
          seq.out.push_back(out.at(q_index(b, i, h, d)));
          seq.dout.push_back(dout.at(q_index(b, i, h, d)));
        }
      }
    }
    if (config.with_dlse) {
      for (int h = 0; h < H; ++h) {
        for (int i = 0; i < seq.seqlen_q; ++i) seq.dlse.push_back(dlse.at(lse_index(b, i, h)));
      }
    }
    for (int j = 0; j < seq.seqlen_k; ++j) {
      for (int h = 0; h < Hkv; ++h) {
        for (int d = 0; d < config.head_dim; ++d) seq.k.push_back(k.at(k_index(b, j, h, d)));
        for (int d = 0; d < config.head_dim_v; ++d) seq.v.push_back(v.at(k_index(b, j, h, d)));
      }
    }
    return seq;
  }

  // Expected out and lse, indexed by storage offset (NaN where nothing may be written).
  void expected_forward(std::vector<double>& out_expected,
                        std::vector<double>& lse_expected) const {
    out_expected.assign(out.storage_size(), kNaN);
    lse_expected.assign(lse.storage_size(), kNaN);
    const NaiveSpec spec = naive_spec();
    for (int b = 0; b < batch; ++b) {
      const NaiveForward naive = naive_forward(spec, b, naive_sequence(b));
      for (int i = 0; i < q_capacity[b]; ++i) {
        const bool used = i < q_len[b];
        for (int h = 0; h < config.heads; ++h) {
          lse_expected[lse.offset(lse_index(b, i, h))] = used ? naive.lse[h * q_len[b] + i] : -kInf;
          for (int d = 0; d < config.head_dim_v; ++d) {
            out_expected[out.offset(q_index(b, i, h, d))] =
                used ? naive.out[(i * config.heads + h) * config.head_dim_v + d] : 0.0;
          }
        }
      }
    }
  }

  void check_forward(Tolerance out_tol, Tolerance lse_tol = kLseTolerance) const {
    std::vector<double> out_expected, lse_expected;
    expected_forward(out_expected, lse_expected);
    EXPECT_TRUE(compare_tensor("out", out, out_expected, out_tol));
    if (config.with_lse) {
      EXPECT_TRUE(compare_tensor("lse", lse, lse_expected, lse_tol));
    }
  }
  void check_forward() const { check_forward(dtype_tolerance(config.dtype)); }

  void check_backward(Tolerance tol, Tolerance sink_tol = {1e-6, 1e-5}) const {
    const NaiveSpec spec = naive_spec();
    std::vector<double> dq_expected(dq.storage_size(), kNaN);
    std::vector<double> dk_expected(dk.storage_size(), kNaN);
    std::vector<double> dv_expected(dv.storage_size(), kNaN);
    std::vector<double> d_sink_expected(config.heads, 0.0);
    // Every row of a dense or paged dk / dv is written; packed: the rows of the sequences.
    const auto clear_kv_row = [&](const Index& prefix) {
      for (int h = 0; h < config.heads_kv; ++h) {
        Index index = prefix;
        index.push_back(h);
        index.push_back(0);
        for (int d = 0; d < config.head_dim; ++d) {
          index.back() = d;
          dk_expected[dk.offset(index)] = 0.0;
        }
        for (int d = 0; d < config.head_dim_v; ++d) {
          index.back() = d;
          dv_expected[dv.offset(index)] = 0.0;
        }
      }
    };
    if (packed_k()) {
      for (int b = 0; b < batch; ++b) {
        for (int j = 0; j < k_capacity[b]; ++j) clear_kv_row({k_start[b] + j});
      }
    } else {
      for (std::int64_t r0 = 0; r0 < k.shape()[0]; ++r0) {
        for (std::int64_t r1 = 0; r1 < k.shape()[1]; ++r1) clear_kv_row({r0, r1});
      }
    }
    for (int b = 0; b < batch; ++b) {
      const NaiveBackward naive = naive_backward(spec, b, naive_sequence(b));
      for (int i = 0; i < q_capacity[b]; ++i) {
        for (int h = 0; h < config.heads; ++h) {
          for (int d = 0; d < config.head_dim; ++d) {
            dq_expected[dq.offset(q_index(b, i, h, d))] =
                i < q_len[b] ? naive.dq[(i * config.heads + h) * config.head_dim + d] : 0.0;
          }
        }
      }
      // += : sequences that share a page both contribute to it.
      for (int j = 0; j < k_len[b]; ++j) {
        for (int h = 0; h < config.heads_kv; ++h) {
          for (int d = 0; d < config.head_dim; ++d) {
            dk_expected[dk.offset(k_index(b, j, h, d))] +=
                naive.dk[(j * config.heads_kv + h) * config.head_dim + d];
          }
          for (int d = 0; d < config.head_dim_v; ++d) {
            dv_expected[dv.offset(k_index(b, j, h, d))] +=
                naive.dv[(j * config.heads_kv + h) * config.head_dim_v + d];
          }
        }
      }
      for (int h = 0; h < config.heads; ++h) d_sink_expected[h] += naive.d_sink[h];
    }
    EXPECT_TRUE(compare_tensor("dq", dq, dq_expected, tol));
    EXPECT_TRUE(compare_tensor("dk", dk, dk_expected, tol));
    EXPECT_TRUE(compare_tensor("dv", dv, dv_expected, tol));
    if (config.sink_dtype) {
      EXPECT_TRUE(compare_tensor("d_sink", d_sink, d_sink_expected, sink_tol));
    }
  }
  void check_backward() const { check_backward(dtype_tolerance(config.dtype)); }

  double normal() { return std::normal_distribution<double>(0.0, 1.0)(rng); }

  CaseConfig config;
  std::mt19937 rng;
  int batch = 0;
  std::vector<std::int64_t> q_start, k_start;
  std::vector<int> q_capacity, q_len, k_capacity, k_len;
  std::vector<std::vector<int>> pages;  // paged: page of each (b, page slot)
  HostTensor q, k, v, out, lse, dlse, dout, dq, dk, dv;
  HostTensor sink, d_sink, score_aux, documents;
  HostTensor cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table;
  HostTensor mask_cnt, mask_idx, full_cnt, full_idx, q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx;
  std::vector<int> block_states;  // (B, block_heads, row_blocks, col_blocks)
  int block_heads = 0, row_blocks = 0, col_blocks = 0;

 private:
  void build_sequences() {
    const CaseConfig& c = config;
    batch = packed_q() ? static_cast<int>(c.packed_q.size()) : c.batch;
    std::int64_t total_q = 0, total_k = 0;
    for (int b = 0; b < batch; ++b) {
      q_start.push_back(total_q);
      q_capacity.push_back(packed_q() ? c.packed_q[b] : c.seqlen_q);
      total_q += q_capacity[b];
      k_start.push_back(total_k);
      int k_cap = c.seqlen_k;
      if (packed_k()) k_cap = c.packed_k[b];
      if (paged()) k_cap = (c.seqlen_k + c.page_size - 1) / c.page_size * c.page_size;
      k_capacity.push_back(k_cap);
      total_k += k_cap;
      q_len.push_back(c.seqused_q.empty() ? q_capacity[b]
                                          : std::min(c.seqused_q[b], q_capacity[b]));
      k_len.push_back(c.seqused_k.empty() ? k_capacity[b]
                                          : std::min(c.seqused_k[b], k_capacity[b]));
    }
    // Packed tensors get two rows past the last sequence: they must stay untouched.
    const std::int64_t extra_rows = 2;
    Index q_rows = packed_q() ? Index{total_q + extra_rows} : Index{batch, c.seqlen_q};
    Index k_rows = packed_k() ? Index{total_k + extra_rows} : Index{batch, c.seqlen_k};
    if (paged()) {
      const int max_pages = k_capacity[0] / c.page_size;
      // One spare page that no sequence references; pages are handed out in shuffled order.
      const int num_pages = batch * max_pages + 1;
      std::vector<int> order(num_pages);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<int> table;
      for (int b = 0; b < batch; ++b) {
        pages.emplace_back(order.begin() + b * max_pages, order.begin() + (b + 1) * max_pages);
        if (c.share_pages && b == 1) pages[1][0] = pages[0][0];
        table.insert(table.end(), pages[b].begin(), pages[b].end());
      }
      page_table = int_tensor({batch, max_pages}, table);
      k_rows = {num_pages, c.page_size};
    }
    const auto with = [](Index rows, std::int64_t heads, std::int64_t dim) {
      rows.push_back(heads);
      rows.push_back(dim);
      return rows;
    };
    q = HostTensor(c.dtype, with(q_rows, c.heads, c.head_dim), c.layout);
    dq = HostTensor(c.dtype, with(q_rows, c.heads, c.head_dim), c.layout);
    out = HostTensor(c.dtype, with(q_rows, c.heads, c.head_dim_v), c.layout);
    dout = HostTensor(c.dtype, with(q_rows, c.heads, c.head_dim_v), c.layout);
    k = HostTensor(c.dtype, with(k_rows, c.heads_kv, c.head_dim), c.layout);
    dk = HostTensor(c.dtype, with(k_rows, c.heads_kv, c.head_dim), c.layout);
    v = HostTensor(c.dtype, with(k_rows, c.heads_kv, c.head_dim_v), c.layout);
    dv = HostTensor(c.dtype, with(k_rows, c.heads_kv, c.head_dim_v), c.layout);
    const Layout lse_layout =
        c.layout == Layout::kContiguous ? Layout::kContiguous : Layout::kStrided;
    lse = HostTensor(
        DType::kFloat32,
        packed_q() ? Index{c.heads, total_q + extra_rows} : Index{batch, c.heads, c.seqlen_q},
        lse_layout);
    dlse = HostTensor(DType::kFloat32, lse.shape(), lse_layout);
    d_sink = HostTensor(DType::kFloat32, {c.heads});

    std::vector<int> cu_q{0}, cu_k{0};
    for (int b = 0; b < batch; ++b) {
      cu_q.push_back(static_cast<int>(q_start[b] + q_capacity[b]));
      cu_k.push_back(static_cast<int>(k_start[b] + k_capacity[b]));
    }
    if (packed_q()) cu_seqlens_q = int_tensor({batch + 1}, cu_q);
    if (packed_k()) cu_seqlens_k = int_tensor({batch + 1}, cu_k);
    if (!c.seqused_q.empty()) seqused_q = int_tensor({batch}, c.seqused_q);
    if (!c.seqused_k.empty()) seqused_k = int_tensor({batch}, c.seqused_k);
  }

  void build_inputs() {
    const CaseConfig& c = config;
    // Elements outside the sequences in use are NaN: reading one would poison the result.
    q.poison();
    k.poison();
    v.poison();
    for (int b = 0; b < batch; ++b) {
      for (int i = 0; i < q_len[b]; ++i) {
        for (int h = 0; h < c.heads; ++h) {
          for (int d = 0; d < c.head_dim; ++d) q.set(q_index(b, i, h, d), normal());
        }
      }
      for (int j = 0; j < k_len[b]; ++j) {
        for (int h = 0; h < c.heads_kv; ++h) {
          for (int d = 0; d < c.head_dim; ++d) k.set(k_index(b, j, h, d), normal());
          for (int d = 0; d < c.head_dim_v; ++d) v.set(k_index(b, j, h, d), normal());
        }
      }
    }
    if (c.sink_dtype) {
      sink = HostTensor(*c.sink_dtype, {c.heads});
      sink.fill_normal(rng, c.sink_mean, 1.0);
    }
    if (c.score_mod == ScoreModKind::kAlibi) {
      score_aux = HostTensor(DType::kFloat32, {c.heads});
      std::uniform_real_distribution<double> slopes(0.05, 1.0);
      score_aux.for_each([&](const Index& index) { score_aux.set(index, slopes(rng)); });
    } else if (c.score_mod == ScoreModKind::kRelativeBias) {
      score_aux = HostTensor(DType::kFloat32, {c.heads, 2 * c.relative_radius + 1});
      score_aux.fill_normal(rng);
    }
    if (c.mask_mod == MaskModKind::kDocument) {
      const int length = std::max(*std::max_element(q_capacity.begin(), q_capacity.end()),
                                  *std::max_element(k_capacity.begin(), k_capacity.end())) +
                         1;
      std::vector<int> ids;
      std::bernoulli_distribution next_document(0.3);
      for (int b = 0; b < batch; ++b) {
        int id = 0;
        for (int p = 0; p < length; ++p) ids.push_back(id += next_document(rng) ? 1 : 0);
      }
      documents = int_tensor({batch, length}, ids);
    }
    if (c.block_sparse) build_block_lists();
  }

  void build_block_lists() {
    const CaseConfig& c = config;
    block_heads = c.block_broadcast_heads ? 1 : c.heads;
    row_blocks = (c.seqlen_q + c.block_m - 1) / c.block_m;
    col_blocks = (c.seqlen_k + c.block_n - 1) / c.block_n;
    std::discrete_distribution<int> state(
        {3.0, c.block_mask_lists ? 3.5 : 0.0, c.block_full_lists ? 3.5 : 0.0});
    block_states.resize(static_cast<std::size_t>(batch) * block_heads * row_blocks * col_blocks);
    for (int& s : block_states) s = state(rng);
    const auto state_at = [&](int b, int hb, int m, int n) {
      return block_states[((b * block_heads + hb) * row_blocks + m) * col_blocks + n];
    };
    // One list family: per outer block, the inner blocks in `wanted` state, shuffled; the
    // unused tail of each index row holds in-range block numbers, which must be ignored.
    const auto make_lists = [&](int wanted, bool by_column, HostTensor& cnt, HostTensor& idx) {
      const int outer = by_column ? col_blocks : row_blocks;
      const int inner = by_column ? row_blocks : col_blocks;
      cnt = HostTensor(DType::kInt32, {batch, block_heads, outer});
      idx = HostTensor(DType::kInt32, {batch, block_heads, outer, inner});
      std::uniform_int_distribution<int> any_block(0, inner - 1);
      for (int b = 0; b < batch; ++b) {
        for (int hb = 0; hb < block_heads; ++hb) {
          for (int o = 0; o < outer; ++o) {
            std::vector<int> listed;
            for (int in = 0; in < inner; ++in) {
              const int s = by_column ? state_at(b, hb, in, o) : state_at(b, hb, o, in);
              if (s == wanted) listed.push_back(in);
            }
            std::shuffle(listed.begin(), listed.end(), rng);
            cnt.set({b, hb, o}, static_cast<double>(listed.size()));
            for (int e = 0; e < inner; ++e) {
              idx.set({b, hb, o, e},
                      e < static_cast<int>(listed.size()) ? listed[e] : any_block(rng));
            }
          }
        }
      }
    };
    if (c.block_mask_lists) {
      make_lists(1, false, mask_cnt, mask_idx);
      make_lists(1, true, q_mask_cnt, q_mask_idx);
    }
    if (c.block_full_lists) {
      make_lists(2, false, full_cnt, full_idx);
      make_lists(2, true, q_full_cnt, q_full_idx);
    }
  }

  void build_options() {
    opts_.softmax_scale = config.softmax_scale;
    opts_.causal = config.causal;
    opts_.window_left = config.window_left;
    opts_.window_right = config.window_right;
    opts_.softcap = config.softcap;
    opts_.score_mod.kind = config.score_mod;
    if (config.score_mod != ScoreModKind::kNone) opts_.score_mod.aux = {score_aux.view()};
    opts_.mask_mod.kind = config.mask_mod;
    opts_.mask_mod.scalars = config.mask_scalars;
    if (config.mask_mod == MaskModKind::kDocument) opts_.mask_mod.aux = {documents.view()};
    if (config.block_sparse) {
      BlockSparseTensors bs;
      bs.block_m = config.block_m;
      bs.block_n = config.block_n;
      if (config.block_mask_lists) {
        bs.mask_block_cnt = mask_cnt.view();
        bs.mask_block_idx = mask_idx.view();
      }
      if (config.block_full_lists) {
        bs.full_block_cnt = full_cnt.view();
        bs.full_block_idx = full_idx.view();
      }
      if (config.block_backward_lists && config.block_mask_lists) {
        bs.q_mask_block_cnt = q_mask_cnt.view();
        bs.q_mask_block_idx = q_mask_idx.view();
      }
      if (config.block_backward_lists && config.block_full_lists) {
        bs.q_full_block_cnt = q_full_cnt.view();
        bs.q_full_block_idx = q_full_idx.view();
      }
      opts_.block_sparse = bs;
    }
  }

  SequenceLayout layout() const {
    SequenceLayout seq;
    if (packed_q()) seq.cu_seqlens_q = cu_seqlens_q.view();
    if (packed_k()) seq.cu_seqlens_k = cu_seqlens_k.view();
    if (!config.seqused_q.empty()) seq.seqused_q = seqused_q.view();
    if (!config.seqused_k.empty()) seq.seqused_k = seqused_k.view();
    if (paged()) seq.page_table = page_table.view();
    seq.max_seqlen_q = *std::max_element(q_capacity.begin(), q_capacity.end());
    seq.max_seqlen_k = *std::max_element(k_capacity.begin(), k_capacity.end());
    return seq;
  }

  AttentionOptions options() const { return opts_; }

  AttentionOptions opts_;
};

}  // namespace cuflash::testing
