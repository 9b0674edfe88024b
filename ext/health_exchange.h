// The health exchange: what the health checks (health_checks.h) need from the gradient route,
// measured while a step runs, and the exchange at its end. The route calls it at the begin of a
// step (its first gradient hook), at each bucket's launch and completion, at the end of
// backward, and around the forward's collectives. It measures what only the route can:
// non-finite counts and norms from the copies (Note [Statistics from the copy]), the slack on
// the host clock or on the device's timing events (Note [Lateness from slack on the GPU]); at
// the end of a step it all-reduces the checks' rows over the buckets' transport and hands the
// sums back to HealthChecks (Note [Health exchange]).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bucket_copy.h"
#include "health_checks.h"
#include "step_telemetry.h"

namespace fused_reducer {

class HealthExchange {
 public:
  // All-reduces a float64 row (sum) over the buckets' transport and returns it on the host;
  // `what` names the exchange in its error.
  using AllReduce = std::function<at::Tensor(const at::Tensor& row, const char* what)>;

  // `params` (non-empty) and `names`: the reducer's parameters (handles) and their names.
  HealthExchange(HealthOptions options, int rank, int world_size, std::vector<at::Tensor> params,
             std::vector<std::string> names, AllReduce allreduce);

  // The step's first gradient hook: its statistics start here.
  void begin_step();
  // What the copies into and out of the buckets count (Note [Statistics from the copy]).
  CopyStats pack_stats() const;
  CopyStats unpack_stats() const;
  // A gradient that is its bucket view is packed without a copy: counted on its own.
  void observe_without_copy(const CopyJob& job) const;
  // The unpack copies parameter `index`'s average into param.grad (and into the norms).
  void observed(int64_t index) { observed_[index] = 1; }
  // A bucket's collective was launched / was seen complete (with its timing).
  void launched();
  void completed(const BucketTiming& timing);

  // The end of a synchronised step, its gradients written: keeps what copy_norms() compares,
  // exchanges when due (the lateness goes into `telemetry`'s last step) and raises the
  // check_finite error, the same on every rank.
  struct StepEnd {
    int64_t step = 0;               // the step that ended (stats().step)
    bool sharded = false;           // the averages went to shards, not param.grad
    bool sharded_layout = false;    // the layout in force is sharded
    const std::vector<int64_t>* ready_order = nullptr;
    std::function<std::string()> reduction;  // what reduced the averages (overflow message)
  };
  void end_step(const StepEnd& end, StepTelemetry& telemetry);
  // A joined rank's part in the exchange of a step it shadows (join).
  void shadow_step(const StepEnd& end);

  // Around each collective a forward with grad enabled runs: Note [Lateness from slack].
  void begin_forward_sync();
  void end_forward_sync();

  std::optional<at::Tensor> copy_norms() const;
  void set_nonfinite_handler(std::function<void(const std::string&)> handler) {
    nonfinite_handler_ = std::move(handler);
  }
  StragglerReport report() const { return health_.report(); }
  std::string take_warning() { return health_.take_warning(); }

 private:
  std::string exchange(bool joined, const StepEnd& end, StepTelemetry* telemetry);
  std::string averaged_nonfinite_message(const StepEnd& end) const;
  void snapshot_gradients(bool sharded);
  at::Tensor gradient_probes() const;
  std::vector<double> take_slack_samples(bool exchanging);
  void record_slack_event(bool complete);
  bool slack_on_device() const;
  void record_stream_event(std::optional<c10::Event>& event) const;

  const std::vector<at::Tensor> params_;
  const std::vector<std::string> names_;
  HealthChecks health_;
  AllReduce allreduce_;
  std::function<void(const std::string&)> nonfinite_handler_;

  // nonfinite_: int64 per parameter, NaN/Inf in the local gradients of this step
  // (check_finite); norms_ and the gradients they describe: see copy_norms().
  at::Tensor nonfinite_;
  at::Tensor norms_;
  std::vector<char> observed_;  // parameters whose unpack added to norms_
  std::vector<std::pair<const void*, int64_t>> grad_snapshot_;  // param.grad impl, version
  at::Tensor grad_probes_;  // gradient_probes() as the unpack wrote them
  bool grad_probes_taken_ = false;
  mutable bool probes_wanted_ = false;  // set by the first copy_norms()
  bool norms_valid_ = false;

  // CPU: the last reduced bucket of this step, host clock (Note [Lateness from slack]).
  bool host_slack_seen_ = false;
  double host_ready_last_us_ = 0;
  double host_complete_us_ = 0;
  // GPU buckets: the slack on the device's clock (Note [Lateness from slack on the GPU]), one
  // pair of timing events per step, kSlackSlots steps in turn: a pair is read once the device
  // has finished it.
  struct SlackEvents {
    std::optional<c10::Event> ready;     // after the last launched bucket's copy
    std::optional<c10::Event> complete;  // after the wait for the last bucket's collective
    bool recorded = false;
    // Around each forward collective of the step (begin_forward_sync), reused step to step.
    std::vector<std::pair<std::optional<c10::Event>, std::optional<c10::Event>>> forward;
    size_t forward_recorded = 0;  // pairs of this step recorded so far
  };
  static constexpr size_t kSlackSlots = 4;
  std::array<SlackEvents, kSlackSlots> slack_events_;
  size_t slack_slot_ = 0;
  // CPU: the host clock around this step's forward collectives (begin_forward_sync), summed.
  double forward_sync_begin_us_ = 0;
  double forward_sync_ms_ = 0;
  bool forward_sync_open_ = false;
};

}  // namespace fused_reducer
