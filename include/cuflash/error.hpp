#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace cuflash {

// Thrown for bad arguments (before any kernel runs), for configurations that this
// build does not contain, and for CUDA failures. `argument()` names the offending
// argument when there is one.
class Error : public std::runtime_error {
 public:
  enum class Kind { kInvalidArgument, kNotBuilt, kNotSupported, kCuda };

  Error(Kind kind, std::string argument, const std::string& message)
      : std::runtime_error(message), kind_(kind), argument_(std::move(argument)) {}

  Kind kind() const { return kind_; }
  const std::string& argument() const { return argument_; }

 private:
  Kind kind_;
  std::string argument_;
};

}  // namespace cuflash
