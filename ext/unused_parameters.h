// Unused parameters (find_unused_parameters, skip_all_reduce_unused_params): which
// parameters this rank used since the last synchronised step, the used map every rank
// all-reduces at the end of backward (Note [Used map on the GPU]), and the parameters no
// rank uses, which get buckets of their own and are never reduced
// (Note [Skipping unused parameters]).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "used_map.h"

namespace fused_reducer {

class UnusedParameters {
 public:
  // `names`: the reducer's parameters' names.
  explicit UnusedParameters(std::vector<std::string> names);

  // Parameter `index` got a defined gradient (no_sync() steps included: DDP's
  // local_used_map).
  void mark_used(int64_t index) { locally_used_[index] = 1; }
  // A synchronised (or shadowed) step consumed the map.
  void clear_used();

  // The global used map, readable on the host; `reduce` all-reduces it in place and
  // returns once it may be read (Note [Used map on the GPU]).
  at::Tensor allreduce_used_map(c10::Device device, const std::function<void(at::Tensor&)>& reduce);

  // The used-parameter map of the last synchronised step as all-reduced (zeros before the
  // first): what a joined rank all-reduces in place each step it shadows.
  at::Tensor joined_used_map(c10::Device device);

  // skip_all_reduce_unused_params: the parameters no rank used in the first step.
  void decide_skipped(const int32_t* globally_used);
  bool any_skipped() const;
  const std::vector<char>& skipped() const { return skipped_; }
  // Raises if a skipped parameter was used by some rank in step `step`; `before_raise`
  // finishes the collectives in flight first.
  void check_skipped_still_unused(const int32_t* globally_used, int64_t step,
                                  const std::function<void()>& before_raise) const;

 private:
  const std::vector<std::string> names_;
  // Parameters that got a defined gradient since the last synchronised step.
  std::vector<char> locally_used_;
  // Parameters no rank used in the first step, when skip_all_reduce_unused_params.
  std::vector<char> skipped_;
  at::Tensor used_map_;  // see joined_used_map()
  UsedMapExchange used_map_exchange_;  // Note [Used map on the GPU]
};

}  // namespace fused_reducer
