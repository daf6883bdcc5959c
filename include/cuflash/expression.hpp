// Expression programs: a score_mod or mask_mod given as a small program rather than a built-in
// (ScoreModKind::kExpression / MaskModKind::kExpression). The Python package makes them by
// tracing a user's callable (python/cuflash/mods.py); the CPU reference interprets them and the
// GPU runs them compiled at run time.
//
// A program is a list of instructions; instruction i writes register i, from registers before
// it. Each instruction is 4 int32: an opcode word, then a, b, c. Registers have one of three
// types, fixed by the opcode and the operand types: bool, int (32-bit on the GPU) or float.
//   leaves:   kScore (float; score_mod only), kBatch, kHead, kQIdx, kKvIdx (int, positions
//             within the sequence, top-left aligned), kInt (int, value a), kBool (bool, value a),
//             kFloat (float, the constant scalars[a]),
//             kLoad (the element of aux tensor `slot` at indices a, b, c and d; slot in bits 8..15
//             of the opcode word, d's register plus one in bits 16..23 (0: none); one index
//             register per dimension of the tensor, none (-1, or 0 in the word) for the rest;
//             float for a float32 tensor, int for an int32 one),
//   numeric:  kAdd, kSub, kMul, kMin, kMax (a, b of one numeric type -> that type),
//             kDiv (float, float -> float), kFloorDiv, kMod (int, int -> int, Python's floor
//             semantics), kNeg, kAbs (numeric -> same),
//             kExp, kExp2, kLog, kTanh, kSigmoid, kSqrt (float -> float),
//             kToFloat (int or bool -> float), kToInt (bool -> int),
//   compare:  kLt, kLe, kGt, kGe, kEq, kNe (a, b of one numeric type -> bool),
//   logical:  kAnd, kOr (bool, bool -> bool), kNot (bool -> bool),
//   select:   kWhere (bool a; b, c of one type -> that type).
// `result` names the register of the value (float for a score_mod, bool for a mask_mod); a
// score_mod also names `grad`, the register of d value / d score (float), for the backward.
// Limits: kMaxExprOps instructions, kMaxExprConstants scalars, kMaxExprAux aux tensors of 1 to
// kMaxExprAuxDims dimensions (float32 or int32, contiguous).
#pragma once

#include <cstdint>
#include <vector>

namespace cuflash {

enum class ExprOp : std::int32_t {
  kScore = 0,
  kBatch = 1,
  kHead = 2,
  kQIdx = 3,
  kKvIdx = 4,
  kInt = 5,
  kFloat = 6,
  kLoad = 7,
  kBool = 8,
  kAdd = 10,
  kSub = 11,
  kMul = 12,
  kDiv = 13,
  kFloorDiv = 14,
  kMod = 15,
  kMin = 16,
  kMax = 17,
  kNeg = 20,
  kAbs = 21,
  kExp = 22,
  kExp2 = 23,
  kLog = 24,
  kTanh = 25,
  kSigmoid = 26,
  kSqrt = 27,
  kToFloat = 28,
  kToInt = 29,
  kLt = 30,
  kLe = 31,
  kGt = 32,
  kGe = 33,
  kEq = 34,
  kNe = 35,
  kAnd = 40,
  kOr = 41,
  kNot = 42,
  kWhere = 43,
};

constexpr int kMaxExprOps = 64;
constexpr int kMaxExprConstants = 16;
constexpr int kMaxExprAux = 4;
constexpr int kMaxExprAuxDims = 4;

struct ExprProgram {
  std::vector<std::int32_t> code;  // 4 int32 per instruction: opcode word, a, b, c
  int result = -1;                 // register of the value
  int grad = -1;                   // score_mod: register of d value / d score

  int num_ops() const { return static_cast<int>(code.size() / 4); }
  bool empty() const { return code.empty(); }
};

// The opcode of an instruction's opcode word, a load's aux slot and its fourth index register
// (-1: none).
constexpr ExprOp expr_opcode(std::int32_t word) { return static_cast<ExprOp>(word & 0xff); }
constexpr int expr_load_slot(std::int32_t word) { return (word >> 8) & 0xff; }
constexpr int expr_load_fourth_index(std::int32_t word) { return ((word >> 16) & 0xff) - 1; }

// A load's index register for dimension d (0..3) of instruction `ins` (opcode word, a, b, c).
inline int expr_load_index(const std::int32_t* ins, int d) {
  return d < 3 ? ins[1 + d] : expr_load_fourth_index(ins[0]);
}

}  // namespace cuflash
