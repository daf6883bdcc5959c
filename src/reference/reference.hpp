// CPU reference implementation of everything in DESIGN.md sections 1-2: the oracle
// that every GPU kernel is tested against. Arguments are validated by src/api first.
#pragma once

#include "cuflash/options.hpp"

namespace cuflash::reference {

void forward(const ForwardArgs& args);
void backward(const BackwardArgs& args);
void combine(const CombineArgs& args);

}  // namespace cuflash::reference
