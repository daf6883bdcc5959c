// The CPU interpreter of expression programs (cuflash/expression.hpp): a score_mod's value and
// derivative, or a mask_mod's verdict, per element. Registers are doubles (ints and bools are
// whole values); the program was validated (api/validate.cpp), so operands and types are sound.
// Integer arithmetic is 32-bit two's complement, as in the kernels compiled for the GPU: exact
// in 64 bits, then wrapped.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuflash/error.hpp"
#include "cuflash/options.hpp"
#include "reference/numeric.hpp"

namespace cuflash::reference {

class ExpressionEvaluator {
 public:
  ExpressionEvaluator() = default;
  // `mod`: "score_mod" or "mask_mod", for error messages.
  ExpressionEvaluator(const ExprProgram& program, const std::vector<double>& constants,
                      const std::vector<TensorView>& aux, std::string mod)
      : program_(program), constants_(constants), mod_(std::move(mod)) {
    // The tensors are read once, so that an element costs no dtype dispatch.
    for (const TensorView& t : aux) {
      Tensor copy;
      copy.ndim = t.ndim;
      std::int64_t count = 1;
      for (int d = 0; d < t.ndim; ++d) {
        copy.shape[d] = t.shape[d];
        count *= t.shape[d];
      }
      copy.values.resize(static_cast<std::size_t>(count));
      std::int64_t index[kMaxDims] = {};
      for (std::int64_t e = 0; e < count; ++e) {
        std::int64_t rest = e, offset = 0;
        for (int d = t.ndim - 1; d >= 0; --d) {
          index[d] = rest % t.shape[d];
          rest /= t.shape[d];
          offset += index[d] * t.stride[d];
        }
        copy.values[static_cast<std::size_t>(e)] = load(t, offset);
      }
      tensors_.push_back(std::move(copy));
    }
    // Which registers hold ints: those whose arithmetic wraps.
    const int n = program_.num_ops();
    is_int_.assign(static_cast<std::size_t>(n), false);
    for (int i = 0; i < n; ++i) {
      const std::int32_t* code = program_.code.data() + 4 * i;
      const auto operand_is_int = [&](int k) { return code[1 + k] >= 0 && is_int_[code[1 + k]]; };
      switch (expr_opcode(code[0])) {
        case ExprOp::kBatch:
        case ExprOp::kHead:
        case ExprOp::kQIdx:
        case ExprOp::kKvIdx:
        case ExprOp::kInt:
        case ExprOp::kFloorDiv:
        case ExprOp::kMod:
        case ExprOp::kToInt:
          is_int_[i] = true;
          break;
        case ExprOp::kLoad:
          is_int_[i] = aux[expr_load_slot(code[0])].dtype == DType::kInt32;
          break;
        case ExprOp::kAdd:
        case ExprOp::kSub:
        case ExprOp::kMul:
        case ExprOp::kMin:
        case ExprOp::kMax:
        case ExprOp::kNeg:
        case ExprOp::kAbs:
          is_int_[i] = operand_is_int(0);
          break;
        case ExprOp::kWhere:
          is_int_[i] = operand_is_int(1);
          break;
        default:
          break;
      }
    }
  }

  bool empty() const { return program_.empty(); }

  // Evaluates the program for one element; returns the result register and, when `grad` is
  // given, stores the derivative register there.
  double operator()(double score, std::int64_t b, std::int64_t h, std::int64_t q_idx,
                    std::int64_t kv_idx, double* grad = nullptr) const {
    double r[kMaxExprOps];
    const int n = program_.num_ops();
    const std::int32_t* code = program_.code.data();
    for (int i = 0; i < n; ++i, code += 4) {
      const double a = code[1] >= 0 && code[1] < i ? r[code[1]] : 0.0;
      const double x = code[2] >= 0 && code[2] < i ? r[code[2]] : 0.0;
      const double y = code[3] >= 0 && code[3] < i ? r[code[3]] : 0.0;
      double v = 0.0;
      switch (expr_opcode(code[0])) {
        case ExprOp::kScore: v = score; break;
        case ExprOp::kBatch: v = static_cast<double>(b); break;
        case ExprOp::kHead: v = static_cast<double>(h); break;
        case ExprOp::kQIdx: v = static_cast<double>(q_idx); break;
        case ExprOp::kKvIdx: v = static_cast<double>(kv_idx); break;
        case ExprOp::kInt:
        case ExprOp::kBool: v = code[1]; break;
        case ExprOp::kFloat: v = constants_[code[1]]; break;
        case ExprOp::kLoad: v = load_element(expr_load_slot(code[0]), code, r); break;
        case ExprOp::kAdd: v = is_int_[i] ? wrap(whole(a) + whole(x)) : a + x; break;
        case ExprOp::kSub: v = is_int_[i] ? wrap(whole(a) - whole(x)) : a - x; break;
        case ExprOp::kMul: v = is_int_[i] ? wrap(whole(a) * whole(x)) : a * x; break;
        case ExprOp::kDiv: v = a / x; break;
        case ExprOp::kFloorDiv:
          require_nonzero(x, "//");
          v = wrap(floor_div(whole(a), whole(x)));
          break;
        case ExprOp::kMod:
          require_nonzero(x, "%");
          v = wrap(whole(a) - whole(x) * floor_div(whole(a), whole(x)));
          break;
        case ExprOp::kMin: v = std::fmin(a, x); break;
        case ExprOp::kMax: v = std::fmax(a, x); break;
        case ExprOp::kNeg: v = is_int_[i] ? wrap(-whole(a)) : -a; break;
        case ExprOp::kAbs: v = is_int_[i] ? wrap(std::abs(whole(a))) : std::fabs(a); break;
        case ExprOp::kExp: v = std::exp(a); break;
        case ExprOp::kExp2: v = std::exp2(a); break;
        case ExprOp::kLog: v = std::log(a); break;
        case ExprOp::kTanh: v = std::tanh(a); break;
        case ExprOp::kSigmoid: v = 1.0 / (1.0 + std::exp(-a)); break;
        case ExprOp::kSqrt: v = std::sqrt(a); break;
        case ExprOp::kToFloat:
        case ExprOp::kToInt: v = a; break;
        case ExprOp::kLt: v = a < x; break;
        case ExprOp::kLe: v = a <= x; break;
        case ExprOp::kGt: v = a > x; break;
        case ExprOp::kGe: v = a >= x; break;
        case ExprOp::kEq: v = a == x; break;
        case ExprOp::kNe: v = a != x; break;
        case ExprOp::kAnd: v = (a != 0.0) && (x != 0.0); break;
        case ExprOp::kOr: v = (a != 0.0) || (x != 0.0); break;
        case ExprOp::kNot: v = a == 0.0; break;
        case ExprOp::kWhere: v = a != 0.0 ? x : y; break;
      }
      r[i] = v;
    }
    if (grad) *grad = program_.grad >= 0 ? r[program_.grad] : 1.0;
    return r[program_.result];
  }

 private:
  struct Tensor {
    int ndim = 0;
    std::int64_t shape[kMaxDims] = {};
    std::vector<double> values;  // row-major
  };

  // An int register's value (a whole double within int32).
  static std::int64_t whole(double x) { return static_cast<std::int64_t>(x); }
  // Two's complement wrap into int32 of a value exact in int64.
  static double wrap(std::int64_t x) {
    return static_cast<double>(static_cast<std::int32_t>(static_cast<std::uint32_t>(x)));
  }
  // Python's floor division (rounds toward minus infinity).
  static std::int64_t floor_div(std::int64_t a, std::int64_t b) {
    std::int64_t q = a / b;
    if (a % b != 0 && ((a < 0) != (b < 0))) --q;
    return q;
  }

  void require_nonzero(double x, const char* op) const {
    if (x == 0.0) {
      throw Error(Error::Kind::kInvalidArgument, mod_,
                  mod_ + ": integer " + op + " by zero in the expression");
    }
  }

  double load_element(int slot, const std::int32_t* code, const double* r) const {
    const Tensor& t = tensors_[slot];
    std::int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) {
      const auto index = static_cast<std::int64_t>(r[expr_load_index(code, d)]);
      if (index < 0 || index >= t.shape[d]) {
        const std::string name = mod_ + ".aux[" + std::to_string(slot) + "]";
        throw Error(Error::Kind::kInvalidArgument, name,
                    name + ": index " + std::to_string(index) + " is out of range for dimension " +
                        std::to_string(d) + " of size " + std::to_string(t.shape[d]));
      }
      offset = offset * t.shape[d] + index;
    }
    return t.values[static_cast<std::size_t>(offset)];
  }

  ExprProgram program_;
  std::vector<double> constants_;
  std::vector<Tensor> tensors_;
  std::vector<bool> is_int_;  // per register
  std::string mod_;
};

}  // namespace cuflash::reference
