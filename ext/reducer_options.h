// What a Reducer is built with: bucket limits, the gradient route's switches, the health
// options. Bound to Python as fused_reducer._C.ReducerOptions (ext/bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "health_checks.h"
#include "setting_error.h"

namespace fused_reducer {


struct ReducerOptions {
  // Size limits of each group's buckets in launch order, the last one
  // repeating: [first_bucket_bytes, bucket_cap_bytes] unless the user set a
  // longer list (bucket_caps_bytes; DDP's bucket_cap_mb_list).
  std::vector<int64_t> bucket_caps_bytes;
  // The first layout applies bucket_caps_bytes from the first *registered*
  // parameter, then reverses the buckets: DDP's first layout for
  // bucket_cap_mb_list. Otherwise (and in every rebuild) the limits apply in
  // launch order, from the gradients expected first.
  bool ddp_first_layout = false;
  int64_t last_bucket_bytes = 0;  // 0: no separate last bucket (see Note [Bucket assignment])
  bool gradient_as_bucket_view = false;
  bool find_unused_parameters = false;
  // DDP's skip_all_reduce_unused_params. See Note [Skipping unused parameters].
  bool skip_all_reduce_unused_params = false;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // dtype of the buckets of floating-point gradients; nullopt: each gradient's
  // own dtype. See Note [Reduce dtype].
  std::optional<at::ScalarType> reduce_dtype;
  // check_finite and the straggler report: see health_checks.h.
  HealthOptions health;
};

}  // namespace fused_reducer
