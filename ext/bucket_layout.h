// Bucket layout: which gradients share a flat buffer (the assignment of
// bucket_assignment.h over the parameters' bucket dtypes), where each one's slot
// lies in it, the buffers themselves, and the rebuild every rank takes from rank 0.
//
// The route (reducer.cpp) fills and empties the buckets; this unit makes them.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bucket_assignment.h"
#include "reducer_options.h"

namespace fused_reducer {

// How Python spells a dtype, for error messages.
std::string dtype_name(at::ScalarType type);

// Throws c10::ValueError naming `dtype` and the accepted ones unless it is
// nullopt, float32, bfloat16 or float16.
void check_reduce_dtype(std::optional<at::ScalarType> dtype);

// gradient_as_bucket_view makes param.grad a view of its bucket slot: throws
// ModelSettingError naming the first floating parameter whose dtype differs
// from `reduce_dtype` (nothing to check without views or a reduce dtype).
void check_bucket_view_dtypes(bool gradient_as_bucket_view,
                              std::optional<at::ScalarType> reduce_dtype,
                              const std::vector<at::ScalarType>& param_dtypes,
                              const std::vector<std::string>& names);

// One bucket of the layout: fixed from one (re)build to the next. What a step does with it
// (gradients still pending, the collective in flight) is the route's (reducer.h,
// BucketProgress), its timing the telemetry's (step_telemetry.h).
struct Bucket {
  at::Tensor flat;                  // the contiguous buffer the collective reduces
  std::vector<int64_t> params;      // parameter indices, in ready order
  std::vector<at::Tensor> views;    // views of `flat` shaped (and strided) like each parameter
  std::vector<int64_t> offsets;     // element offset of each slot in `flat`
  int64_t bytes = 0;
  bool skipped = false;             // only parameters no rank uses: never reduced
  // GPU: the streams that packed or unpacked `flat` since it was allocated, so that its
  // memory is reused only after them (Note [Releasing GPU buckets]).
  std::vector<c10::Stream> copy_streams;

  // The current stream packs or unpacks this bucket: remember it.
  void note_copy_stream();
  // The buffer is being dropped: its memory is reused only after those copies.
  void release_after_copies();
};

// What a rank that ran out of inputs reduces in place of a bucket (join):
// zeros shaped like the bucket. See FusedReducer.join.
struct ZeroBucket {
  at::Tensor flat;
  std::vector<at::Tensor> views;
  std::vector<int64_t> params;
  bool is_last = false;
};

// The limits and dtype a layout is built with.
struct LayoutLimits {
  std::vector<int64_t> bucket_caps_bytes;
  int64_t last_bucket_bytes = 0;
  std::optional<at::ScalarType> reduce_dtype;
};

// The limits and dtype of the layout in force (those of the last build).
struct LayoutInForce : LayoutLimits {
  bool sharded = false;  // built (padded) for sharded mode: Note [Sharded mode]
};

class BucketLayout {
 public:
  // The layout of `params` (named `names`), with the settings of `options` that never change
  // (gradient_as_bucket_view, ddp_first_layout, timeout). The limits and the reduce dtype are
  // the reducer's to keep (Note [Persistent limits]): each build takes them as an argument.
  // `group` carries the rank-0 layout broadcast as tensors on `control_device`.
  BucketLayout(std::vector<at::Tensor> params, std::vector<std::string> names,
               const ReducerOptions& options, c10::intrusive_ptr<c10d::ProcessGroup> group,
               at::Device control_device);

  // The layout before any gradient was seen (reverse registration order), with `limits`.
  void build_initial(const LayoutLimits& limits);
  // Rank 0 decides the layout inputs (its `limits` and `order`, its observed ready order) and
  // broadcasts them; every rank then builds the same layout, and in_force() holds rank 0's
  // limits. `skipped`: parameters no rank uses (Note [Skipping unused parameters]), empty when
  // none.
  void rebuild_from_rank0(const LayoutLimits& limits, const std::vector<int64_t>& order,
                          const std::vector<char>& skipped, bool sharded);

  void check_bucket_view_dtypes(std::optional<at::ScalarType> dtype) const;

  // The buckets in launch order; the bucket and slot of a parameter.
  std::vector<Bucket>& buckets() { return buckets_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  size_t bucket_index_of(int64_t index) const { return static_cast<size_t>(bucket_of_[index]); }
  Bucket& bucket_of(int64_t index) { return buckets_[bucket_of_[index]]; }
  size_t slot_of(int64_t index) const { return static_cast<size_t>(slot_of_[index]); }
  const LayoutInForce& in_force() const { return in_force_; }
  int64_t rebuilds() const { return rebuilds_; }

  std::vector<at::Tensor> flats() const;
  std::vector<std::vector<int64_t>> offsets() const;
  std::vector<int64_t> sizes() const;
  std::vector<int64_t> numels() const;
  std::vector<std::vector<int64_t>> params() const;
  std::vector<ZeroBucket> zero_buckets() const;

 private:
  // The dtype of parameter `index`'s slot under `reduce_dtype`.
  at::ScalarType bucket_dtype(int64_t index, std::optional<at::ScalarType> reduce_dtype) const;
  // Bucket assignment of `limits` over `order`, counting bytes of each parameter's bucket
  // dtype.
  std::vector<std::vector<int64_t>> assign(const LayoutLimits& limits,
                                           const std::vector<int64_t>& order,
                                           const std::vector<char>& skipped);
  void build_buckets(const LayoutLimits& limits,
                     const std::vector<std::vector<int64_t>>& assignment,
                     const std::vector<char>& skipped, bool sharded);

  const std::vector<at::Tensor> params_;  // handles of the reducer's parameters
  const std::vector<std::string> names_;
  const bool gradient_as_bucket_view_;
  const bool ddp_first_layout_;
  const std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device control_device_;
  int world_size_;
  std::vector<TensorInfo> infos_;  // bytes in the bucket dtype, set by assign
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;  // parameter -> bucket
  std::vector<int64_t> slot_of_;    // parameter -> index within its bucket
  LayoutInForce in_force_;
  int64_t rebuilds_ = 0;
};

}  // namespace fused_reducer
