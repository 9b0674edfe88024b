#include "unused_parameters.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace fused_reducer {

UnusedParameters::UnusedParameters(std::vector<std::string> names)
    : names_(std::move(names)), locally_used_(names_.size(), 0) {}

void UnusedParameters::clear_used() {
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
}

// The global used map (find_unused_parameters), readable on the host: Note [Used map on the GPU].
at::Tensor UnusedParameters::allreduce_used_map(c10::Device device,
                                                const std::function<void(at::Tensor&)>& reduce) {
  auto result = used_map_exchange_.exchange(locally_used_, device, reduce);
  used_map_ = result.device;
  return result.host;
}

at::Tensor UnusedParameters::joined_used_map(c10::Device device) {
  if (!used_map_.defined()) {
    used_map_ = at::zeros({static_cast<int64_t>(locally_used_.size())},
                          at::TensorOptions().dtype(at::kInt).device(device));
  }
  return used_map_;
}

// Note [Skipping unused parameters]
// DDP's skip_all_reduce_unused_params skips a bucket whose parameters are all
// unused on this rank, which needs every rank to agree, step after step; where
// they do not, DDP's ranks issue different collectives and hang. Here the set
// is agreed instead: the parameters no rank used in the first synchronised
// step (the globally used map is the same on every rank). The rebuild after
// that step gives them buckets of their own, which are never reduced (no
// collective, no comm hook, not shadowed by joined ranks). Every later step
// still all-reduces the used map; if a skipped parameter was used on any rank,
// every rank raises naming it, instead of averaging it wrongly or hanging.
void UnusedParameters::decide_skipped(const int32_t* globally_used) {
  skipped_.assign(locally_used_.size(), 0);
  for (size_t i = 0; i < locally_used_.size(); ++i) {
    skipped_[i] = globally_used[i] == 0;
  }
}

bool UnusedParameters::any_skipped() const {
  return std::find(skipped_.begin(), skipped_.end(), 1) != skipped_.end();
}

void UnusedParameters::check_skipped_still_unused(const int32_t* globally_used, int64_t step,
                                                  const std::function<void()>& before_raise) const {
  for (size_t i = 0; i < skipped_.size(); ++i) {
    if (skipped_[i] && globally_used[i] != 0) {
      before_raise();
      TORCH_CHECK(false, "FusedReducer: parameter '", names_[i], "' was unused on every rank in "
                  "the first step, so skip_all_reduce_unused_params=True stopped reducing it, "
                  "but a rank used it in step ", step, ": its gradient would not be "
                  "averaged. skip_all_reduce_unused_params=True needs the unused parameters to "
                  "stay the same for the whole training (as in DDP); construct with "
                  "skip_all_reduce_unused_params=False.");
    }
  }
}

}  // namespace fused_reducer
