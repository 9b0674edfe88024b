// Step telemetry: when each gradient became ready, when each bucket was packed, launched
// and seen complete, how long the end of backward waited; kept per step in a ring
// (Reducer::history()). The analogue of c10d's reducer_timer: the route only reports
// instants, this unit turns them into a StepTiming.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace fused_reducer {

// Note [Step telemetry]
// Per synchronised step the reducer records, for each bucket, when its first
// and last gradient became ready, when its collective was launched, when the
// reducer saw it complete (polled during backward and unpacked early, or its
// wait returned at the end of backward; an upper bound of the real completion)
// and how long that wait blocked (0 for a bucket unpacked during backward). Times are
// microseconds of a steady clock relative to the step's first gradient hook
// (origin_us holds that instant on the clock, for traces). Taking a time costs
// one clock read per hook: no Python, no allocation per parameter.
//
// overlap = 1 - (time blocked waiting at the end of backward) / (length of the
// union of the buckets' [launch, complete] intervals): the share of the
// communication that ran while backward was still computing. 1 = fully hidden,
// 0 = every collective was waited for after backward.
struct BucketTiming {
  int64_t bytes = 0;
  int64_t params = 0;
  double ready_first_us = 0;  // NaN when no parameter of the bucket became ready
  double ready_last_us = 0;   // (find_unused_parameters: a locally unused bucket)
  double launch_us = 0;       // collective started (after the scaled copy)
  double pack_us = 0;         // duration of the copy into the bucket
  double complete_us = 0;     // its wait returned at the end of backward
  double wait_us = 0;         // blocked in that wait: exposed communication
};

struct StepTiming {
  int64_t step = 0;             // stats().step after this step
  double origin_us = 0;         // the step's first hook, steady clock
  double forward_us = 0;        // prepare_forward, relative (negative)
  double backward_end_us = 0;   // end-of-backward callback entered
  double finalize_end_us = 0;   // gradients written back
  double exposed_wait_us = 0;   // sum of the buckets' wait_us
  double overlap = 1.0;
  std::vector<int64_t> bucket_caps_bytes;
  int64_t last_bucket_bytes = 0;
  std::optional<at::ScalarType> reduce_dtype;
  std::vector<BucketTiming> buckets;
  std::vector<double> lateness_ms;  // per rank, when this step exchanged them (else empty)
};

// Steady-clock microseconds. See Note [Step telemetry].
double now_us();

class StepTelemetry {
 public:
  explicit StepTelemetry(size_t params);

  // The forward that starts a step (prepare_forward).
  void forward_started();
  double forward_time_us() const { return forward_time_; }
  // A new iteration over buckets of `bucket_bytes` and `bucket_params` (the layout in force,
  // in launch order): no gradient ready yet.
  void reset_iteration(const std::vector<int64_t>& bucket_bytes,
                       const std::vector<int64_t>& bucket_params);
  // Gradient `index`, of bucket `bucket`, became ready now; `first`: the step's first hook
  // (its origin).
  void gradient_ready(int64_t index, size_t bucket, bool first);
  // Bucket `bucket`'s collective started now, after a pack that began at `pack_start`
  // (steady-clock us); a skipped bucket starts none and is marked launched without a pack.
  void bucket_launched(size_t bucket, double pack_start);
  void bucket_skipped(size_t bucket);
  // Bucket `bucket`'s collective completed now; its wait began at `wait_start` and counts as
  // exposed communication when `exposed` (after backward ended). Returns its timing.
  const BucketTiming& bucket_completed(size_t bucket, double wait_start, bool exposed);

  // Turns this iteration's absolute times into a StepTiming relative to the first hook and
  // keeps it in the ring. `step` carries the step's number and the layout it ran with;
  // `reduced[b]` whether bucket b has a collective (a skipped one is not counted in the
  // overlap); `any_ready`: some hook ran.
  void record_step(StepTiming step, const std::vector<char>& reduced, double backward_end,
                   double finalize_end, bool any_ready);
  // The straggler exchange of the last recorded step (Note [Health exchange]).
  void set_last_lateness(std::vector<double> lateness_ms);

  std::vector<StepTiming> history() const { return {history_.begin(), history_.end()}; }
  const std::vector<double>& last_ready_times() const { return last_ready_time_; }
  void set_capacity(int64_t steps);

 private:
  size_t params_;
  double forward_time_ = 0;              // absolute steady-clock us
  double step_origin_ = 0;               // first hook of this iteration
  std::vector<double> ready_time_;       // per parameter, this iteration, absolute
  std::vector<BucketTiming> buckets_;    // per bucket, this iteration, absolute
  std::vector<double> last_ready_time_;  // per parameter, last completed step, relative
  std::deque<StepTiming> history_;
  size_t trace_capacity_ = 100;
};

}  // namespace fused_reducer
