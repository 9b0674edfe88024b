#include "step_telemetry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>

namespace fused_reducer {
namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}  // namespace

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

StepTelemetry::StepTelemetry(size_t params) : params_(params) {}

void StepTelemetry::forward_started() {
  forward_time_ = now_us();
}

void StepTelemetry::reset_iteration(const std::vector<int64_t>& bucket_bytes,
                                    const std::vector<int64_t>& bucket_params) {
  ready_time_.assign(params_, kNaN);
  buckets_.assign(bucket_bytes.size(), BucketTiming());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].bytes = bucket_bytes[b];
    buckets_[b].params = bucket_params[b];
    buckets_[b].ready_first_us = kNaN;  // no parameter of it ready yet
    buckets_[b].ready_last_us = kNaN;
  }
}

void StepTelemetry::gradient_ready(int64_t index, size_t bucket, bool first) {
  const double now = now_us();
  if (first) {
    step_origin_ = now;
  }
  ready_time_[index] = now;
  BucketTiming& timing = buckets_[bucket];
  if (std::isnan(timing.ready_first_us)) {
    timing.ready_first_us = now;
  }
  timing.ready_last_us = now;
}

void StepTelemetry::bucket_launched(size_t bucket, double pack_start) {
  BucketTiming& timing = buckets_[bucket];
  timing.launch_us = now_us();
  timing.pack_us = timing.launch_us - pack_start;
}

void StepTelemetry::bucket_skipped(size_t bucket) {
  buckets_[bucket].launch_us = now_us();
}

const BucketTiming& StepTelemetry::bucket_completed(size_t bucket, double wait_start,
                                                    bool exposed) {
  BucketTiming& timing = buckets_[bucket];
  timing.complete_us = now_us();
  timing.wait_us = exposed ? timing.complete_us - wait_start : 0.0;
  return timing;
}

void StepTelemetry::record_step(StepTiming step, const std::vector<char>& reduced,
                                double backward_end, double finalize_end, bool any_ready) {
  const std::vector<BucketTiming>& buckets = buckets_;
  const double origin = any_ready ? step_origin_ : backward_end;
  step.origin_us = origin;
  step.forward_us = forward_time_ - origin;
  step.backward_end_us = backward_end - origin;
  step.finalize_end_us = finalize_end - origin;
  std::vector<std::pair<double, double>> busy;  // [launch, complete] per bucket
  for (size_t b = 0; b < buckets.size(); ++b) {
    BucketTiming t = buckets[b];
    t.ready_first_us -= origin;
    t.ready_last_us -= origin;
    t.launch_us -= origin;
    t.complete_us -= origin;
    step.exposed_wait_us += t.wait_us;
    if (reduced[b]) {
      busy.emplace_back(t.launch_us, t.complete_us);
    }
    step.buckets.push_back(t);
  }
  std::sort(busy.begin(), busy.end());
  double union_us = 0;
  double end = -std::numeric_limits<double>::infinity();
  for (const auto& [from, to] : busy) {
    const double start = std::max(from, end);
    if (to > start) {
      union_us += to - start;
    }
    end = std::max(end, to);
  }
  step.overlap = union_us > 0 ? std::clamp(1.0 - step.exposed_wait_us / union_us, 0.0, 1.0) : 1.0;

  last_ready_time_.assign(params_, kNaN);
  for (size_t i = 0; i < params_; ++i) {
    last_ready_time_[i] = ready_time_[i] - origin;
  }
  history_.push_back(std::move(step));
  while (history_.size() > trace_capacity_) {
    history_.pop_front();
  }
}

void StepTelemetry::set_last_lateness(std::vector<double> lateness_ms) {
  if (!history_.empty()) {
    history_.back().lateness_ms = std::move(lateness_ms);
  }
}

void StepTelemetry::set_capacity(int64_t steps) {
  TORCH_CHECK(steps > 0, "FusedReducer: trace capacity must be a positive number of steps, got ",
              steps);
  trace_capacity_ = static_cast<size_t>(steps);
  while (history_.size() > trace_capacity_) {
    history_.pop_front();
  }
}

}  // namespace fused_reducer
