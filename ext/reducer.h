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

#include "bucket_assignment.h"
#include "bucket_copy.h"
#include "training_health.h"
#include "transport.h"
#include "used_map.h"

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
  // check_finite and the straggler report: see training_health.h.
  HealthOptions health;
};

// Throws c10::ValueError naming `dtype` and the accepted ones unless it is
// nullopt, float32, bfloat16 or float16.
void check_reduce_dtype(std::optional<at::ScalarType> dtype);

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

// A DDP communication hook, adapted by the bindings: called (instead of the
// transport) when a bucket is complete, with the bucket's index, whether it is
// the last bucket of the step, its flat buffer (gradients unscaled: the hook
// averages), its per-parameter views and parameter indices. The returned
// collective's wait() leaves the reduced result in `flat`.
using CommHook = std::function<std::unique_ptr<PendingCollective>(
    int64_t index, bool is_last, const at::Tensor& flat, const std::vector<at::Tensor>& views,
    const std::vector<int64_t>& params)>;

// What a rank that ran out of inputs reduces in place of a bucket (join):
// zeros shaped like the bucket. See FusedReducer.join.
struct ZeroBucket {
  at::Tensor flat;
  std::vector<at::Tensor> views;
  std::vector<int64_t> params;
  bool is_last = false;
};

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

  // Training health, see training_health.h. The handler raises the check_finite error
  // (the bindings make it Python's NonFiniteGradientError); without one, a c10::Error.
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
  struct Bucket {
    at::Tensor flat;                  // the contiguous buffer the collective reduces
    std::vector<int64_t> params;      // parameter indices, in ready order
    std::vector<at::Tensor> views;    // views of `flat` shaped (and strided) like each parameter
    std::vector<int64_t> offsets;     // element offset of each slot in `flat`
    int64_t bytes = 0;
    int64_t pending = 0;              // parameters not ready yet this iteration
    bool skipped = false;             // only parameters no rank uses: never reduced
    std::unique_ptr<PendingCollective> collective;
    BucketTiming timing;              // this iteration's, absolute steady-clock us
    std::vector<c10::Stream> copy_streams;  // GPU: streams that packed or unpacked it (Note
                                            // [Releasing GPU buckets])
  };

  void install_hooks();
  void on_gradient_ready(int64_t index);
  void launch_ready_buckets();
  void pack_bucket(Bucket& bucket);
  void wait_for_gradient_streams(const Bucket& bucket);
  static void note_copy_stream(Bucket& bucket);
  void release_local_gradients(Bucket& bucket);
  static void release_after_copies(Bucket& bucket);
  void add_pack_job(Bucket& bucket, size_t slot, double scale, std::vector<CopyJob>& jobs);
  void unpack_completed_buckets();
  void finish_bucket(size_t index, const int32_t* used, bool exposed);
  template <typename Keep>
  void unpack_bucket(Bucket& bucket, Keep keep);
  void queue_finalize();
  void finalize_backward();
  void check_not_decided_unused(int64_t index) const;
  void wait_for_bucket(size_t index);
  void wait_for_launched_quietly();
  // Bucket assignment of the options' limits over `order`, counting bytes of
  // each parameter's bucket dtype.
  std::vector<std::vector<int64_t>> assign(const std::vector<int64_t>& order);
  bool rebuilds_after_first_step() const;
  void decide_skipped(const int32_t* globally_used);
  void check_skipped_still_unused(const int32_t* globally_used);
  void build_buckets(const std::vector<std::vector<int64_t>>& assignment);
  at::ScalarType bucket_dtype(int64_t index) const;  // of parameter `index`'s bucket
  void check_bucket_view_dtypes(std::optional<at::ScalarType> dtype) const;
  void check_params_unchanged() const;
  double gradient_scale() const;
  int64_t gradient_divisor() const;
  void rebuild_from_rank0();
  void reset_iteration();
  void record_step(double backward_end, double finalize_end);
  CopyStats pack_stats() const;
  CopyStats unpack_stats() const;
  void snapshot_gradients();
  at::Tensor gradient_probes() const;
  std::vector<double> take_slack_samples(bool exchanging);
  void record_slack_event(bool complete);
  bool slack_on_device() const;
  void record_stream_event(std::optional<c10::Event>& event) const;
  std::string exchange_health(bool joined);
  std::string averaged_nonfinite_message() const;
  at::Tensor allreduce_health(const at::Tensor& row, const char* what);
  std::vector<int64_t> observed_order() const;
  std::string describe_params(const std::vector<int64_t>& indices) const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  // Parameters no rank used in the first step, when skip_all_reduce_unused_params.
  std::vector<char> skipped_;
  std::vector<TensorInfo> infos_;  // bytes in the bucket dtype, set by build_buckets
  std::vector<at::TensorOptions> param_options_;  // dtype and device at construction
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device control_device_;
  std::shared_ptr<Transport> transport_;
  ReducerOptions options_;
  int rank_;
  int world_size_;

  // Hooks live on the parameters' grad accumulators. A tensor holds its
  // accumulator only weakly, so the reducer keeps them alive (else the hook
  // would vanish with a collected accumulator).
  using GradAccumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));
  std::vector<GradAccumulator> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  mutable std::mutex mutex_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;  // parameter -> bucket
  std::vector<int64_t> slot_of_;    // parameter -> index within its bucket

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
  // find_unused_parameters: parameters that got a defined gradient since the
  // last synchronised step, no_sync() steps included (DDP's local_used_map).
  std::vector<char> locally_used_;
  at::Tensor used_map_;  // see joined_used_map()
  UsedMapExchange used_map_exchange_;  // Note [Used map on the GPU]
  bool sharded_ = false;  // Note [Sharded mode]
  bool sharded_layout_ = false;  // the buckets in force were built (padded) for sharded mode
  std::vector<at::Tensor> released_gradients_;  // Note [Released gradients]
  at::Tensor allreduce_used_map();  // the global map, readable on the host
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

  // Telemetry, see Note [Step telemetry].
  double forward_time_ = 0;              // absolute steady-clock us
  double step_origin_ = 0;               // first hook of this iteration
  std::vector<double> ready_time_;       // per parameter, this iteration, absolute
  std::vector<double> last_ready_time_;  // per parameter, last completed step, relative
  std::deque<StepTiming> history_;
  size_t trace_capacity_ = 100;

  // Training health. nonfinite_: int64 per parameter, NaN/Inf in the local gradients of
  // this step (check_finite); norms_ and the gradients they describe: see copy_norms().
  TrainingHealth health_;
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
  std::function<void(const std::string&)> nonfinite_handler_;
  at::Tensor nonfinite_;
  at::Tensor norms_;
  std::vector<char> observed_;  // parameters whose unpack added to norms_
  std::vector<std::pair<const void*, int64_t>> grad_snapshot_;  // param.grad impl, version
  at::Tensor grad_probes_;  // gradient_probes() as the unpack wrote them
  bool grad_probes_taken_ = false;
  mutable bool probes_wanted_ = false;  // set by the first copy_norms()
  bool norms_valid_ = false;
};

}  // namespace fused_reducer
