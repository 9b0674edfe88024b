// ModelSettingError: a model or setting the reducer refuses. Python receives it as
// fused_reducer.errors.FusedReducerError (translated in bindings.cpp), so a check written once in
// C++ reads like the Python checks of core/validation.py.
#pragma once

#include <stdexcept>

namespace fused_reducer {

struct ModelSettingError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace fused_reducer
