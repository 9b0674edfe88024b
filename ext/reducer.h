// Reducer: the gradient path of FusedReducer.
//
//   autograd hook (on_gradient_ready)      one parameter's gradient is final
//     -> bucket complete (launch_ready_buckets)
//        pack_bucket: grads -> flat buffer, scaled by 1/world_size (and cast
//                     to the reduce dtype: Note [Reduce dtype])
//        transport_->allreduce_sum(flat)    in flight while backward goes on
//   end of backward (finalize_backward)
//     -> wait for every bucket, unpack_bucket: flat -> param.grad
//        (on CPU each gradient is copied at its own hook, and buckets already
//        reduced are unpacked during backward: Note [Copy at the hook])
//
// Everything here runs in C++: no Python call per parameter.
//
// reducer.cpp is the route; every other concern is a unit the Reducer owns and calls:
//   bucket_layout.h      the buckets, their slots and memory, the rebuild from rank 0
//   unused_parameters.h  the used map, parameters no rank uses
//   step_telemetry.h     bucket and step timing, the history ring
//   health_exchange.h    what the health checks measure on the route (non-finite counts, norms
//                        from the copy, slack) and their exchange at the end of backward
// reducer_settings.cpp holds the setters and introspection (lock, then one unit).
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <array>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bucket_copy.h"
#include "bucket_layout.h"
#include "health_exchange.h"
#include "reducer_options.h"
#include "step_telemetry.h"
#include "transport.h"
#include "unused_parameters.h"

namespace fused_reducer {

// This step's progress of one bucket of the layout (Bucket, bucket_layout.h): the route's
// per-step state, reset at every forward; the bucket's timing is the telemetry's.
struct BucketProgress {
  int64_t pending = 0;  // its parameters not ready yet
  std::unique_ptr<PendingCollective> collective;  // launched, not yet waited for
};

struct ReducerStats {
  int64_t step = 0;             // completed synchronised backward passes
  // The gradients' collectives of the last completed step: one per bucket (and the used map's
  // with find_unused_parameters, as DDP), what a profiler counts for the step less the
  // health exchange's, which is counted apart (Note [Health exchange]).
  int64_t allreduces = 0;
  int64_t allreduce_bytes = 0;         // bytes they reduced
  int64_t health_exchanges = 0;        // check_finite / straggler collectives of that step
  int64_t health_exchange_bytes = 0;   // bytes they reduced
  int64_t rebuilds = 0;         // layout rebuilds after construction
  int64_t copy_launches = 0;    // fused CUDA copy kernels in the last completed step
  std::vector<int64_t> bucket_caps_bytes;
  int64_t last_bucket_bytes = 0;
  int64_t buckets = 0;
  std::optional<at::ScalarType> reduce_dtype;  // of the layout in force (nullopt: grads' own)
  std::string transport;
};

// A DDP communication hook, adapted by the bindings: called (instead of the
// transport) when a bucket is complete, with the bucket's index, whether it is
// the last bucket of the step, its flat buffer (gradients unscaled: the hook
// averages), its per-parameter views and parameter indices. The returned
// collective's wait() leaves the reduced result in `flat`.
using CommHook = std::function<std::unique_ptr<PendingCollective>(
    int64_t index, bool is_last, const at::Tensor& flat, const std::vector<at::Tensor>& views,
    const std::vector<int64_t>& params)>;

class Reducer {
 public:
  // `group` carries control messages (the layout broadcast from rank 0) as
  // tensors on `control_device`; `transport` moves the gradient buckets.
  Reducer(std::vector<at::Tensor> params,
          std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> group,
          at::Device control_device,
          std::shared_ptr<Transport> transport,
          ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called by FusedReducer.forward before the wrapped module runs: raises the
  // unused-parameter error of the previous backward, applies a pending rebuild (a safe
  // point: no gradient is in flight), and arms the hooks when `will_sync`.
  void prepare_forward(bool will_sync);

  // Called (find_unused_parameters) by a hook on the wrapped module's outputs
  // when a backward reaches them: the end of that backward ends the step.
  // See Note [End of backward].
  void on_outputs_reached();

  // Setting a limit takes effect at the next prepare_forward, through a
  // rebuild from the last observed ready order. See Note [Persistent limits].
  // first_bucket_bytes is bucket_caps_bytes[0], bucket_cap_bytes its last
  // entry (the limit of every later bucket); setting one keeps the others.
  void set_bucket_caps_bytes(std::vector<int64_t> caps);
  void set_first_bucket_bytes(int64_t bytes);
  void set_bucket_cap_bytes(int64_t bytes);
  void set_last_bucket_bytes(int64_t bytes);  // 0: off
  std::vector<int64_t> bucket_caps_bytes() const;
  int64_t first_bucket_bytes() const;
  int64_t bucket_cap_bytes() const;
  int64_t last_bucket_bytes() const;
  // Same rules as the limits; see Note [Reduce dtype].
  void set_reduce_dtype(std::optional<at::ScalarType> dtype);
  std::optional<at::ScalarType> reduce_dtype() const;
  void request_rebuild();
  // Rebuild at the next prepare_forward from `order` (each parameter index once) instead of
  // the observed ready order, and count the first step's rebuild as done: a replica joining
  // others mid-training (fused_reducer.torchft) lays its buckets out as they do before its
  // first step. The order also stands in for an observed one until a backward observes one.
  void request_rebuild_from_order(std::vector<int64_t> order);
  // Whether the next prepare_forward rebuilds (a limit set, a rebuild requested, the first
  // step's rebuild): what fused_reducer.torchft agrees on across replica groups.
  bool rebuild_pending() const;

  // no_sync(): hooks do nothing; gradients accumulate in param.grad and the
  // next synchronised backward reduces the accumulated sum.
  void set_sync_enabled(bool enabled);

  // Gradients are divided by this many ranks (0: the world size). Join with
  // divide_by_initial_world_size=False sets the number of ranks not joined.
  void set_divide_factor(int64_t ranks);

  // Sharded mode (ShardedOptimizer): see Note [Sharded mode]. Takes effect, with a rebuild, at
  // the next prepare_forward; collective in effect (every rank must set it).
  void set_sharded(bool sharded);
  bool sharded() const;
  bool sharded_layout() const;  // the layout in force is sharded (set_sharded applied)
  // What param.grad holds after a synchronised step in sharded mode (one tensor per parameter,
  // in index order): see Note [Released gradients]. Cleared again by clear_released_gradients.
  void set_released_gradients(std::vector<at::Tensor> placeholders);
  void clear_released_gradients();
  // Per bucket (launch order): the flat buffer, and each slot's element offset in it.
  std::vector<at::Tensor> bucket_flats() const;
  std::vector<std::vector<int64_t>> bucket_offsets() const;

  // Replaces the transport for every bucket from the next launch on.
  void set_comm_hook(CommHook hook);
  bool has_comm_hook() const;

  // Join: the buckets a joined rank reduces to shadow one step of the others,
  // and the bookkeeping of that shadowed step (the rebuild after the first).
  std::vector<ZeroBucket> zero_buckets() const;
  void note_shadowed_step();
  // find_unused_parameters: the used-parameter map of the last synchronised
  // step as all-reduced (zeros before the first). A joined rank all-reduces
  // this very tensor in place each step it shadows, as DDP's join does with
  // its local_used_map_dev_, so its last map keeps counting as "used".
  at::Tensor joined_used_map();

  std::vector<int64_t> bucket_sizes() const;              // bytes (of the bucket dtype), launch order
  std::vector<int64_t> bucket_numels() const;             // elements of each flat buffer
  std::vector<std::vector<int64_t>> bucket_params() const;  // parameter indices
  ReducerStats stats() const;

  // Telemetry, see Note [Step telemetry]. history(): the last steps kept
  // (oldest first, at most trace_capacity); last_ready_times(): per parameter,
  // when its gradient became ready in the last completed step (NaN: never).
  std::vector<StepTiming> history() const;
  std::vector<double> last_ready_times() const;
  std::vector<int64_t> last_ready_order() const;
  void set_trace_capacity(int64_t steps);
  int64_t completed_steps() const;

  // Training health: the checks in health_checks.h, run by health_exchange.h. The handler
  // raises the check_finite error (the bindings make it Python's NonFiniteGradientError);
  // without one, a c10::Error.
  void set_nonfinite_handler(std::function<void(const std::string&)> handler);
  StragglerReport straggler_report() const;
  std::string take_straggler_warning();
  // A joined rank's part in the health exchange of a step it shadows (join).
  void shadow_health_exchange();
  // Around each collective a forward with grad enabled runs (buffer broadcast, join's
  // all-reduces; no_sync micro-steps included): a rank waits there too, so its slack counts
  // those waits, summed until the step's end (Note [Lateness from slack]).
  void begin_forward_sync();
  void end_forward_sync();
  // float64 [sum of x^2, sum of |x|, max |x|] of param.grad as the last synchronised step
  // unpacked it (Note [Statistics from the copy]); nullopt when param.grad is no longer
  // what that step wrote (changed in place, replaced, sharded mode, a parameter left out).
  std::optional<at::Tensor> copy_norms() const;

 private:
  void install_hooks();
  void on_gradient_ready(int64_t index);
  void launch_ready_buckets();
  void pack_bucket(Bucket& bucket);
  void wait_for_gradient_streams(const Bucket& bucket);
  void release_local_gradients(Bucket& bucket);
  void add_pack_job(Bucket& bucket, size_t slot, double scale, std::vector<CopyJob>& jobs);
  void unpack_completed_buckets();
  void finish_bucket(size_t index, const int32_t* used, bool exposed);
  std::vector<Bucket>& buckets() { return layout_.buckets(); }
  template <typename Keep>
  void unpack_bucket(Bucket& bucket, Keep keep);
  void queue_finalize();
  void finalize_backward();
  void record_step(double backward_end, double finalize_end);
  HealthExchange::StepEnd step_end();
  void check_not_decided_unused(int64_t index) const;
  void wait_for_bucket(size_t index);
  void wait_for_launched_quietly();
  bool rebuilds_after_first_step() const;
  void check_params_unchanged() const;
  double gradient_scale() const;
  int64_t gradient_divisor() const;
  void reset_iteration();
  LayoutLimits requested_limits() const;  // the limits and reduce dtype of options_
  at::Tensor allreduce_used_map();  // the global map, readable on the host
  at::Tensor allreduce_health(const at::Tensor& row, const char* what);
  std::vector<int64_t> observed_order() const;
  std::string describe_params(const std::vector<int64_t>& indices) const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<at::TensorOptions> param_options_;  // dtype and device at construction
  std::shared_ptr<Transport> transport_;
  ReducerOptions options_;  // the limits in it persist: Note [Persistent limits]
  int rank_;
  int world_size_;

  // Hooks live on the parameters' grad accumulators. A tensor holds its
  // accumulator only weakly, so the reducer keeps them alive (else the hook
  // would vanish with a collected accumulator).
  using GradAccumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));
  std::vector<GradAccumulator> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  mutable std::mutex mutex_;
  // The units the route calls: the buckets and their layout, the used map and the skipped
  // parameters, the step's times, training health.
  BucketLayout layout_;
  UnusedParameters unused_;
  StepTelemetry telemetry_;
  HealthExchange health_;

  // Iteration state, reset by prepare_forward.
  bool expect_hooks_ = false;             // armed by a synchronised forward
  bool finished_since_forward_ = false;   // finalize ran; another hook means a second backward
  bool callback_queued_ = false;
  bool ended_with_unready_ = false;      // a backward ended with parameters not ready yet
  // find_unused_parameters: what the last finalize decided, and in which
  // autograd graph task it ran. See Note [End of backward].
  std::vector<char> decided_unused_;
  int64_t finalized_graph_task_ = -1;
  bool sync_enabled_ = true;
  int64_t divide_factor_ = 0;             // 0: world size
  CommHook comm_hook_;
  std::vector<char> ready_;
  std::vector<BucketProgress> progress_;  // per bucket of the layout, in launch order
  bool sharded_ = false;  // Note [Sharded mode]
  std::vector<at::Tensor> released_gradients_;  // Note [Released gradients]
  std::vector<char> packed_;              // gradient already copied into its slot (at its hook)
  // Accelerator gradients: the stream each one was produced on (its hook's
  // current stream), see Note [Gradients from several streams].
  std::vector<std::optional<c10::Stream>> grad_stream_;
  bool copy_at_hook_ = false;             // See Note [Copy at the hook]
  std::vector<int64_t> ready_order_;
  size_t next_to_launch_ = 0;
  size_t next_to_unpack_ = 0;
  int64_t launched_this_step_ = 0;
  int64_t launched_bytes_this_step_ = 0;
  int64_t copy_launches_this_step_ = 0;

  // Layout state.
  std::vector<int64_t> last_ready_order_;  // from the last completed backward
  bool rebuild_pending_ = false;
  bool rebuilt_after_first_step_ = false;
  ReducerStats stats_;
};

}  // namespace fused_reducer
