#include "reducer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

#include "bucket_copy.h"

namespace fused_reducer {
namespace {

constexpr const char* kFindUnusedHint =
    "If some parameters are legitimately unused in forward, construct FusedReducer with "
    "find_unused_parameters=True; otherwise make every forward output take part in the loss.";

// The post hook on a parameter's gradient accumulator. Compiled autograd
// cannot trace it: say so at once, by name, instead of torch's generic
// "compiled_args nyi".
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    TORCH_CHECK(false,
                "FusedReducer: compiled autograd (torch._dynamo.config.compiled_autograd or "
                "torch._dynamo.compiled_autograd.enable) is not supported: FusedReducer reduces "
                "gradients from C++ hooks on the parameters' gradient accumulators, which "
                "compiled autograd cannot trace. Keep compiled autograd off; torch.compile of the "
                "model or of FusedReducer itself is supported.");
  }

 private:
  std::function<void()> on_ready_;
};

std::string megabytes(int64_t bytes) {
  std::ostringstream out;
  out.precision(3);
  out << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

// The reducer's parameters, checked before any unit is built on them.
std::vector<at::Tensor> nonempty(std::vector<at::Tensor> params) {
  TORCH_CHECK(!params.empty(), "FusedReducer: the module has no trainable parameters");
  return params;
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params,
                 std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> group,
                 at::Device control_device,
                 std::shared_ptr<Transport> transport,
                 ReducerOptions options)
    : params_(nonempty(std::move(params))),
      names_(std::move(names)),
      transport_(std::move(transport)),
      options_(options),
      rank_(group->getRank()),
      world_size_(group->getSize()),
      layout_(params_, names_, options_, std::move(group), control_device),
      unused_(names_),
      telemetry_(params_.size()),
      health_(options_.health, rank_, world_size_, params_, names_,
              [this](const at::Tensor& row, const char* what) { return allreduce_health(row, what); }) {
  TORCH_CHECK(params_.size() == names_.size(), "FusedReducer: one name per parameter expected");
  check_bucket_caps(options_.bucket_caps_bytes);
  check_last_bucket_bytes(options_.last_bucket_bytes);
  check_reduce_dtype(options_.reduce_dtype);
  for (const auto& p : params_) {
    param_options_.push_back(p.options());
  }
  layout_.check_bucket_view_dtypes(options_.reduce_dtype);
  copy_at_hook_ = !params_.front().is_cuda();
  layout_.build_initial(requested_limits());
  reset_iteration();
  install_hooks();
}

Reducer::~Reducer() {
  // Remove the hooks: they point at this object, the accumulators may outlive it.
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
  wait_for_launched_quietly();
}

void Reducer::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    const auto index = static_cast<int64_t>(i);
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<GradientReadyHook>([this, index] { on_gradient_ready(index); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

// ---------------------------------------------------------------------------
// Hook -> bucket -> collective
// ---------------------------------------------------------------------------

void Reducer::on_gradient_ready(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!expect_hooks_) {
    // A backward that no synchronised FusedReducer.forward armed: a forward
    // inside no_sync() (like DDP, whether a backward syncs is decided at its
    // forward), the wrapped module called directly, or a second backward
    // through one graph. Its gradients stay local; under no_sync() remember
    // which were used, for the find_unused_parameters map of the next
    // synchronised step.
    if (!sync_enabled_ && params_[index].grad().defined()) {
      unused_.mark_used(index);
    }
    check_not_decided_unused(index);
    return;
  }
  TORCH_CHECK(!ready_[index],
              "FusedReducer: parameter '", names_[index], "' (index ", index,
              ") was marked ready twice in one backward. This happens with reentrant "
              "activation checkpointing or when one backward reaches a parameter twice; "
              "use torch.utils.checkpoint(..., use_reentrant=False).");
  const auto& grad = params_[index].grad();
  TORCH_CHECK(!grad.defined() || !grad.is_sparse(),
              "FusedReducer: parameter '", names_[index],
              "' produced a sparse gradient, which FusedReducer does not reduce; "
              "use a dense gradient (e.g. nn.Embedding(sparse=False)).");
  if (!callback_queued_) {
    queue_finalize();  // See Note [End of backward]
  }
  const bool first = ready_order_.empty();
  if (first) {
    health_.begin_step();
  }
  ready_[index] = 1;
  if (grad.defined()) {
    unused_.mark_used(index);
    if (!grad.is_cpu()) {
      grad_stream_[index] = c10::impl::getDeviceGuardImpl(grad.device().type())->getStream(grad.device());
    }
  }
  ready_order_.push_back(index);
  const size_t b = layout_.bucket_index_of(index);
  telemetry_.gradient_ready(index, b, first);
  Bucket& bucket = buckets()[b];
  if (copy_at_hook_) {
    // See Note [Copy at the hook].
    std::vector<CopyJob> jobs;
    add_pack_job(bucket, layout_.slot_of(index), gradient_scale(), jobs);
    const CopyStats stats = health_.pack_stats();
    scaled_copy(jobs, gradient_scale(), &stats);
    packed_[index] = 1;
  }
  if (--progress_[b].pending == 0) {
    launch_ready_buckets();
  }
  if (!options_.find_unused_parameters) {
    unpack_completed_buckets();
  }
}

// Note [End of backward]
// The step ends in a callback queued on the autograd graph task (one backward
// pass) that is running: the first hook of the step queues it, so it runs
// when that backward ends. With reentrant checkpointing
// (torch.utils.checkpoint(..., use_reentrant=True)) the first gradients can
// come from a nested backward that the checkpoint runs inside the outer one;
// its end comes before the outer backward reaches the parameters outside the
// checkpoint. Without find_unused_parameters, finalize_backward sees those
// parameters not ready and stays armed: the outer backward's next hook queues
// the real end. With find_unused_parameters, parameters not ready at the end
// are decided unused (they contribute zeros), so the end must be the outer
// backward's: FusedReducer.forward hooks the module's outputs, and the first
// output gradient queues the callback on the backward that reaches them (the
// outermost one); a backward that reaches the outputs but no parameter
// (torch.autograd.grad for a gradient penalty) ends without ending the step.
// Where the outputs could not be hooked, a parameter decided unused whose
// hook still fires inside the backward that contained the ended one (graph
// tasks are numbered in creation order: an older task is an enclosing one)
// raises: its gradient was averaged as zero, never silently.

void Reducer::queue_finalize() {
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  callback_queued_ = true;
}

void Reducer::on_outputs_reached() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (expect_hooks_ && !callback_queued_) {
    queue_finalize();
  }
}

void Reducer::check_not_decided_unused(int64_t index) const {
  if (!finished_since_forward_ || !decided_unused_[index] || finalized_graph_task_ < 0) {
    return;
  }
  const int64_t current = torch::autograd::get_current_graph_task_id();
  TORCH_CHECK(current < 0 || current >= finalized_graph_task_,
              "FusedReducer: parameter '", names_[index], "' (index ", index,
              ") received its gradient after FusedReducer had ended the step and treated it as "
              "unused (find_unused_parameters=True), so its average was computed as zero. This "
              "happens with reentrant activation checkpointing (torch.utils.checkpoint(..., "
              "use_reentrant=True)) when FusedReducer cannot see the module's outputs (no tensor "
              "requiring grad in what forward returned). Use "
              "torch.utils.checkpoint(..., use_reentrant=False), or return the output tensors "
              "from forward.");
}

// Note [Copy at the hook]
// Without the fused CUDA kernel (CPU parameters) a gradient is copied into its
// slot by its own hook, as DDP does: the copies spread through backward, and a
// bucket launches as soon as its last gradient is in, instead of after a copy
// of the whole bucket. Buckets whose collective has completed are unpacked
// while backward goes on (not with find_unused_parameters: which parameters
// get a gradient is only known at the end), so less is left for the end.

// Unpacks, in order, the launched buckets whose collective has completed.
void Reducer::unpack_completed_buckets() {
  while (next_to_unpack_ < next_to_launch_) {
    const auto& collective = progress_[next_to_unpack_].collective;
    if (collective && !collective->completed()) {
      return;
    }
    finish_bucket(next_to_unpack_++, nullptr, /*exposed=*/false);
  }
}

// Waits for bucket `index` (telemetry: complete_us, and wait_us when the wait
// is `exposed`, i.e. after backward ended) and unpacks it; `used`
// (find_unused_parameters): the globally used map.
void Reducer::finish_bucket(size_t index, const int32_t* used, bool exposed) {
  const double start = now_us();
  wait_for_bucket(index);
  const BucketTiming& timing = telemetry_.bucket_completed(index, start, exposed);
  Bucket& bucket = buckets()[index];
  if (!bucket.skipped) {
    health_.completed(timing);
  }
  if (sharded_) {
    release_local_gradients(bucket);
    return;
  }
  unpack_bucket(bucket, [used](int64_t param) { return used == nullptr || used[param] != 0; });
}

// Note [Sharded mode]
// With a ShardedOptimizer (python/fused_reducer/sharded/optimizer.py) each bucket is
// reduce-scattered instead of all-reduced: rank r's shard of the flat buffer
// (the r-th of world_size equal parts; buckets are padded so that every shard
// has the same size and starts 16-byte aligned, Note [Slot layout]) holds the
// average of that part of the gradients, and the optimizer updates only the
// parameters' elements in it, then all-gathers them. Nothing is unpacked into
// param.grad: the local, unreduced gradients are released as soon as their
// bucket is reduced (a synchronised step leaves a placeholder in param.grad:
// Note [Released gradients]), so no torch utility that reads param.grad can
// mistake them for the average. no_sync()
// steps accumulate in param.grad as usual; the synchronised step packs the sum.
// With gradient_as_bucket_view the gradient became a view of its slot when it
// was packed, so autograd's own copy is dropped even before the bucket is
// reduced.
//
// Note [Released gradients]
// A released gradient is not left None: torch utilities that read param.grad
// (clip_grad_norm_ over model.parameters(), GradScaler.unscale_, a norm logged
// by hand) would then silently see no gradient and compute something else.
// param.grad becomes a placeholder instead (python/fused_reducer/core/wrapper.py,
// _ReleasedGradient: the parameter's metadata, no storage) whose every use
// raises naming the parameter and opt.clip_grad_norm_. It stays through the
// optimizer's step() (a plain optimizer leaves param.grad set, and code that
// logs it after step() must not read None), and is cleared (None) by
// zero_grad() and by the next forward with gradients enabled, so that
// autograd never accumulates into it.
void Reducer::release_local_gradients(Bucket& bucket) {
  for (const int64_t index : bucket.params) {
    at::Tensor& grad = params_[index].mutable_grad();
    if (released_gradients_.empty()) {
      grad.reset();
    } else {
      grad = released_gradients_[index];
    }
  }
}

// Buckets launch strictly in order, each as soon as it and all before it are
// complete, so every rank issues the same collectives in the same order.
void Reducer::launch_ready_buckets() {
  const size_t count = buckets().size();
  while (next_to_launch_ < count && progress_[next_to_launch_].pending == 0) {
    const size_t index = next_to_launch_++;
    Bucket& bucket = buckets()[index];
    if (bucket.skipped) {
      telemetry_.bucket_skipped(index);
      continue;  // no collective: see Note [Skipping unused parameters]
    }
    const double start = now_us();
    pack_bucket(bucket);
    telemetry_.bucket_launched(index, start);
    auto& collective = progress_[index].collective;
    if (comm_hook_) {
      collective = comm_hook_(static_cast<int64_t>(index), index + 1 == count, bucket.flat,
                              bucket.views, bucket.params);
    } else {
      // Named as in wait_for_bucket's error: a background failure (the NCCL watchdog) may be
      // raised by a later call, so the transport keeps the name of the bucket that failed.
      const std::string label =
          c10::str("bucket ", index, " of ", count, " (", bucket.params.size(), " parameters, ",
                   megabytes(bucket.bytes), ", first '", names_[bucket.params.front()], "')");
      collective = sharded_ ? transport_->reduce_scatter_sum(bucket.flat, label)
                            : transport_->allreduce_sum_labeled(bucket.flat, label);
    }
    health_.launched();  // after the launch: nothing is recorded for a refused one
    launched_this_step_ += 1;
    launched_bytes_this_step_ += bucket.bytes;
  }
}

// Note [One averaging arithmetic]
// Every transport sums; the average comes from scaling each gradient by
// 1/world_size in the copy into the bucket, in the gradient's dtype (fp32 for
// fp32 gradients), before any cast: DDP's arithmetic (at::mul_out(bucket_view,
// grad, 1/world_size)), so fp32 buckets are bit-identical to DDP's wherever the
// summation order is the same. A gradient that already is its bucket view
// (gradient_as_bucket_view) is divided in place, as DDP does. Never ncclAvg:
// it multiplies by 1/n after the sum, in the bucket's dtype (for bf16/fp16 a
// second rounding, and a +0.2 % bias at n = 3, 6, 12, 24).

// What pack_bucket multiplies gradients by so that the sum is the average:
// 1 when a communication hook averages (DDP's hooks divide themselves).
double Reducer::gradient_scale() const {
  if (comm_hook_) {
    return 1.0;
  }
  return 1.0 / static_cast<double>(gradient_divisor());
}

int64_t Reducer::gradient_divisor() const {
  return divide_factor_ > 0 ? divide_factor_ : world_size_;
}

// grads -> flat, scaled by gradient_scale() so that the sum is the average:
// one fused copy per bucket. See Note [Bucket copies].
void Reducer::pack_bucket(Bucket& bucket) {
  wait_for_gradient_streams(bucket);
  bucket.note_copy_stream();
  const double scale = gradient_scale();
  std::vector<CopyJob> jobs;
  jobs.reserve(bucket.params.size());
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    if (!packed_[bucket.params[slot]]) {
      add_pack_job(bucket, slot, scale, jobs);
    }
  }
  const CopyStats stats = health_.pack_stats();
  copy_launches_this_step_ += scaled_copy(jobs, scale, &stats);
}

// Note [Gradients from several streams]
// A bucket is packed by the hook of its last-ready gradient, on that hook's
// current stream; autograd runs each gradient's hook on the stream that
// produced it, so a bucket can hold gradients from several streams (forward
// ops issued on side streams). Packing must not read a gradient before its
// stream has written it: for each gradient produced on another stream than the
// packing one, an event recorded on that stream now (its work was enqueued
// before its hook ran, hence before now) is waited for by the packing stream.
// Recording at pack time instead of at the hook costs nothing when all
// gradients share one stream (the common case); at worst it also waits for
// later work of that stream: lost overlap, never a race.
void Reducer::wait_for_gradient_streams(const Bucket& bucket) {
  std::optional<c10::Stream> packing;  // the current stream of the bucket's device
  for (const int64_t index : bucket.params) {
    const auto& produced_on = grad_stream_[index];
    if (!produced_on) {
      continue;
    }
    if (!packing) {
      packing = c10::impl::getDeviceGuardImpl(produced_on->device_type())
                    ->getStream(produced_on->device());
    }
    if (*packing != *produced_on) {
      c10::Event produced(produced_on->device_type());
      produced.record(*produced_on);
      produced.block(*packing);
    }
  }
}

// The copy that puts the gradient of the parameter in `slot` into the bucket.
void Reducer::add_pack_job(Bucket& bucket, size_t slot, double scale, std::vector<CopyJob>& jobs) {
  const int64_t index = bucket.params[slot];
  at::Tensor& grad = params_[index].mutable_grad();
  const at::Tensor& view = bucket.views[slot];
  if (!grad.defined()) {
    jobs.push_back({at::Tensor(), view, index});  // an unused parameter contributes zeros
  } else if (grad.is_alias_of(view)) {
    if (scale != 1.0 && !view.is_cpu()) {
      jobs.push_back({view, view, index});  // scaled in place by the fused kernel (1 ulp of div_)
    } else {
      health_.observe_without_copy({view, view, index});
      if (scale != 1.0) {
        // gradient_as_bucket_view: divide in place, DDP's arithmetic (Note [One averaging arithmetic]).
        at::NoGradGuard no_grad;
        view.div_(gradient_divisor());
      }
    }
  } else {
    jobs.push_back({grad, view, index});
    if (options_.gradient_as_bucket_view && grad.scalar_type() == view.scalar_type()) {
      grad = view;  // from now on autograd accumulates straight into the bucket
    }
  }
}

// flat -> param.grad, for gradients that are not views of the bucket. Only the
// parameters `keep(index)` accepts get a gradient (find_unused_parameters).
template <typename Keep>
void Reducer::unpack_bucket(Bucket& bucket, Keep keep) {
  bucket.note_copy_stream();
  const CopyStats stats = health_.unpack_stats();
  std::vector<CopyJob> jobs;
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    const int64_t index = bucket.params[slot];
    if (!keep(index)) {
      continue;  // no rank used it: leave its gradient untouched, like DDP
    }
    at::Tensor& grad = params_[index].mutable_grad();
    const at::Tensor& view = bucket.views[slot];
    if (!grad.defined() && options_.gradient_as_bucket_view) {
      grad = view;
    } else if (!grad.defined()) {
      // A gradient this rank did not produce (another did): written by the same copy as the
      // others, in the gradient's own dtype (Note [Reduce dtype]), so that every rank's
      // statistics cover the same gradients (Note [Averages that overflow]).
      grad = at::empty_strided(view.sizes(), view.strides(), params_[index].options());
      jobs.push_back({view, grad, index});
      health_.observed(index);
    } else if (!grad.is_alias_of(view)) {
      jobs.push_back({view, grad, index});
      health_.observed(index);  // the copy below adds it to the norms
    }
    // A bucket view (gradient_as_bucket_view) has no copy to ride on: left unobserved, so
    // copy_norms() is nullopt and grad_norm() is torch's pass over param.grad.

  }
  copy_launches_this_step_ += scaled_copy(jobs, 1.0, &stats);
}

// ---------------------------------------------------------------------------
// End of backward
// ---------------------------------------------------------------------------

// DDP keeps its first layout for a bucket_cap_mb_list with
// find_unused_parameters (the ready order may change from step to step), and so
// does this reducer then; otherwise the first backward's order is used.
bool Reducer::rebuilds_after_first_step() const {
  return !(options_.ddp_first_layout && options_.find_unused_parameters);
}

// The global used map (find_unused_parameters), readable on the host: Note [Used map on the GPU].
at::Tensor Reducer::allreduce_used_map() {
  return unused_.allreduce_used_map(params_.front().device(), [this](at::Tensor& map) {
    auto pending = transport_->allreduce_sum(map);
    launched_this_step_ += 1;
    launched_bytes_this_step_ += map.numel() * map.element_size();
    try {
      pending->wait(options_.timeout);
    } catch (const std::exception& e) {
      wait_for_launched_quietly();
      TORCH_CHECK(false, "FusedReducer: all-reduce of the used-parameter map "
                  "(find_unused_parameters) over ", transport_->name(), " failed: ", e.what(),
                  ". A peer rank may have died.");
    }
  });
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ready_order_.empty()) {
    // A backward that reached the outputs but no parameter: the step goes on.
    // See Note [End of backward].
    callback_queued_ = false;
    return;
  }
  const double backward_end = now_us();
  expect_hooks_ = false;
  finished_since_forward_ = true;
  callback_queued_ = false;
  ended_with_unready_ = false;

  std::vector<int64_t> unready;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      unready.push_back(static_cast<int64_t>(i));
    }
  }

  if (!unready.empty() && !options_.find_unused_parameters) {
    // Either these parameters are unused, or this callback ended a nested
    // backward (reentrant checkpointing: torch.utils.checkpoint(...,
    // use_reentrant=True) runs its own backward inside the outer one) and the
    // enclosing backward will still reach them. Stay armed: the next hook
    // queues a callback on the enclosing backward. If no hook comes, the next
    // forward reports the unused parameters, as DDP does.
    expect_hooks_ = true;
    finished_since_forward_ = false;
    ended_with_unready_ = true;
    return;
  }

  at::Tensor globally_used;
  if (options_.find_unused_parameters) {
    for (int64_t index : unready) {
      decided_unused_[index] = 1;
    }
    finalized_graph_task_ = torch::autograd::get_current_graph_task_id();
    // Locally unused parameters contribute zeros; launch what they held back.
    for (int64_t index : unready) {
      progress_[layout_.bucket_index_of(index)].pending -= 1;
    }
    launch_ready_buckets();
    globally_used = allreduce_used_map();
  }
  TORCH_INTERNAL_ASSERT(next_to_launch_ == buckets().size(),
                        "every bucket must be launched by now");

  const int32_t* used = globally_used.defined() ? globally_used.data_ptr<int32_t>() : nullptr;
  if (used != nullptr && unused_.any_skipped()) {
    unused_.check_skipped_still_unused(used, stats_.step + 1, [this] { wait_for_launched_quietly(); });
  }
  while (next_to_unpack_ < buckets().size()) {
    finish_bucket(next_to_unpack_++, used, /*exposed=*/true);
  }

  unused_.clear_used();
  stats_.step += 1;
  stats_.allreduces = launched_this_step_;
  stats_.allreduce_bytes = launched_bytes_this_step_;
  stats_.health_exchanges = 0;  // counted by allreduce_health below, if this step exchanges
  stats_.health_exchange_bytes = 0;
  stats_.copy_launches = copy_launches_this_step_;
  record_step(backward_end, now_us());
  last_ready_order_ = ready_order_;
  if (!rebuilt_after_first_step_) {
    // The first backward showed the real ready order: lay buckets out by it.
    rebuilt_after_first_step_ = true;
    rebuild_pending_ = rebuilds_after_first_step();
    if (options_.skip_all_reduce_unused_params && used != nullptr) {
      unused_.decide_skipped(used);
      rebuild_pending_ = rebuild_pending_ || unused_.any_skipped();
    }
  }
  // Last: the step is complete, so the error it raises leaves a reducer ready for the next one.
  health_.end_step(step_end(), telemetry_);
}

// What the health exchange needs to know of the step that just ended.
HealthExchange::StepEnd Reducer::step_end() {
  HealthExchange::StepEnd end;
  end.step = stats_.step;
  end.sharded = sharded_;
  end.sharded_layout = layout_.in_force().sharded;
  end.ready_order = &ready_order_;
  end.reduction = [this] {
    const auto& dtype = options_.reduce_dtype;  // finalize may hold mutex_: no locking getter
    return comm_hook_ ? "the comm hook's reduction"
                      : (dtype ? c10::str("the reduction in ", dtype_name(*dtype), " (reduce_dtype)")
                               : std::string("the reduction"));
  };
  return end;
}

at::Tensor Reducer::allreduce_health(const at::Tensor& row, const char* what) {
  at::Tensor exchanged = row.to(params_.front().device());
  auto pending = transport_->allreduce_sum(exchanged);
  stats_.health_exchanges += 1;  // of the step that just completed, apart from its gradients'
  stats_.health_exchange_bytes += exchanged.numel() * exchanged.element_size();
  try {
    pending->wait(options_.timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "FusedReducer: the ", what, " (check_finite / straggler report) over ",
                transport_->name(), " failed: ", e.what(), ". A peer rank may have died; check "
                "the other ranks' logs.");
  }
  return exchanged.cpu();
}

// The step's timing, relative to its first hook, into the ring: Note [Step telemetry].
void Reducer::record_step(double backward_end, double finalize_end) {
  StepTiming step;
  step.step = stats_.step;
  step.bucket_caps_bytes = options_.bucket_caps_bytes;
  step.last_bucket_bytes = options_.last_bucket_bytes;
  step.reduce_dtype = layout_.in_force().reduce_dtype;  // of the layout this step ran with
  std::vector<char> reduced;
  for (const auto& bucket : buckets()) {
    reduced.push_back(!bucket.skipped);
  }
  telemetry_.record_step(std::move(step), reduced, backward_end, finalize_end,
                         !ready_order_.empty());
}

void Reducer::wait_for_bucket(size_t index) {
  if (!progress_[index].collective) {
    return;
  }
  auto collective = std::move(progress_[index].collective);
  const Bucket& bucket = buckets()[index];
  try {
    collective->wait(options_.timeout);
  } catch (const std::exception& e) {
    wait_for_launched_quietly();
    TORCH_CHECK(false, "FusedReducer: all-reduce of bucket ", index, " of ", buckets().size(),
                " (", bucket.params.size(), " parameters, ", megabytes(bucket.bytes),
                ", first '", names_[bucket.params.front()], "') over ", transport_->name(),
                " failed: ", e.what(),
                ". A peer rank may have died or stopped calling backward; check the other "
                "ranks' logs.");
  }
}

void Reducer::wait_for_launched_quietly() {
  for (auto& bucket : progress_) {
    if (bucket.collective) {
      try {
        bucket.collective->wait(options_.timeout);
      } catch (const std::exception&) {
        // Already failing; the first error is the one reported.
      }
      bucket.collective.reset();
    }
  }
}

// ---------------------------------------------------------------------------
// Forward: safe point for rebuilds
// ---------------------------------------------------------------------------

void Reducer::prepare_forward(bool will_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  telemetry_.forward_started();
  check_params_unchanged();
  if (ended_with_unready_ && !callback_queued_) {
    // The last backward ended before every parameter was ready. Buckets holding
    // them never completed: finish what was launched (every rank launched the
    // same prefix) and name the parameters.
    wait_for_launched_quietly();
    std::vector<int64_t> unready;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) {
        unready.push_back(static_cast<int64_t>(i));
      }
    }
    std::ostringstream msg;
    msg << "FusedReducer: expected every parameter to receive a gradient in the previous "
        << "backward, but " << unready.size() << " did not: " << describe_params(unready)
        << ". Their gradients were not averaged across ranks. " << kFindUnusedHint;
    reset_iteration();
    TORCH_CHECK(false, msg.str());
  }
  if (callback_queued_) {
    // A backward raised midway; drop what it left in flight.
    wait_for_launched_quietly();
    callback_queued_ = false;
  }
  if (rebuild_pending_) {
    // Limits set before the first step apply to it (no order observed yet:
    // reverse registration order, like the initial layout).
    layout_.rebuild_from_rank0(requested_limits(), observed_order(), unused_.skipped(), sharded_);
    // Every rank keeps rank 0's limits: Note [Persistent limits].
    const LayoutInForce& agreed = layout_.in_force();
    options_.bucket_caps_bytes = agreed.bucket_caps_bytes;
    options_.last_bucket_bytes = agreed.last_bucket_bytes;
    options_.reduce_dtype = agreed.reduce_dtype;
    rebuild_pending_ = false;
  }
  reset_iteration();
  expect_hooks_ = will_sync && sync_enabled_;
}

void Reducer::reset_iteration() {
  ready_.assign(params_.size(), 0);
  packed_.assign(params_.size(), 0);
  grad_stream_.assign(params_.size(), std::nullopt);
  ready_order_.clear();
  next_to_launch_ = 0;
  next_to_unpack_ = 0;
  launched_this_step_ = 0;
  launched_bytes_this_step_ = 0;
  copy_launches_this_step_ = 0;
  // A new step over the layout in force (a rebuild may have just changed it).
  progress_.clear();
  std::vector<int64_t> bytes;
  std::vector<int64_t> counts;
  for (const auto& bucket : buckets()) {
    progress_.push_back({static_cast<int64_t>(bucket.params.size()), nullptr});
    bytes.push_back(bucket.bytes);
    counts.push_back(static_cast<int64_t>(bucket.params.size()));
  }
  telemetry_.reset_iteration(bytes, counts);
  expect_hooks_ = false;
  finished_since_forward_ = false;
  ended_with_unready_ = false;
  decided_unused_.assign(params_.size(), 0);
  finalized_graph_task_ = -1;
}

LayoutLimits Reducer::requested_limits() const {
  return {options_.bucket_caps_bytes, options_.last_bucket_bytes, options_.reduce_dtype};
}

// The last observed ready order, completed with never-ready parameters in
// reverse registration order.
std::vector<int64_t> Reducer::observed_order() const {
  std::vector<int64_t> order = last_ready_order_;
  std::vector<char> seen(params_.size(), 0);
  for (int64_t index : order) {
    seen[index] = 1;
  }
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    if (!seen[i]) {
      order.push_back(i);
    }
  }
  return order;
}

// Casting or moving the model after construction would leave the buckets (and
// the hooks, which autograd drops with a new dtype) behind: refuse, like a
// user error, instead of reducing the wrong tensors.
void Reducer::check_params_unchanged() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& param = params_[i];
    const auto& expected = param_options_[i];
    TORCH_CHECK(param.scalar_type() == expected.dtype().toScalarType() &&
                    param.device() == expected.device(),
                "FusedReducer: parameter '", names_[i], "' is now ", param.scalar_type(), " on ",
                param.device(), " but was ", expected.dtype(), " on ", expected.device(),
                " when FusedReducer was constructed. Move or cast the model (.to(), .cuda(), "
                ".double(), ...) before wrapping it, as with DistributedDataParallel.");
  }
}

std::string Reducer::describe_params(const std::vector<int64_t>& indices) const {
  std::ostringstream out;
  const size_t shown = std::min<size_t>(indices.size(), 10);
  for (size_t i = 0; i < shown; ++i) {
    out << (i ? ", " : "") << "'" << names_[indices[i]] << "' (index " << indices[i] << ")";
  }
  if (indices.size() > shown) {
    out << " and " << indices.size() - shown << " more";
  }
  return out.str();
}

}  // namespace fused_reducer
