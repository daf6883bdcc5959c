// Argument validation for forward, backward and combine (DESIGN.md section 2). Every check
// runs before any work starts and names the argument, the expected and the actual value.
#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuflash/cuflash.hpp"

namespace cuflash {
namespace detail {
namespace {

using Shape = std::vector<std::int64_t>;

[[noreturn]] void fail(const std::string& argument, const std::string& message) {
  throw Error(Error::Kind::kInvalidArgument, argument, argument + ": " + message);
}

std::string shape_string(const Shape& shape) {
  std::ostringstream os;
  os << "(";
  for (std::size_t d = 0; d < shape.size(); ++d) os << (d ? ", " : "") << shape[d];
  if (shape.size() == 1) os << ",";
  os << ")";
  return os.str();
}

std::string stride_string(const TensorView& t) {
  std::ostringstream os;
  os << "(";
  for (int d = 0; d < t.ndim; ++d) os << (d ? ", " : "") << t.stride[d];
  if (t.ndim == 1) os << ",";
  os << ")";
  return os.str();
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// --- Per-tensor checks ------------------------------------------------------------------

// Structural sanity of a view before anything reads its shape.
void check_sane(const TensorView& t, const std::string& name) {
  if (t.ndim < 1 || t.ndim > kMaxDims) {
    fail(name, "expected 1 to " + std::to_string(kMaxDims) + " dimensions, got " +
                   std::to_string(t.ndim));
  }
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) fail(name, "expected non-negative sizes, got shape " + t.shape_string());
    if (t.shape[d] > std::numeric_limits<std::int32_t>::max()) {
      fail(name, "expected every size to fit in int32 (at most 2147483647), got shape " +
                     t.shape_string());
    }
    if (t.stride[d] < 0) fail(name, "expected non-negative strides, got " + stride_string(t));
  }
  // The element count and the last element's offset in int64, before anything multiplies them
  // (sizes fit in int32 each, their product need not).
  std::int64_t count = 1, reach = 0;
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) empty = empty || t.shape[d] == 0;
  for (int d = 0; d < t.ndim && !empty; ++d) {
    std::int64_t span = 0;
    if (__builtin_mul_overflow(count, t.shape[d], &count) ||
        __builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &span) || __builtin_add_overflow(reach, span, &reach)) {
      fail(name, "expected an element count and element offsets that fit in int64, got shape " +
                     t.shape_string() + " and strides " + stride_string(t));
    }
  }
  if (t.data == nullptr && t.numel() > 0) {
    fail(name, "expected a data pointer for " + std::to_string(t.numel()) + " elements, got null");
  }
}

void check_device(const TensorView& t, const std::string& name, const Device& device) {
  if (t.device != device) {
    fail(name, "expected device " + device_name(device) + " (the device of q), got " +
                   device_name(t.device));
  }
}

void check_dtype(const TensorView& t, const std::string& name, DType expected,
                 const std::string& why = "") {
  if (t.dtype != expected) {
    fail(name, std::string("expected dtype ") + dtype_name(expected) + (why.empty() ? "" : " ") +
                   why + ", got " + dtype_name(t.dtype));
  }
}

void check_ndim(const TensorView& t, const std::string& name, int ndim, const std::string& dims,
                const std::string& hint = "") {
  if (t.ndim != ndim) {
    fail(name, "expected " + std::to_string(ndim) + " dimensions " + dims + ", got " +
                   std::to_string(t.ndim) + " with shape " + t.shape_string() + hint);
  }
}

void check_shape(const TensorView& t, const std::string& name, const Shape& expected,
                 const std::string& dims) {
  bool same = t.ndim == static_cast<int>(expected.size());
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == expected[d];
  if (!same) {
    fail(name,
         "expected shape " + shape_string(expected) + " " + dims + ", got " + t.shape_string());
  }
}

void check_last_dim_contiguous(const TensorView& t, const std::string& name) {
  // An empty tensor has no element to read, whatever strides it reports (NumPy's DLPack export
  // gives them all as 0).
  if (t.numel() == 0) return;
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1) {
    fail(name, "expected the last dimension to be contiguous (stride 1), got strides " +
                   stride_string(t));
  }
}

void check_contiguous(const TensorView& t, const std::string& name) {
  if (!t.is_contiguous()) {
    fail(name, "expected a contiguous (row-major) tensor, got shape " + t.shape_string() +
                   " with strides " + stride_string(t));
  }
}

// An output whose strides map two of its elements to one address would have them written by
// racing threads on the GPU and overwritten on the CPU, silently. Sufficient rule: ordered by
// stride, every dimension of size > 1 starts at or past the span (size x stride) of the one
// before it, and none has stride 0. Size-1 dimensions hold no second element and are ignored.
void check_no_overlap(const TensorView& t, const std::string& name) {
  if (t.numel() == 0) return;
  std::vector<int> dims;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] > 1) dims.push_back(d);
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [&](int a, int b) { return t.stride[a] < t.stride[b]; });
  const std::string layout = "got shape " + t.shape_string() + " with strides " + stride_string(t);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const int d = dims[i];
    if (t.stride[d] == 0) {
      fail(name,
           "expected a non-zero stride on every dimension of size > 1 (an output's elements "
           "must not share memory), " +
               layout + ": dimension " + std::to_string(d) + " has size " +
               std::to_string(t.shape[d]) + " and stride 0");
    }
    if (i == 0) continue;
    const int inner = dims[i - 1];
    // stride[d] >= shape[inner] * stride[inner], in a form that cannot overflow.
    if (t.stride[d] / t.shape[inner] < t.stride[inner]) {
      fail(name,
           "expected strides under which distinct elements do not overlap (an output's "
           "elements must not share memory), " +
               layout + ": dimension " + std::to_string(d) + " (stride " +
               std::to_string(t.stride[d]) + ") starts inside the span of dimension " +
               std::to_string(inner) + " (size " + std::to_string(t.shape[inner]) + " x stride " +
               std::to_string(t.stride[inner]) + ")");
    }
  }
}

// An int32 vector of a given length, such as cu_seqlens or seqused.
void check_int_vector(const TensorView& t, const std::string& name, std::int64_t length,
                      const std::string& dims) {
  check_dtype(t, name, DType::kInt32);
  check_shape(t, name, {length}, dims);
  check_contiguous(t, name);
}

// cu_seqlens: int32, contiguous, (batch + 1,) with at least one entry; returns batch.
std::int64_t check_cu_seqlens(const TensorView& cu, const std::string& name) {
  check_dtype(cu, name, DType::kInt32);
  check_ndim(cu, name, 1, "(batch + 1,)");
  if (cu.shape[0] < 1) {
    fail(name, "expected shape (batch + 1,) with at least one entry, got " + cu.shape_string());
  }
  check_contiguous(cu, name);
  return cu.shape[0] - 1;
}

void check_head_dim(std::int64_t head_dim, const std::string& name, const std::string& what) {
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0) {
    fail(name, "expected " + what + " (last dimension) to be a multiple of 8 in [8, 256], got " +
                   std::to_string(head_dim));
  }
}

// Values of an int32 tensor that lives in host memory.
std::int32_t read_int(const TensorView& t, std::int64_t i0, std::int64_t i1 = 0,
                      std::int64_t i2 = 0, std::int64_t i3 = 0) {
  const std::int64_t index[4] = {i0, i1, i2, i3};
  std::int64_t offset = 0;
  for (int d = 0; d < t.ndim && d < 4; ++d) offset += index[d] * t.stride[d];
  return static_cast<const std::int32_t*>(t.data)[offset];
}

// cu_seqlens in host memory: batch + 1 non-decreasing offsets in [0, total].
void check_host_offsets(const TensorView& cu, const std::string& name, std::int64_t batch,
                        std::int64_t total, const std::string& total_name) {
  std::int64_t previous = 0;
  for (std::int64_t i = 0; i <= batch; ++i) {
    const std::int64_t value = read_int(cu, i);
    if (value < previous || value > total) {
      fail(name, "expected non-decreasing offsets in [0, " + total_name + " = " +
                     std::to_string(total) + "], got " + name + "[" + std::to_string(i) +
                     "] = " + std::to_string(value) +
                     (i > 0 ? " after " + std::to_string(previous) : std::string()));
    }
    previous = value;
  }
}

// --- Inputs shared by forward and backward ------------------------------------------------

struct DTypeRule {
  bool allow_fp32 = false;
  std::string text;
};

DTypeRule input_dtype_rule(const Device& device) {
  if (device.type == DeviceType::kCPU) return {true, "float16, bfloat16 or float32 (CPU tensors)"};
  return {false, "float16 or bfloat16 (CUDA tensors)"};
}

void check_input_dtype(const TensorView& q) {
  const DTypeRule rule = input_dtype_rule(q.device);
  const bool ok = q.dtype == DType::kFloat16 || q.dtype == DType::kBFloat16 ||
                  (rule.allow_fp32 && q.dtype == DType::kFloat32);
  if (!ok) fail("q", "expected dtype " + rule.text + ", got " + dtype_name(q.dtype));
}

void check_same_dtype(const TensorView& t, const std::string& name, DType dtype) {
  check_dtype(t, name, dtype, "(the dtype of q)");
}

// Lengths of each sequence, read from host memory; empty for device tensors.
struct HostLengths {
  bool known = false;
  std::vector<std::int64_t> q, k;  // per batch entry, after seqused
  // Per batch entry, the whole sequence (cu_seqlens segment, dense length, or max_pages *
  // page_size): what the max_seqlen hints stand for.
  std::vector<std::int64_t> q_rows, k_rows;
};

// q, k, v (dtypes, shapes), the sequence layout and their sizes.
AttentionShape check_qkv(const TensorView& q, const TensorView& k, const TensorView& v,
                         const SequenceLayout& seq) {
  check_input_dtype(q);
  check_same_dtype(k, "k", q.dtype);
  check_same_dtype(v, "v", q.dtype);

  AttentionShape s;
  s.device = q.device;
  s.dtype = q.dtype;
  s.varlen_q = seq.cu_seqlens_q.has_value();
  s.varlen_k = seq.cu_seqlens_k.has_value();
  s.paged = seq.page_table.has_value();

  // q decides batch, seqlen_q, num_heads and head_dim.
  if (s.varlen_q) {
    s.batch = check_cu_seqlens(*seq.cu_seqlens_q, "cu_seqlens_q");
    check_ndim(q, "q", 3, "(total_q, num_heads, head_dim) with cu_seqlens_q");
    s.total_q = q.shape[0];
  } else {
    check_ndim(q, "q", 4, "(batch, seqlen_q, num_heads, head_dim)",
               "; pass cu_seqlens_q for the packed (total_q, num_heads, head_dim) layout");
    s.batch = q.shape[0];
    s.seqlen_q = q.shape[1];
    s.total_q = s.batch * s.seqlen_q;
  }
  s.num_heads = q.size(-2);
  s.head_dim = q.size(-1);
  if (s.num_heads < 1) fail("q", "expected num_heads >= 1, got shape " + q.shape_string());
  check_head_dim(s.head_dim, "q", "head_dim");
  check_last_dim_contiguous(q, "q");

  // k and v: paged, packed or dense.
  if (s.paged) {
    if (s.varlen_k) {
      fail("page_table",
           "cannot be combined with cu_seqlens_k (paged k/v take per-sequence lengths from "
           "seqused_k)");
    }
    const TensorView& pt = *seq.page_table;
    check_dtype(pt, "page_table", DType::kInt32);
    check_ndim(pt, "page_table", 2, "(batch, max_pages)");
    check_shape(pt, "page_table", {s.batch, pt.shape[1]}, "(batch, max_pages)");
    check_last_dim_contiguous(pt, "page_table");
    s.max_pages = pt.shape[1];
    check_ndim(k, "k", 4, "(num_pages, page_size, num_heads_kv, head_dim) with page_table");
    s.num_pages = k.shape[0];
    s.page_size = k.shape[1];
    s.num_heads_kv = k.shape[2];
    check_shape(k, "k", {s.num_pages, s.page_size, s.num_heads_kv, s.head_dim},
                "(num_pages, page_size, num_heads_kv, head_dim)");
    if (s.page_size < 1) fail("k", "expected page_size >= 1, got shape " + k.shape_string());
    check_ndim(v, "v", 4, "(num_pages, page_size, num_heads_kv, head_dim_v) with page_table");
    s.head_dim_v = v.shape[3];
    check_shape(v, "v", {s.num_pages, s.page_size, s.num_heads_kv, s.head_dim_v},
                "(num_pages, page_size, num_heads_kv, head_dim_v)");
    s.seqlen_k = s.max_pages * s.page_size;
    s.total_k = s.num_pages * s.page_size;
  } else if (s.varlen_k) {
    const TensorView& cu = *seq.cu_seqlens_k;
    check_int_vector(cu, "cu_seqlens_k", s.batch + 1, "(batch + 1,)");
    check_ndim(k, "k", 3, "(total_k, num_heads_kv, head_dim) with cu_seqlens_k");
    s.total_k = k.shape[0];
    s.num_heads_kv = k.shape[1];
    check_shape(k, "k", {s.total_k, s.num_heads_kv, s.head_dim},
                "(total_k, num_heads_kv, head_dim)");
    check_ndim(v, "v", 3, "(total_k, num_heads_kv, head_dim_v) with cu_seqlens_k");
    s.head_dim_v = v.shape[2];
    check_shape(v, "v", {s.total_k, s.num_heads_kv, s.head_dim_v},
                "(total_k, num_heads_kv, head_dim_v)");
  } else {
    check_ndim(k, "k", 4, "(batch, seqlen_k, num_heads_kv, head_dim)",
               "; pass cu_seqlens_k for the packed (total_k, num_heads_kv, head_dim) layout");
    s.seqlen_k = k.shape[1];
    s.num_heads_kv = k.shape[2];
    check_shape(k, "k", {s.batch, s.seqlen_k, s.num_heads_kv, s.head_dim},
                "(batch, seqlen_k, num_heads_kv, head_dim)");
    check_ndim(v, "v", 4, "(batch, seqlen_k, num_heads_kv, head_dim_v)");
    s.head_dim_v = v.shape[3];
    check_shape(v, "v", {s.batch, s.seqlen_k, s.num_heads_kv, s.head_dim_v},
                "(batch, seqlen_k, num_heads_kv, head_dim_v)");
    s.total_k = s.batch * s.seqlen_k;
  }
  if (s.num_heads_kv < 1) fail("k", "expected num_heads_kv >= 1, got shape " + k.shape_string());
  if (s.num_heads % s.num_heads_kv != 0) {
    fail("k", "expected num_heads_kv to divide num_heads = " + std::to_string(s.num_heads) +
                  ", got num_heads_kv = " + std::to_string(s.num_heads_kv));
  }
  check_head_dim(s.head_dim_v, "v", "head_dim_v");
  // Kernel parameters count rows in int32.
  constexpr std::int64_t kMaxRows = std::numeric_limits<std::int32_t>::max();
  if (s.total_q > kMaxRows) {
    fail("q", "expected at most " + std::to_string(kMaxRows) + " rows in all, got " +
                  std::to_string(s.total_q) + " (shape " + q.shape_string() + ")");
  }
  if (s.total_k > kMaxRows || s.seqlen_k > kMaxRows) {
    fail("k", "expected at most " + std::to_string(kMaxRows) + " rows in all, got " +
                  std::to_string(std::max(s.total_k, s.seqlen_k)) + " (shape " + k.shape_string() +
                  ")");
  }
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");

  if (seq.seqused_q) check_int_vector(*seq.seqused_q, "seqused_q", s.batch, "(batch,)");
  if (seq.seqused_k) check_int_vector(*seq.seqused_k, "seqused_k", s.batch, "(batch,)");
  // The kernels take the hints as int32 lengths.
  auto check_length_hint = [&](const std::optional<std::int64_t>& hint, const std::string& name) {
    if (hint && (*hint < 0 || *hint > kMaxRows)) {
      fail(name, "expected a length in [0, " + std::to_string(kMaxRows) + "], got " +
                     std::to_string(*hint));
    }
  };
  check_length_hint(seq.max_seqlen_q, "max_seqlen_q");
  check_length_hint(seq.max_seqlen_k, "max_seqlen_k");
  return s;
}

// Index tensors in host memory: offsets, lengths and page numbers within their bounds (a
// device kernel cannot report these, the CPU reference would read out of bounds).
HostLengths check_host_sequences(const SequenceLayout& seq, const AttentionShape& s) {
  HostLengths lengths;
  if (s.device.type != DeviceType::kCPU) return lengths;
  lengths.known = true;

  if (s.varlen_q) {
    check_host_offsets(*seq.cu_seqlens_q, "cu_seqlens_q", s.batch, s.total_q, "total_q");
  }
  if (s.varlen_k) {
    check_host_offsets(*seq.cu_seqlens_k, "cu_seqlens_k", s.batch, s.total_k, "total_k");
  }

  // Rows of each sequence: its cu_seqlens segment, the dense length, or for paged k/v
  // max_pages * page_size. seqused caps them (it never reaches into the next sequence).
  auto used_rows = [](const std::optional<TensorView>& seqused, const std::string& name,
                      const std::string& side, std::int64_t b, std::int64_t capacity) {
    if (!seqused) return capacity;
    const std::int64_t used = read_int(*seqused, b);
    if (used < 0 || used > capacity) {
      fail(name, "expected " + name + "[" + std::to_string(b) + "] in [0, " +
                     std::to_string(capacity) + "] (rows of " + side + " for sequence " +
                     std::to_string(b) + "), got " + std::to_string(used));
    }
    return used;
  };
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t capacity_q =
        s.varlen_q ? read_int(*seq.cu_seqlens_q, b + 1) - read_int(*seq.cu_seqlens_q, b)
                   : s.seqlen_q;
    const std::int64_t capacity_k =
        s.varlen_k ? read_int(*seq.cu_seqlens_k, b + 1) - read_int(*seq.cu_seqlens_k, b)
                   : s.seqlen_k;
    const std::int64_t len_q = used_rows(seq.seqused_q, "seqused_q", "q", b, capacity_q);
    const std::int64_t len_k = used_rows(seq.seqused_k, "seqused_k", "k", b, capacity_k);
    if (s.paged) {
      const TensorView& pt = *seq.page_table;
      const std::int64_t used_pages = ceil_div(len_k, s.page_size);
      for (std::int64_t p = 0; p < used_pages; ++p) {
        const std::int64_t page = read_int(pt, b, p);
        if (page < 0 || page >= s.num_pages) {
          fail("page_table", "expected page_table[" + std::to_string(b) + ", " + std::to_string(p) +
                                 "] in [0, num_pages = " + std::to_string(s.num_pages) + "), got " +
                                 std::to_string(page));
        }
      }
    }
    lengths.q.push_back(len_q);
    lengths.k.push_back(len_k);
    lengths.q_rows.push_back(capacity_q);
    lengths.k_rows.push_back(capacity_k);
  }
  auto check_hint = [&](const std::optional<std::int64_t>& hint,
                        const std::vector<std::int64_t>& lens, const std::string& name,
                        const std::string& source) {
    if (!hint || lens.empty()) return;
    const std::int64_t longest = *std::max_element(lens.begin(), lens.end());
    if (*hint < longest) {
      fail(name, "expected at least " + std::to_string(longest) + " (the longest segment of " + source +
                     ", seqused or not: the kernels visit the rows the hint counts, and write every row "
                     "of a segment), got " + std::to_string(*hint));
    }
  };
  if (s.varlen_q) check_hint(seq.max_seqlen_q, lengths.q_rows, "max_seqlen_q", "cu_seqlens_q");
  if (s.varlen_k) check_hint(seq.max_seqlen_k, lengths.k_rows, "max_seqlen_k", "cu_seqlens_k");
  return lengths;
}

// Longest sequence lengths that are known exactly (dense sizes, max_seqlen_* hints, host
// memory); absent for packed or paged sequences in device memory without a hint.
struct KnownLengths {
  std::optional<std::int64_t> q, k;
};

// Fills seqlen_q / seqlen_k of packed layouts: the hint, the longest cu_seqlens segment from
// host memory (what a hint stands for, so that block lists are shaped alike with and without
// it, whatever seqused leaves of the sequences), or the bound total_q / total_k.
KnownLengths resolve_lengths(const SequenceLayout& seq, const HostLengths& lengths,
                             AttentionShape& s) {
  auto longest = [](const std::vector<std::int64_t>& lens) {
    return lens.empty() ? std::int64_t{0} : *std::max_element(lens.begin(), lens.end());
  };
  KnownLengths known;
  if (!s.varlen_q) {
    known.q = s.seqlen_q;
  } else if (seq.max_seqlen_q) {
    known.q = s.seqlen_q = *seq.max_seqlen_q;
  } else if (lengths.known) {
    known.q = s.seqlen_q = longest(lengths.q_rows);
  } else {
    s.seqlen_q = s.total_q;
    s.seqlen_q_is_bound = true;
  }
  if (s.varlen_k) {
    if (seq.max_seqlen_k) {
      known.k = s.seqlen_k = *seq.max_seqlen_k;
    } else if (lengths.known) {
      known.k = s.seqlen_k = longest(lengths.k_rows);
    } else {
      s.seqlen_k = s.total_k;
      s.seqlen_k_is_bound = true;
    }
  } else if (s.paged) {
    // seqlen_k stays max_pages * page_size, what the page table can address.
    if (lengths.known) {
      known.k = longest(lengths.k);
    } else if (seq.max_seqlen_k) {
      known.k = *seq.max_seqlen_k;
    } else if (!seq.seqused_k) {
      known.k = s.seqlen_k;
    }
  } else {
    known.k = s.seqlen_k;
  }
  return known;
}

void check_lse(const TensorView& lse, const std::string& name, const AttentionShape& s) {
  check_dtype(lse, name, DType::kFloat32);
  if (s.varlen_q) {
    check_shape(lse, name, {s.num_heads, s.total_q}, "(num_heads, total_q)");
  } else {
    check_shape(lse, name, {s.batch, s.num_heads, s.seqlen_q}, "(batch, num_heads, seqlen_q)");
  }
  check_last_dim_contiguous(lse, name);
}

void check_like_out(const TensorView& t, const std::string& name, const AttentionShape& s) {
  check_same_dtype(t, name, s.dtype);
  if (s.varlen_q) {
    check_shape(t, name, {s.total_q, s.num_heads, s.head_dim_v},
                "(total_q, num_heads, head_dim_v)");
  } else {
    check_shape(t, name, {s.batch, s.seqlen_q, s.num_heads, s.head_dim_v},
                "(batch, seqlen_q, num_heads, head_dim_v)");
  }
  check_last_dim_contiguous(t, name);
}

void check_sink(const TensorView& sink, const AttentionShape& s) {
  if (sink.dtype != DType::kFloat32 && sink.dtype != DType::kBFloat16 &&
      sink.dtype != DType::kFloat16) {
    fail("learnable_sink",
         std::string("expected dtype float32, bfloat16 or float16, got ") + dtype_name(sink.dtype));
  }
  check_shape(sink, "learnable_sink", {s.num_heads}, "(num_heads,)");
  check_contiguous(sink, "learnable_sink");
}

// --- Options ---------------------------------------------------------------------------------

bool is_whole(double value) { return std::isfinite(value) && value == std::floor(value); }

void check_scalar_count(const std::vector<double>& scalars, const std::string& name,
                        std::size_t expected, const std::string& kind) {
  if (scalars.size() != expected) {
    fail(name, "expected " + std::to_string(expected) + " scalar" + (expected == 1 ? "" : "s") +
                   " for " + kind + ", got " + std::to_string(scalars.size()));
  }
}

void check_aux_count(const std::vector<TensorView>& aux, const std::string& name,
                     std::size_t expected, const std::string& kind) {
  if (aux.size() != expected) {
    fail(name, "expected " + std::to_string(expected) + " aux tensor" + (expected == 1 ? "" : "s") +
                   " for " + kind + ", got " + std::to_string(aux.size()));
  }
}

void check_aux_tensor(const TensorView& t, const std::string& name, const Device& device) {
  check_sane(t, name);
  check_device(t, name, device);
  check_contiguous(t, name);
}

// An expression program (cuflash/expression.hpp): well formed, within the limits, well typed,
// its result of type `result_type` (and for a score_mod its derivative a float register).
enum class ExprType { kBool, kInt, kFloat };

const char* expr_type_name(ExprType t) {
  return t == ExprType::kBool ? "bool" : t == ExprType::kInt ? "int" : "float";
}

void check_expression(const ExprProgram& program, const std::vector<double>& scalars,
                      const std::vector<TensorView>& aux, const std::string& mod,
                      ExprType result_type, bool needs_grad, const Device& device) {
  const std::string code_name = mod + ".program";
  if (program.code.empty() || program.code.size() % 4 != 0) {
    fail(code_name, "expected 4 int32 per instruction (at least one), got " +
                        std::to_string(program.code.size()) + " values");
  }
  const int num_ops = program.num_ops();
  if (num_ops > kMaxExprOps) {
    fail(code_name, "expected at most " + std::to_string(kMaxExprOps) + " instructions, got " +
                        std::to_string(num_ops));
  }
  if (scalars.size() > static_cast<std::size_t>(kMaxExprConstants)) {
    fail(mod + ".scalars", "expected at most " + std::to_string(kMaxExprConstants) +
                               " constants for an expression, got " +
                               std::to_string(scalars.size()));
  }
  if (aux.size() > static_cast<std::size_t>(kMaxExprAux)) {
    fail(mod + ".aux", "expected at most " + std::to_string(kMaxExprAux) +
                           " aux tensors for an expression, got " + std::to_string(aux.size()));
  }
  for (std::size_t slot = 0; slot < aux.size(); ++slot) {
    const std::string name = mod + ".aux[" + std::to_string(slot) + "]";
    check_aux_tensor(aux[slot], name, device);
    if (aux[slot].ndim > kMaxExprAuxDims) {
      fail(name, "expected 1 to " + std::to_string(kMaxExprAuxDims) + " dimensions, got shape " +
                     aux[slot].shape_string());
    }
    if (aux[slot].dtype != DType::kFloat32 && aux[slot].dtype != DType::kInt32) {
      fail(name, std::string("expected dtype float32 or int32 (read by the expression), got ") +
                     dtype_name(aux[slot].dtype));
    }
  }
  std::vector<ExprType> types(num_ops);
  for (int i = 0; i < num_ops; ++i) {
    const std::int32_t* ins = program.code.data() + 4 * i;
    const std::string at = code_name + "[" + std::to_string(i) + "]";
    const ExprOp op = expr_opcode(ins[0]);
    auto reg = [&](int k) -> ExprType {
      const int r = op == ExprOp::kLoad ? expr_load_index(ins, k) : ins[1 + k];
      if (r < 0 || r >= i) {
        fail(at, "operand " + std::to_string(k) + " must name an earlier register, got " +
                     std::to_string(r));
      }
      return types[r];
    };
    auto numeric = [&](ExprType t) {
      if (t == ExprType::kBool) fail(at, "expected numeric operands, got bool");
      return t;
    };
    auto same = [&](ExprType a, ExprType b) {
      if (a != b) {
        fail(at, std::string("expected operands of one type, got ") + expr_type_name(a) + " and " +
                     expr_type_name(b));
      }
      return a;
    };
    auto expect = [&](ExprType t, ExprType wanted) {
      if (t != wanted) {
        fail(at, std::string("expected a ") + expr_type_name(wanted) + " operand, got " +
                     expr_type_name(t));
      }
      return t;
    };
    if (op != ExprOp::kLoad && (ins[0] >> 8) != 0) fail(at, "unknown opcode " + std::to_string(ins[0]));
    ExprType t = ExprType::kFloat;
    switch (op) {
      case ExprOp::kScore:
        if (!needs_grad) fail(at, "a mask_mod has no score");
        t = ExprType::kFloat;
        break;
      case ExprOp::kBatch:
      case ExprOp::kHead:
      case ExprOp::kQIdx:
      case ExprOp::kKvIdx:
      case ExprOp::kInt:
        t = ExprType::kInt;
        break;
      case ExprOp::kBool:
        if (ins[1] != 0 && ins[1] != 1) fail(at, "a bool constant must be 0 or 1");
        t = ExprType::kBool;
        break;
      case ExprOp::kFloat:
        if (ins[1] < 0 || static_cast<std::size_t>(ins[1]) >= scalars.size()) {
          fail(at, "constant index " + std::to_string(ins[1]) + " is out of range for " +
                       std::to_string(scalars.size()) + " scalars");
        }
        t = ExprType::kFloat;
        break;
      case ExprOp::kLoad: {
        const int slot = expr_load_slot(ins[0]);
        if ((ins[0] >> 24) != 0 || static_cast<std::size_t>(slot) >= aux.size()) {
          fail(at, "load from aux slot " + std::to_string(slot) + ", but " +
                       std::to_string(aux.size()) + " aux tensor(s) are given");
        }
        const int ndim = aux[slot].ndim;
        for (int k = 0; k < kMaxExprAuxDims; ++k) {
          if (k < ndim) {
            expect(reg(k), ExprType::kInt);
          } else if (expr_load_index(ins, k) != -1) {
            fail(at, "a load from a " + std::to_string(ndim) + "-D tensor takes " +
                         std::to_string(ndim) + " index register(s), the others -1");
          }
        }
        t = aux[slot].dtype == DType::kFloat32 ? ExprType::kFloat : ExprType::kInt;
        break;
      }
      case ExprOp::kAdd:
      case ExprOp::kSub:
      case ExprOp::kMul:
      case ExprOp::kMin:
      case ExprOp::kMax:
        t = same(numeric(reg(0)), numeric(reg(1)));
        break;
      case ExprOp::kDiv:
        expect(reg(0), ExprType::kFloat);
        t = expect(reg(1), ExprType::kFloat);
        break;
      case ExprOp::kFloorDiv:
      case ExprOp::kMod:
        expect(reg(0), ExprType::kInt);
        t = expect(reg(1), ExprType::kInt);
        break;
      case ExprOp::kNeg:
      case ExprOp::kAbs:
        t = numeric(reg(0));
        break;
      case ExprOp::kExp:
      case ExprOp::kExp2:
      case ExprOp::kLog:
      case ExprOp::kTanh:
      case ExprOp::kSigmoid:
      case ExprOp::kSqrt:
        t = expect(reg(0), ExprType::kFloat);
        break;
      case ExprOp::kToFloat:
        if (reg(0) == ExprType::kFloat) fail(at, "to_float takes an int or bool operand");
        t = ExprType::kFloat;
        break;
      case ExprOp::kToInt:
        expect(reg(0), ExprType::kBool);
        t = ExprType::kInt;
        break;
      case ExprOp::kLt:
      case ExprOp::kLe:
      case ExprOp::kGt:
      case ExprOp::kGe:
      case ExprOp::kEq:
      case ExprOp::kNe:
        same(numeric(reg(0)), numeric(reg(1)));
        t = ExprType::kBool;
        break;
      case ExprOp::kAnd:
      case ExprOp::kOr:
        expect(reg(0), ExprType::kBool);
        t = expect(reg(1), ExprType::kBool);
        break;
      case ExprOp::kNot:
        t = expect(reg(0), ExprType::kBool);
        break;
      case ExprOp::kWhere:
        expect(reg(0), ExprType::kBool);
        t = same(reg(1), reg(2));
        break;
      default:
        fail(at, "unknown opcode " + std::to_string(ins[0]));
    }
    types[i] = t;
  }
  auto check_register = [&](int r, const std::string& name, ExprType wanted) {
    if (r < 0 || r >= num_ops) {
      fail(mod + "." + name, "expected a register in [0, " + std::to_string(num_ops) + "), got " +
                                 std::to_string(r));
    }
    if (types[r] != wanted) {
      fail(mod + "." + name, std::string("expected a ") + expr_type_name(wanted) +
                                 " register, got a " + expr_type_name(types[r]) + " one");
    }
  };
  check_register(program.result, "program.result", result_type);
  if (needs_grad) check_register(program.grad, "program.grad", ExprType::kFloat);
}

void check_score_mod(const ScoreMod& mod, const AttentionShape& s) {
  if (mod.kind != ScoreModKind::kExpression && !mod.program.empty()) {
    fail("score_mod.program", "is only taken by the expression kind");
  }
  switch (mod.kind) {
    case ScoreModKind::kExpression:
      check_expression(mod.program, mod.scalars, mod.aux, "score_mod", ExprType::kFloat,
                       /*needs_grad=*/true, s.device);
      return;
    case ScoreModKind::kNone:
      check_scalar_count(mod.scalars, "score_mod.scalars", 0, "score_mod kind none");
      check_aux_count(mod.aux, "score_mod.aux", 0, "score_mod kind none");
      return;
    case ScoreModKind::kAlibi: {
      check_scalar_count(mod.scalars, "score_mod.scalars", 0, "alibi");
      check_aux_count(mod.aux, "score_mod.aux", 1, "alibi (slopes)");
      const TensorView& slopes = mod.aux[0];
      check_aux_tensor(slopes, "score_mod.aux[0]", s.device);
      check_dtype(slopes, "score_mod.aux[0]", DType::kFloat32, "(alibi slopes)");
      check_shape(slopes, "score_mod.aux[0]", {s.num_heads}, "(num_heads,)");
      return;
    }
    case ScoreModKind::kRelativeBias: {
      check_scalar_count(mod.scalars, "score_mod.scalars", 0, "relative_bias");
      check_aux_count(mod.aux, "score_mod.aux", 1, "relative_bias (bias table)");
      const TensorView& table = mod.aux[0];
      check_aux_tensor(table, "score_mod.aux[0]", s.device);
      check_dtype(table, "score_mod.aux[0]", DType::kFloat32, "(relative bias table)");
      check_ndim(table, "score_mod.aux[0]", 2, "(num_heads, 2 * max_distance + 1)");
      if (table.shape[0] != s.num_heads || table.shape[1] % 2 != 1) {
        fail("score_mod.aux[0]", "expected shape (" + std::to_string(s.num_heads) +
                                     ", 2 * max_distance + 1) (num_heads, an odd width), got " +
                                     table.shape_string());
      }
      return;
    }
  }
  fail("score_mod.kind",
       "expected none, alibi, relative_bias or expression, got " + std::to_string(static_cast<int>(mod.kind)));
}

void check_mask_mod(const MaskMod& mod, const AttentionShape& s, const KnownLengths& known) {
  auto check_window_scalars = [&](const std::string& kind) {
    for (std::size_t i = 0; i < mod.scalars.size(); ++i) {
      const double value = mod.scalars[i];
      if (!is_whole(value) || value < 0 || value > std::numeric_limits<std::int32_t>::max()) {
        std::ostringstream os;
        os << "expected a whole number >= 0 for " << kind << ", got " << value;
        fail("mask_mod.scalars[" + std::to_string(i) + "]", os.str());
      }
    }
  };
  if (mod.kind != MaskModKind::kExpression && !mod.program.empty()) {
    fail("mask_mod.program", "is only taken by the expression kind");
  }
  switch (mod.kind) {
    case MaskModKind::kExpression:
      check_expression(mod.program, mod.scalars, mod.aux, "mask_mod", ExprType::kBool,
                       /*needs_grad=*/false, s.device);
      return;
    case MaskModKind::kNone:
      check_scalar_count(mod.scalars, "mask_mod.scalars", 0, "mask_mod kind none");
      check_aux_count(mod.aux, "mask_mod.aux", 0, "mask_mod kind none");
      return;
    case MaskModKind::kCausal:
      check_scalar_count(mod.scalars, "mask_mod.scalars", 0, "causal");
      check_aux_count(mod.aux, "mask_mod.aux", 0, "causal");
      return;
    case MaskModKind::kSlidingWindow:
      check_scalar_count(mod.scalars, "mask_mod.scalars", 2, "sliding_window (left, right)");
      check_aux_count(mod.aux, "mask_mod.aux", 0, "sliding_window");
      check_window_scalars("sliding_window");
      return;
    case MaskModKind::kPrefixLM:
      check_scalar_count(mod.scalars, "mask_mod.scalars", 1, "prefix_lm (prefix length)");
      check_aux_count(mod.aux, "mask_mod.aux", 0, "prefix_lm");
      check_window_scalars("prefix_lm");
      return;
    case MaskModKind::kDocument: {
      check_scalar_count(mod.scalars, "mask_mod.scalars", 0, "document");
      check_aux_count(mod.aux, "mask_mod.aux", 1, "document (document ids)");
      const TensorView& doc = mod.aux[0];
      check_aux_tensor(doc, "mask_mod.aux[0]", s.device);
      check_dtype(doc, "mask_mod.aux[0]", DType::kInt32, "(document ids)");
      check_ndim(doc, "mask_mod.aux[0]", 2, "(batch, max(seqlen_q, seqlen_k))");
      // Lengths of packed or paged sequences in device memory are unknown without
      // max_seqlen_*: the ids must then cover their bounds (total rows, max_pages * page_size).
      const std::int64_t needed =
          std::max(known.q.value_or(s.seqlen_q), known.k.value_or(s.seqlen_k));
      if (doc.shape[0] != s.batch || doc.shape[1] < needed) {
        const bool unknown = (s.varlen_q && !known.q) || (s.varlen_k && !known.k);
        fail("mask_mod.aux[0]", "expected shape (" + std::to_string(s.batch) +
                                    ", L) with L >= " + std::to_string(needed) +
                                    " (batch, max(seqlen_q, seqlen_k)), got " + doc.shape_string() +
                                    (unknown ? "; the lengths of sequences in device memory are their bounds (total "
                                               "rows) unless max_seqlen_q / max_seqlen_k are given"
                                             : ""));
      }
      return;
    }
  }
  fail("mask_mod.kind", "expected none, causal, sliding_window, prefix_lm, document or expression, got " +
                            std::to_string(static_cast<int>(mod.kind)));
}

// Scalar options shared by forward and backward.
void check_options(const AttentionOptions& opts) {
  if (opts.softmax_scale && !std::isfinite(*opts.softmax_scale)) {
    std::ostringstream os;
    os << "expected a finite value, got " << *opts.softmax_scale;
    fail("softmax_scale", os.str());
  }
  if (!(opts.softcap >= 0.0f) || !std::isfinite(opts.softcap)) {
    std::ostringstream os;
    os << "expected a finite value >= 0 (0 disables it), got " << opts.softcap;
    fail("softcap", os.str());
  }
  if (opts.causal && opts.window_right > 0) {
    fail("window_right",
         "expected 0 or negative (unbounded) with causal = true (causal means "
         "window_right = 0), got " +
             std::to_string(opts.window_right));
  }
}

// --- Block sparsity ----------------------------------------------------------------------

struct BlockList {
  const std::optional<TensorView>* cnt;
  const std::optional<TensorView>* idx;
  const char* cnt_name;
  const char* idx_name;
  bool transposed;  // backward (column-block) list
};

std::vector<BlockList> block_lists(const BlockSparseTensors& b) {
  return {{&b.mask_block_cnt, &b.mask_block_idx, "mask_block_cnt", "mask_block_idx", false},
          {&b.full_block_cnt, &b.full_block_idx, "full_block_cnt", "full_block_idx", false},
          {&b.q_mask_block_cnt, &b.q_mask_block_idx, "q_mask_block_cnt", "q_mask_block_idx", true},
          {&b.q_full_block_cnt, &b.q_full_block_idx, "q_full_block_cnt", "q_full_block_idx", true}};
}

bool has_list(const BlockList& list) { return list.cnt->has_value(); }

// Checks every list that is present. In backward the column-block lists, where any is given,
// must cover the forward lists given; without them the forward's serve. The lists are per
// sequence (positions count from each sequence's start): with cu_seqlens their row / column
// blocks count over the longest sequence (max_seqlen_q / max_seqlen_k, or the host cu_seqlens),
// with a page table over max_pages * page_size keys, what the table addresses.
void check_block_sparse(const BlockSparseTensors& b, const AttentionShape& s,
                        const KnownLengths& known, bool for_backward) {
  if (s.varlen_q && !known.q) {
    fail("max_seqlen_q",
         "block sparsity with cu_seqlens_q in device memory needs max_seqlen_q: the lists count "
         "ceil(max_seqlen_q / block_m) row blocks per sequence");
  }
  if (s.varlen_k && !known.k) {
    fail("max_seqlen_k",
         "block sparsity with cu_seqlens_k in device memory needs max_seqlen_k: the lists count "
         "ceil(max_seqlen_k / block_n) column blocks per sequence");
  }
  if (b.block_m < 1 || b.block_n < 1) {
    fail("block_sparse",
         "expected block_m and block_n >= 1, got block_m = " + std::to_string(b.block_m) +
             ", block_n = " + std::to_string(b.block_n));
  }
  const std::int64_t row_blocks = ceil_div(s.seqlen_q, b.block_m);
  const std::int64_t col_blocks = ceil_div(s.seqlen_k, b.block_n);
  const auto lists = block_lists(b);

  for (const BlockList& list : lists) {
    if (list.cnt->has_value() != list.idx->has_value()) {
      const char* missing = list.cnt->has_value() ? list.idx_name : list.cnt_name;
      const char* given = list.cnt->has_value() ? list.cnt_name : list.idx_name;
      fail(missing, std::string("required together with ") + given + ", got none");
    }
  }
  const bool forward_lists = has_list(lists[0]) || has_list(lists[1]);
  const bool backward_lists = has_list(lists[2]) || has_list(lists[3]);
  if (!for_backward && !forward_lists) {
    fail("block_sparse", "expected mask_block_cnt/idx or full_block_cnt/idx, got neither");
  }
  if (for_backward && !backward_lists && !forward_lists) {
    fail("block_sparse",
         "expected the column-block lists q_mask_block_cnt/idx or q_full_block_cnt/idx, or the "
         "forward's mask_block_cnt/idx or full_block_cnt/idx, got neither");
  }
  // Column-block lists, where given, stand for the forward's in backward: all of them.
  if (for_backward && backward_lists) {
    for (int i = 0; i < 2; ++i) {
      if (has_list(lists[i]) && !has_list(lists[i + 2])) {
        fail(lists[i + 2].cnt_name, std::string("required in backward because ") +
                                        lists[i].cnt_name + " is given, got none");
      }
    }
  }

  // All lists share one head count: 1 (broadcast) or num_heads.
  std::int64_t heads_b = -1;
  std::string heads_from;
  for (const BlockList& list : lists) {
    if (!has_list(list)) continue;
    const TensorView& cnt = **list.cnt;
    const TensorView& idx = **list.idx;
    const std::int64_t blocks = list.transposed ? col_blocks : row_blocks;
    const std::int64_t other = list.transposed ? row_blocks : col_blocks;
    const std::string rows_text =
        std::string("ceil(") + (s.varlen_q ? "max_seqlen_q" : "seqlen_q") + " / block_m)";
    const std::string cols_text =
        std::string("ceil(") +
        (s.varlen_k ? "max_seqlen_k" : s.paged ? "max_pages * page_size" : "seqlen_k") +
        " / block_n)";
    const std::string blocks_text = list.transposed ? cols_text : rows_text;
    const std::string other_text = list.transposed ? rows_text : cols_text;
    auto check_list_tensor = [&](const TensorView& t, const char* name) {
      check_sane(t, name);
      check_device(t, name, s.device);
      check_dtype(t, name, DType::kInt32);
      check_contiguous(t, name);
    };
    check_list_tensor(cnt, list.cnt_name);
    check_list_tensor(idx, list.idx_name);
    if (heads_b < 0) {
      check_ndim(cnt, list.cnt_name, 3, "(batch, num_heads or 1, " + blocks_text + ")");
      heads_b = cnt.shape[1];
      heads_from = list.cnt_name;
      if (heads_b != 1 && heads_b != s.num_heads) {
        fail(list.cnt_name, "expected shape " + shape_string({s.batch, s.num_heads, blocks}) +
                                " or " + shape_string({s.batch, 1, blocks}) +
                                " (batch, num_heads or 1, " + blocks_text + "), got " +
                                cnt.shape_string());
      }
    }
    const std::string heads_text = heads_from == list.cnt_name ? std::string("num_heads or 1")
                                                               : "num_heads_b as in " + heads_from;
    check_shape(cnt, list.cnt_name, {s.batch, heads_b, blocks},
                "(batch, " + heads_text + ", " + blocks_text + ")");
    check_shape(idx, list.idx_name, {s.batch, heads_b, blocks, other},
                "(batch, " + heads_text + ", " + blocks_text + ", " + other_text + ")");

    if (s.device.type != DeviceType::kCPU) continue;
    for (std::int64_t bi = 0; bi < s.batch; ++bi) {
      for (std::int64_t h = 0; h < heads_b; ++h) {
        for (std::int64_t r = 0; r < blocks; ++r) {
          const std::int64_t count = read_int(cnt, bi, h, r);
          if (count < 0 || count > other) {
            fail(list.cnt_name, "expected " + std::string(list.cnt_name) + "[" +
                                    std::to_string(bi) + ", " + std::to_string(h) + ", " +
                                    std::to_string(r) + "] in [0, " + std::to_string(other) +
                                    "], got " + std::to_string(count));
          }
          for (std::int64_t j = 0; j < count; ++j) {
            const std::int64_t block = read_int(idx, bi, h, r, j);
            if (block < 0 || block >= other) {
              fail(list.idx_name, "expected " + std::string(list.idx_name) + "[" +
                                      std::to_string(bi) + ", " + std::to_string(h) + ", " +
                                      std::to_string(r) + ", " + std::to_string(j) + "] in [0, " +
                                      std::to_string(other) + "), got " + std::to_string(block));
            }
          }
        }
      }
    }
  }
}

// --- Shared forward / backward flow ------------------------------------------------------

void check_sane_sequences(const SequenceLayout& seq) {
  if (seq.cu_seqlens_q) check_sane(*seq.cu_seqlens_q, "cu_seqlens_q");
  if (seq.cu_seqlens_k) check_sane(*seq.cu_seqlens_k, "cu_seqlens_k");
  if (seq.seqused_q) check_sane(*seq.seqused_q, "seqused_q");
  if (seq.seqused_k) check_sane(*seq.seqused_k, "seqused_k");
  if (seq.page_table) check_sane(*seq.page_table, "page_table");
}

void check_sequence_devices(const SequenceLayout& seq, const Device& device) {
  if (seq.cu_seqlens_q) check_device(*seq.cu_seqlens_q, "cu_seqlens_q", device);
  if (seq.cu_seqlens_k) check_device(*seq.cu_seqlens_k, "cu_seqlens_k", device);
  if (seq.seqused_q) check_device(*seq.seqused_q, "seqused_q", device);
  if (seq.seqused_k) check_device(*seq.seqused_k, "seqused_k", device);
  if (seq.page_table) check_device(*seq.page_table, "page_table", device);
}

// Everything after the tensors' own shapes: sequence contents, options, mods, sparsity.
void check_attention_rest(const SequenceLayout& seq, const AttentionOptions& opts,
                          AttentionShape& s, bool for_backward) {
  const KnownLengths known = resolve_lengths(seq, check_host_sequences(seq, s), s);
  check_options(opts);
  check_score_mod(opts.score_mod, s);
  check_mask_mod(opts.mask_mod, s, known);
  if (opts.block_sparse) check_block_sparse(*opts.block_sparse, s, known, for_backward);
}

}  // namespace

AttentionShape check_forward(const ForwardArgs& args) {
  check_sane(args.q, "q");
  check_sane(args.k, "k");
  check_sane(args.v, "v");
  check_sane(args.out, "out");
  if (args.lse) check_sane(*args.lse, "lse");
  if (args.learnable_sink) check_sane(*args.learnable_sink, "learnable_sink");
  check_sane_sequences(args.seq);

  const Device device = args.q.device;
  check_device(args.k, "k", device);
  check_device(args.v, "v", device);
  check_device(args.out, "out", device);
  if (args.lse) check_device(*args.lse, "lse", device);
  if (args.learnable_sink) check_device(*args.learnable_sink, "learnable_sink", device);
  check_sequence_devices(args.seq, device);

  AttentionShape s = check_qkv(args.q, args.k, args.v, args.seq);
  check_like_out(args.out, "out", s);
  check_no_overlap(args.out, "out");
  if (args.lse) {
    check_lse(*args.lse, "lse", s);
    check_no_overlap(*args.lse, "lse");
  }
  if (args.learnable_sink) check_sink(*args.learnable_sink, s);
  if (args.num_splits > kMaxSplits) {
    fail("num_splits", "expected at most " + std::to_string(kMaxSplits) +
                           " (<= 0 picks a heuristic), got " + std::to_string(args.num_splits));
  }
  check_attention_rest(args.seq, args.opts, s, /*for_backward=*/false);
  return s;
}

AttentionShape check_backward(const BackwardArgs& args) {
  const std::pair<const TensorView*, const char*> tensors[] = {
      {&args.q, "q"},     {&args.k, "k"},       {&args.v, "v"},
      {&args.out, "out"}, {&args.dout, "dout"}, {&args.lse, "lse"},
      {&args.dq, "dq"},   {&args.dk, "dk"},     {&args.dv, "dv"}};
  for (const auto& [t, name] : tensors) check_sane(*t, name);
  if (args.dlse) check_sane(*args.dlse, "dlse");
  if (args.learnable_sink) check_sane(*args.learnable_sink, "learnable_sink");
  if (args.d_sink) check_sane(*args.d_sink, "d_sink");
  check_sane_sequences(args.seq);

  const Device device = args.q.device;
  for (const auto& [t, name] : tensors) check_device(*t, name, device);
  if (args.dlse) check_device(*args.dlse, "dlse", device);
  if (args.learnable_sink) check_device(*args.learnable_sink, "learnable_sink", device);
  if (args.d_sink) check_device(*args.d_sink, "d_sink", device);
  check_sequence_devices(args.seq, device);

  AttentionShape s = check_qkv(args.q, args.k, args.v, args.seq);
  check_like_out(args.out, "out", s);
  check_like_out(args.dout, "dout", s);
  check_lse(args.lse, "lse", s);
  if (args.dlse) check_lse(*args.dlse, "dlse", s);

  const std::pair<const TensorView*, const TensorView*> grads[] = {
      {&args.dq, &args.q}, {&args.dk, &args.k}, {&args.dv, &args.v}};
  const char* grad_names[] = {"dq", "dk", "dv"};
  const char* input_names[] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    const TensorView& grad = *grads[i].first;
    const TensorView& input = *grads[i].second;
    check_same_dtype(grad, grad_names[i], s.dtype);
    Shape expected(input.shape, input.shape + input.ndim);
    check_shape(grad, grad_names[i], expected,
                std::string("(the shape of ") + input_names[i] + ")");
    check_last_dim_contiguous(grad, grad_names[i]);
    check_no_overlap(grad, grad_names[i]);
  }

  if (args.learnable_sink) {
    check_sink(*args.learnable_sink, s);
    if (!args.d_sink) {
      fail("d_sink",
           "required when learnable_sink is given (its gradient, float32 (num_heads,)), "
           "got none");
    }
    check_dtype(*args.d_sink, "d_sink", DType::kFloat32);
    check_shape(*args.d_sink, "d_sink", {s.num_heads}, "(num_heads,)");
    check_contiguous(*args.d_sink, "d_sink");
  } else if (args.d_sink) {
    fail("d_sink", "given without learnable_sink; expected none");
  }
  check_attention_rest(args.seq, args.opts, s, /*for_backward=*/true);
  return s;
}

CombineShape check_combine(const CombineArgs& args) {
  check_sane(args.out_partial, "out_partial");
  check_sane(args.lse_partial, "lse_partial");
  check_sane(args.out, "out");
  if (args.lse) check_sane(*args.lse, "lse");
  if (args.cu_seqlens) check_sane(*args.cu_seqlens, "cu_seqlens");
  if (args.seqused) check_sane(*args.seqused, "seqused");

  CombineShape c;
  c.device = args.out_partial.device;
  auto same_device = [&](const TensorView& t, const std::string& name) {
    if (t.device != c.device) {
      fail(name, "expected device " + device_name(c.device) + " (the device of out_partial), got " +
                     device_name(t.device));
    }
  };
  same_device(args.lse_partial, "lse_partial");
  same_device(args.out, "out");
  if (args.lse) same_device(*args.lse, "lse");
  if (args.cu_seqlens) same_device(*args.cu_seqlens, "cu_seqlens");
  if (args.seqused) same_device(*args.seqused, "seqused");

  const TensorView& op = args.out_partial;
  check_dtype(op, "out_partial", DType::kFloat32, "(partial results are accumulated in fp32)");
  if (op.ndim != 4 && op.ndim != 5) {
    fail("out_partial",
         "expected 5 dimensions (num_splits, batch, seqlen, num_heads, head_dim) "
         "or 4 (num_splits, total, num_heads, head_dim), got " +
             std::to_string(op.ndim) + " with shape " + op.shape_string());
  }
  c.varlen = op.ndim == 4;
  c.num_splits = op.shape[0];
  c.num_heads = op.size(-2);
  c.head_dim = op.size(-1);
  if (c.num_splits < 1 || c.num_splits > kMaxSplits) {
    fail("out_partial", "expected 1 to " + std::to_string(kMaxSplits) +
                            " splits (dimension 0), got " + std::to_string(c.num_splits));
  }
  check_head_dim(c.head_dim, "out_partial", "head_dim");
  check_last_dim_contiguous(op, "out_partial");

  const Shape partial_shape(op.shape, op.shape + op.ndim);
  const std::string dims =
      c.varlen ? "(num_splits, total, num_heads)" : "(num_splits, batch, seqlen, num_heads)";
  check_dtype(args.lse_partial, "lse_partial", DType::kFloat32);
  check_shape(args.lse_partial, "lse_partial",
              Shape(partial_shape.begin(), partial_shape.end() - 1),
              dims + " (out_partial's shape without head_dim)");

  const DType out_dtype = args.out.dtype;
  if (out_dtype != DType::kFloat16 && out_dtype != DType::kBFloat16 &&
      out_dtype != DType::kFloat32) {
    fail("out",
         std::string("expected dtype float16, bfloat16 or float32, got ") + dtype_name(out_dtype));
  }
  check_shape(args.out, "out", Shape(partial_shape.begin() + 1, partial_shape.end()),
              c.varlen ? "(total, num_heads, head_dim)" : "(batch, seqlen, num_heads, head_dim)");
  check_last_dim_contiguous(args.out, "out");
  check_no_overlap(args.out, "out");
  if (args.lse) {
    check_dtype(*args.lse, "lse", DType::kFloat32);
    check_shape(*args.lse, "lse", Shape(partial_shape.begin() + 1, partial_shape.end() - 1),
                c.varlen ? "(total, num_heads)" : "(batch, seqlen, num_heads)");
    check_no_overlap(*args.lse, "lse");
  }

  if (c.varlen) {
    c.seqlen = op.shape[1];
    c.batch = 1;
    if (args.cu_seqlens) c.batch = check_cu_seqlens(*args.cu_seqlens, "cu_seqlens");
  } else {
    c.batch = op.shape[1];
    c.seqlen = op.shape[2];
    if (args.cu_seqlens) {
      fail("cu_seqlens",
           "expected none with the dense (num_splits, batch, seqlen, num_heads, "
           "head_dim) layout; cu_seqlens goes with the packed 4-dimensional layout");
    }
  }
  if (args.seqused) check_int_vector(*args.seqused, "seqused", c.batch, "(batch,)");

  if (c.device.type == DeviceType::kCPU) {
    if (args.cu_seqlens) {
      check_host_offsets(*args.cu_seqlens, "cu_seqlens", c.batch, c.seqlen, "total");
    }
    for (std::int64_t b = 0; args.seqused && b < c.batch; ++b) {
      // Rows of sequence b: its cu_seqlens segment (all rows without cu_seqlens).
      const std::int64_t capacity =
          args.cu_seqlens ? read_int(*args.cu_seqlens, b + 1) - read_int(*args.cu_seqlens, b)
                          : c.seqlen;
      const std::int64_t used = read_int(*args.seqused, b);
      if (used < 0 || used > capacity) {
        fail("seqused", "expected seqused[" + std::to_string(b) + "] in [0, " +
                            std::to_string(capacity) + "], got " + std::to_string(used));
      }
    }
  }
  return c;
}

}  // namespace detail

void validate(const ForwardArgs& args) { detail::check_forward(args); }
void validate(const BackwardArgs& args) { detail::check_backward(args); }
void validate(const CombineArgs& args) { detail::check_combine(args); }

}  // namespace cuflash
