#include "reducer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "bucket_copy.h"
#include "process_group_transport.h"

namespace fused_reducer {
namespace {

constexpr const char* kFindUnusedHint =
    "If some parameters are legitimately unused in forward, construct FusedReducer with "
    "find_unused_parameters=True; otherwise make every forward output take part in the loss.";

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Note [Slot layout]
// Every parameter's slot in a bucket starts at a multiple of kSlotAlignBytes
// (padding is zeros and is reduced with the rest), so the fused copy kernel
// takes its 16-byte vector path for every slot, not only the first; the
// offsets depend only on the parameters' sizes, so they are identical on every
// rank. A slot has the parameter's own strides when the parameter is dense and
// non-overlapping (channels_last included, as in DDP), so a gradient that
// follows autograd's layout contract copies as one contiguous block, and
// gradient_as_bucket_view keeps the parameter's memory format.
constexpr int64_t kSlotAlignBytes = 16;

// Steady-clock microseconds. See Note [Step telemetry].
double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// How Python spells a dtype, for error messages.
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(type);
  }
}

// The rank-0 layout message carries the reduce dtype as an int64: -1 for none.
constexpr int64_t kNoReduceDtype = -1;

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

// Note [Bucket memory]
// CPU buckets are mapped from the kernel (anonymous mmap: zero-filled, unmapped when the last
// tensor using them goes), not taken from malloc. A rebuild then gives the old buckets' pages
// back to the system at once, and never disturbs glibc's heap: through malloc, freeing the first
// layout's buckets (each up to the cap) raised glibc's dynamic mmap threshold to their size, so
// the next layouts' buckets (and autograd's gradients of that size) came from the heap, where
// freed blocks stay resident (bench/memory_bench.py: three limit changes left 16-115 MiB more
// resident than before them on a 96 MiB-gradient model; tests/test_memory.py). Pages are
// touched only when written, as with DDP's at::empty buckets. Other devices keep their caching
// allocator.
at::Tensor allocate_flat(int64_t numel, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) {
    return at::zeros({numel}, options);
  }
  const size_t bytes = std::max<size_t>(
      1, static_cast<size_t>(numel) * c10::elementSize(options.dtype().toScalarType()));
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    return at::zeros({numel}, options);  // the allocator's own out-of-memory error, if any
  }
  return at::from_blob(data, {numel}, [bytes](void* p) { munmap(p, bytes); }, options);
}

}  // namespace

// Note [Reduce dtype]
// options_.reduce_dtype (FusedReducer(reduce_dtype=...), model.reduce_dtype)
// is the dtype every bucket of floating-point gradients holds; nullopt keeps
// each gradient's own dtype (integer or complex gradients always keep theirs).
// Groups stay one per (gradient dtype, device), so every job of a bucket has
// the same (gradient dtype, bucket dtype) pair and the pack is still one fused
// launch per bucket: the copy scales and casts in one pass (scale first, so an
// fp16 bucket holds grad / world_size and overflows only where that value
// itself is beyond fp16's range; and never ncclAvg into fp16, whose averaging
// would come after the cast). The unpack casts the reduced bucket back into
// param.grad in the gradient's own dtype. Bucket limits and bucket_sizes()
// count bytes of the bucket dtype: what the collective moves. Accumulation
// (no_sync) stays in param.grad, in its own dtype; the cast happens once, at
// the synchronised step. A gradient cannot be a view of a bucket of another
// dtype, so gradient_as_bucket_view with a reduce dtype other than a floating
// gradient's dtype is refused (check_bucket_view_dtypes). The reduce dtype
// follows the rules of the limits (Note [Persistent limits]): set between
// steps, applied by the next rebuild, kept by every later one, rank 0's value
// travels with the layout broadcast.

// Note [Persistent limits]
// DDP reads its first-bucket size once, and its rebuild uses a C++ constant,
// so changing it later has no effect. Here the limits live in options_ and
// every layout (the initial one, the automatic rebuild after the first step,
// and every rebuild a user asks for) is computed from them, so a value set by
// the user holds until it is set again. Rank 0's values travel with the
// layout broadcast, so ranks cannot disagree on them.

void check_reduce_dtype(std::optional<at::ScalarType> dtype) {
  if (!dtype || *dtype == at::kFloat || *dtype == at::kBFloat16 || *dtype == at::kHalf) {
    return;
  }
  TORCH_CHECK_VALUE(false, "FusedReducer: reduce_dtype=", dtype_name(*dtype),
                    " is not supported; accepted: torch.bfloat16, torch.float16, torch.float32, "
                    "or None (each gradient's own dtype)");
}

Reducer::Reducer(std::vector<at::Tensor> params,
                 std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> group,
                 at::Device control_device,
                 std::shared_ptr<Transport> transport,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      control_device_(control_device),
      transport_(std::move(transport)),
      options_(options),
      rank_(group_->getRank()),
      world_size_(group_->getSize()),
      health_(options_.health, rank_, world_size_) {
  TORCH_CHECK(!params_.empty(), "FusedReducer: the module has no trainable parameters");
  TORCH_CHECK(params_.size() == names_.size(), "FusedReducer: one name per parameter expected");
  check_bucket_caps(options_.bucket_caps_bytes);
  check_last_bucket_bytes(options_.last_bucket_bytes);
  check_reduce_dtype(options_.reduce_dtype);

  // One bucket group per (dtype, device), numbered in registration order.
  std::map<std::pair<int, std::string>, int64_t> groups;
  for (const auto& p : params_) {
    auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
    auto it = groups.emplace(key, static_cast<int64_t>(groups.size())).first;
    infos_.push_back({static_cast<int64_t>(p.numel() * p.element_size()), it->second});
    param_options_.push_back(p.options());
  }
  check_bucket_view_dtypes(options_.reduce_dtype);
  locally_used_.assign(params_.size(), 0);
  copy_at_hook_ = !params_.front().is_cuda();
  const auto device = params_.front().device();
  if (options_.health.check_finite) {
    nonfinite_ = at::zeros({static_cast<int64_t>(params_.size())},
                           at::TensorOptions().dtype(at::kLong).device(device));
  }
  norms_ = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device));
  observed_.assign(params_.size(), 0);

  // Before any gradient was seen, expect them in reverse registration order.
  std::vector<int64_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = static_cast<int64_t>(order.size() - 1 - i);
  }
  if (options_.ddp_first_layout) {
    std::reverse(order.begin(), order.end());
    auto assignment = assign(order);
    std::reverse(assignment.begin(), assignment.end());
    build_buckets(assignment);
  } else {
    build_buckets(assign(order));
  }
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
      locally_used_[index] = 1;
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
  const double now = now_us();
  if (ready_order_.empty()) {
    step_origin_ = now;
    // This step's statistics start here (Note [Statistics from the copy]).
    if (nonfinite_.defined()) nonfinite_.zero_();
    norms_.zero_();
    norms_valid_ = false;
    std::fill(observed_.begin(), observed_.end(), 0);
  }
  ready_[index] = 1;
  if (grad.defined()) {
    locally_used_[index] = 1;
    if (!grad.is_cpu()) {
      grad_stream_[index] = c10::impl::getDeviceGuardImpl(grad.device().type())->getStream(grad.device());
    }
  }
  ready_order_.push_back(index);
  ready_time_[index] = now;
  Bucket& bucket = buckets_[bucket_of_[index]];
  if (std::isnan(bucket.timing.ready_first_us)) {
    bucket.timing.ready_first_us = now;
  }
  bucket.timing.ready_last_us = now;
  if (copy_at_hook_) {
    // See Note [Copy at the hook].
    std::vector<CopyJob> jobs;
    add_pack_job(bucket, static_cast<size_t>(slot_of_[index]), gradient_scale(), jobs);
    const CopyStats stats = pack_stats();
    scaled_copy(jobs, gradient_scale(), &stats);
    packed_[index] = 1;
  }
  if (--bucket.pending == 0) {
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
    Bucket& bucket = buckets_[next_to_unpack_];
    if (bucket.collective && !bucket.collective->completed()) {
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
  if (!buckets_[index].skipped) {
    record_slack_event(/*complete=*/true);
  }
  BucketTiming& timing = buckets_[index].timing;
  timing.complete_us = now_us();
  timing.wait_us = exposed ? timing.complete_us - start : 0.0;
  if (sharded_) {
    release_local_gradients(buckets_[index]);
    return;
  }
  unpack_bucket(buckets_[index], [used](int64_t param) { return used == nullptr || used[param] != 0; });
}

// Note [Sharded mode]
// With a ShardedOptimizer (python/fused_reducer/sharded.py) each bucket is
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
// param.grad becomes a placeholder instead (python/fused_reducer/reducer.py,
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
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    Bucket& bucket = buckets_[next_to_launch_++];
    if (bucket.skipped) {
      bucket.timing.launch_us = now_us();
      continue;  // no collective: see Note [Skipping unused parameters]
    }
    const double start = now_us();
    pack_bucket(bucket);
    bucket.timing.launch_us = now_us();
    bucket.timing.pack_us = bucket.timing.launch_us - start;
    if (comm_hook_) {
      const auto index = static_cast<int64_t>(next_to_launch_ - 1);
      bucket.collective = comm_hook_(index, next_to_launch_ == buckets_.size(), bucket.flat,
                                     bucket.views, bucket.params);
    } else {
      // Named as in wait_for_bucket's error: a background failure (the NCCL watchdog) may be
      // raised by a later call, so the transport keeps the name of the bucket that failed.
      const std::string label =
          c10::str("bucket ", next_to_launch_ - 1, " of ", buckets_.size(), " (",
                   bucket.params.size(), " parameters, ", megabytes(bucket.bytes), ", first '",
                   names_[bucket.params.front()], "')");
      bucket.collective = sharded_ ? transport_->reduce_scatter_sum(bucket.flat, label)
                                   : transport_->allreduce_sum_labeled(bucket.flat, label);
    }
    record_slack_event(/*complete=*/false);  // after the launch: nothing is recorded for a refused one
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
  note_copy_stream(bucket);
  const double scale = gradient_scale();
  std::vector<CopyJob> jobs;
  jobs.reserve(bucket.params.size());
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    if (!packed_[bucket.params[slot]]) {
      add_pack_job(bucket, slot, scale, jobs);
    }
  }
  const CopyStats stats = pack_stats();
  copy_launches_this_step_ += scaled_copy(jobs, scale, &stats);
}

CopyStats Reducer::pack_stats() const {
  CopyStats stats;
  stats.nonfinite = nonfinite_;  // undefined without check_finite
  return stats;
}

CopyStats Reducer::unpack_stats() const {
  CopyStats stats;
  stats.norms = norms_;
  return stats;
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

// Note [Releasing GPU buckets]
// A GPU bucket is allocated on the stream current at its build, and the caching
// allocator hands its memory out again on that stream as soon as the bucket is
// freed (a rebuild drops the old layout). Its collective's stream is recorded
// by the transport; but the pack and the unpack run on the hooks' and the
// finalize's current streams, which need not be the allocation stream (a
// backward run under torch.cuda.stream(s)). So each bucket remembers the
// streams its copies ran on, and a rebuild records them on the old buffer
// (record_stream), with the rebuild's own stream (it copies gradient views out
// of it): the memory is reused only after those copies are done on the GPU.
void Reducer::note_copy_stream(Bucket& bucket) {
  if (bucket.flat.is_cpu()) {
    return;  // host copies are complete when they return
  }
  const c10::Stream current = c10::impl::getDeviceGuardImpl(bucket.flat.device().type())
                                  ->getStream(bucket.flat.device());
  if (std::find(bucket.copy_streams.begin(), bucket.copy_streams.end(), current) ==
      bucket.copy_streams.end()) {
    bucket.copy_streams.push_back(current);
  }
}

void Reducer::release_after_copies(Bucket& bucket) {
  if (!bucket.flat.defined() || bucket.flat.is_cpu()) {
    return;
  }
  note_copy_stream(bucket);  // the rebuild's stream
  for (const c10::Stream& stream : bucket.copy_streams) {
    bucket.flat.record_stream(stream);
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
      if (nonfinite_.defined()) {
        observe_with_aten({view, view, index}, pack_stats());  // no copy to ride on
      }
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
  note_copy_stream(bucket);
  const CopyStats stats = unpack_stats();
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
      observed_[index] = 1;
    } else if (!grad.is_alias_of(view)) {
      jobs.push_back({view, grad, index});
      observed_[index] = 1;  // the copy below adds it to norms_
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
void Reducer::decide_skipped(const int32_t* globally_used) {
  skipped_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    skipped_[i] = globally_used[i] == 0;
  }
}

void Reducer::check_skipped_still_unused(const int32_t* globally_used) {
  for (size_t i = 0; i < skipped_.size(); ++i) {
    if (skipped_[i] && globally_used[i] != 0) {
      wait_for_launched_quietly();
      TORCH_CHECK(false, "FusedReducer: parameter '", names_[i], "' was unused on every rank in "
                  "the first step, so skip_all_reduce_unused_params=True stopped reducing it, "
                  "but a rank used it in step ", stats_.step + 1, ": its gradient would not be "
                  "averaged. skip_all_reduce_unused_params=True needs the unused parameters to "
                  "stay the same for the whole training (as in DDP); construct with "
                  "skip_all_reduce_unused_params=False.");
    }
  }
}

// The global used map (find_unused_parameters), readable on the host: Note [Used map on the GPU].
at::Tensor Reducer::allreduce_used_map() {
  auto result = used_map_exchange_.exchange(
      locally_used_, params_.front().device(), [this](at::Tensor& map) {
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
  used_map_ = result.device;
  return result.host;
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
      buckets_[bucket_of_[index]].pending -= 1;
    }
    launch_ready_buckets();
    globally_used = allreduce_used_map();
  }
  TORCH_INTERNAL_ASSERT(next_to_launch_ == buckets_.size(), "every bucket must be launched by now");

  const int32_t* used = globally_used.defined() ? globally_used.data_ptr<int32_t>() : nullptr;
  if (used != nullptr && !skipped_.empty()) {
    check_skipped_still_unused(used);
  }
  while (next_to_unpack_ < buckets_.size()) {
    finish_bucket(next_to_unpack_++, used, /*exposed=*/true);
  }
  snapshot_gradients();

  std::fill(locally_used_.begin(), locally_used_.end(), 0);
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
      decide_skipped(used);
      rebuild_pending_ = rebuild_pending_ ||
                         std::find(skipped_.begin(), skipped_.end(), 1) != skipped_.end();
    }
  }
  // Last: the step is complete, so the error below leaves a reducer ready for the next one.
  const std::string nonfinite = exchange_health(/*joined=*/false);
  if (!nonfinite.empty()) {
    if (nonfinite_handler_) {
      nonfinite_handler_(nonfinite);  // raises
    }
    TORCH_CHECK(false, nonfinite);
  }
}

// ---------------------------------------------------------------------------
// Training health (training_health.h)
// ---------------------------------------------------------------------------

// What copy_norms() compares param.grad with: the tensors this step left there.
void Reducer::snapshot_gradients() {
  norms_valid_ = !sharded_;
  grad_snapshot_.assign(params_.size(), {nullptr, 0});
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (!grad.defined()) {
      continue;
    }
    if (!observed_[i]) {
      norms_valid_ = false;  // a gradient no rank produced this step, kept as it was
    }
    grad_snapshot_[i] = {grad.unsafeGetTensorImpl(), grad._version()};
  }
  // Only for a model whose norm was asked for (copy_norms): nothing for one that never is.
  grad_probes_taken_ = norms_valid_ && probes_wanted_;
  grad_probes_ = grad_probes_taken_ ? gradient_probes() : at::Tensor();
}

// Three elements of each gradient (the first, the middle and one of the last two in memory),
// copied: some in-place changes leave the version counter as it was (GradScaler.unscale_,
// whose fused kernel does not bump it; a change through .data; a collective on param.grad),
// but a change to the whole gradient (a scale, new values) shows in them; one to a few
// elements may not. No pass over the gradients: one small gather per step, once the model's
// norm has been asked for.
at::Tensor Reducer::gradient_probes() const {
  std::vector<at::Tensor> probes;
  for (const at::Tensor& param : params_) {
    const at::Tensor& grad = param.grad();
    if (!grad.defined() || grad.numel() == 0 || !grad.is_non_overlapping_and_dense()) {
      continue;  // left to the version counter
    }
    const int64_t spread = (grad.numel() - 1) / 2;
    probes.push_back(grad.detach().as_strided({3}, {spread}, grad.storage_offset()));
  }
  return probes.empty() ? at::Tensor() : at::cat(probes);
}

std::optional<at::Tensor> Reducer::copy_norms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  probes_wanted_ = true;  // from the next backward on; this one kept none: torch's norm
  if (!norms_valid_ || !grad_probes_taken_) {
    return std::nullopt;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    const void* impl = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
    if (impl != grad_snapshot_[i].first || (impl != nullptr && grad._version() != grad_snapshot_[i].second)) {
      return std::nullopt;  // changed since: clipped, unscaled, accumulated, replaced
    }
  }
  if (grad_probes_.defined()) {
    const at::Tensor now = gradient_probes();
    if (!now.defined() || !at::equal(now, grad_probes_)) {
      return std::nullopt;  // changed without a version bump (unequal also where NaN)
    }
  }
  return norms_.clone();
}

// See Note [Lateness from slack]: from the last reduced bucket being ready to its
// collective being seen complete. On CPU both are host clock readings of this step. On a
// GPU the host runs ahead of the device, so its clock says when work was queued, not done:
// Note [Lateness from slack on the GPU]. `exchanging`: this step exchanges the health row.
std::vector<double> Reducer::take_slack_samples(bool exchanging) {
  if (params_.front().is_cpu()) {
    const double forward_ms = std::exchange(forward_sync_ms_, 0.0);
    for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
      if (!it->skipped && !std::isnan(it->timing.ready_last_us)) {
        return {forward_ms + (it->timing.complete_us - it->timing.ready_last_us) / 1000.0};
      }
    }
    return {};
  }
  // Note [Lateness from slack on the GPU]
  // The same slack on the device's own clock: a timing event on the compute stream after the
  // last launched bucket's copy (its gradients ready on the GPU), another after the stream
  // waited for its collective (complete on the GPU); their elapsed time is the slack. Reading
  // it needs both events done, and backward does not wait for the device: each step records
  // into the next of kSlackSlots pairs, and every step reads the pairs the device has finished
  // (a query, no wait), oldest first. A step that exchanges the health row first waits for its
  // own pair: the exchange reads its result back to the host anyway (Note [Health exchange]),
  // which waits for the same work. A pair still unread when its slot comes round again (the
  // host kSlackSlots steps ahead) is dropped; the report is a median over the samples.
  std::vector<double> samples;
  if (exchanging && slack_events_[slack_slot_].recorded) {
    slack_events_[slack_slot_].complete->synchronize();
  }
  for (size_t age = 1; age <= kSlackSlots; ++age) {
    SlackEvents& events = slack_events_[(slack_slot_ + age) % kSlackSlots];  // oldest first
    if (events.recorded && events.ready->query() && events.complete->query()) {
      double forward_ms = 0;  // recorded before the pair: done too, but never read undone
      for (size_t k = 0; k < events.forward_recorded; ++k) {
        auto& [begin, end] = events.forward[k];
        if (begin->query() && end->query()) forward_ms += begin->elapsedTime(*end);
      }
      samples.push_back(forward_ms + events.ready->elapsedTime(*events.complete));
      events.recorded = false;
    }
  }
  slack_slot_ = (slack_slot_ + 1) % kSlackSlots;
  slack_events_[slack_slot_].recorded = false;  // overwritten from now on
  slack_events_[slack_slot_].forward_recorded = 0;
  return samples;
}

bool Reducer::slack_on_device() const {
  return !params_.front().is_cpu() && health_.options().straggler_interval > 0;
}

// The forward's collectives (buffer broadcast, join's all-reduces) are where a rank waits
// for one that is late before its forward (data loading) whenever the model has buffers or
// joins: the buckets then find every rank in step. So the waits there count into the step's
// slack, each collective bracketed alone (local work between them would hide a rank slow in
// it), summed over the step's forwards (no_sync micro-steps too): the host clock on CPU (the
// collectives block), a pair of timing events on the compute stream on a GPU (in the step's
// slot, Note [Lateness from slack on the GPU]).
void Reducer::begin_forward_sync() {
  forward_sync_open_ = true;
  if (!slack_on_device()) {
    forward_sync_begin_us_ = now_us();
    return;
  }
  SlackEvents& events = slack_events_[slack_slot_];
  if (events.forward.size() == events.forward_recorded) events.forward.emplace_back();
  record_stream_event(events.forward[events.forward_recorded].first);
}

void Reducer::end_forward_sync() {
  if (!std::exchange(forward_sync_open_, false)) {
    return;  // no begin (or the collective between raised): nothing to close
  }
  if (!slack_on_device()) {
    forward_sync_ms_ += (now_us() - forward_sync_begin_us_) / 1000.0;
    return;
  }
  SlackEvents& events = slack_events_[slack_slot_];
  record_stream_event(events.forward[events.forward_recorded].second);
  events.forward_recorded += 1;
}

void Reducer::record_stream_event(std::optional<c10::Event>& event) const {
  const at::Tensor& first = params_.front();
  if (!event) {
    event.emplace(first.device().type(), c10::EventFlag::BACKEND_DEFAULT);  // timing enabled
  }
  const auto* guard = c10::impl::getDeviceGuardImpl(first.device().type());
  event->record(guard->getStream(first.device()));
}

// Records this step's ready (after a bucket's launch) or complete (after a bucket's wait)
// event on the current stream; the last of each in a step is what take_slack_samples
// reads. GPU only, and only when the straggler exchange is on.
void Reducer::record_slack_event(bool complete) {
  if (!slack_on_device()) {
    return;
  }
  SlackEvents& events = slack_events_[slack_slot_];
  record_stream_event(complete ? events.complete : events.ready);
  events.recorded = complete && events.ready.has_value();
}

// Note [Health exchange]
// After the gradients are written, every rank all-reduces one small float64 row per rank
// (training_health.h: its non-finite count, median slack and step time, zeros in the
// others' entries) over the buckets' transport: every step with check_finite, every
// straggler_interval steps otherwise (every rank counts the same steps, joined ranks
// included, so all issue the same collectives). Only when a count is non-zero, a second
// row names the parameters. Returns the check_finite error, the same text on every rank.
std::string Reducer::exchange_health(bool joined) {
  const bool due = joined ? health_.shadow_step()
                          : health_.end_step(take_slack_samples(health_.next_step_exchanges()),
                                             (now_us() - forward_time_) / 1000.0);
  if (!due) {
    return "";
  }
  int64_t nonfinite = 0;
  std::vector<int64_t> counts;
  if (nonfinite_.defined() && !joined) {
    const at::Tensor host = nonfinite_.cpu();  // the end of backward: the one host sync
    counts.assign(host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel());
    for (const int64_t count : counts) nonfinite += count;
  }
  const at::Tensor rows = allreduce_health(health_.row(nonfinite, joined), "health exchange");
  if (health_.options().straggler_interval > 0) {
    health_.update_stragglers(rows);
    if (!history_.empty() && !joined) {
      history_.back().lateness_ms = health_.report().lateness_ms;
    }
  }
  if (TrainingHealth::total_nonfinite(rows) == 0) {
    return joined ? "" : averaged_nonfinite_message();
  }
  if (counts.empty()) counts.assign(params_.size(), 0);
  const at::Tensor detail = allreduce_health(health_.detail_row(counts, ready_order_),
                                             "non-finite gradient report");
  return health_.nonfinite_message(rows, detail, names_, stats_.step, sharded_layout_);
}

// Note [Averages that overflow]
// check_finite counts each rank's local gradients on their way into the buckets, yet an
// average can come out non-finite from finite ones when the reduction overflows (a float16
// reduce_dtype or a compressing comm hook: sums beyond 65504). The unpack into param.grad
// sums |x| of what it writes (norms_, Note [Statistics from the copy]), so that is seen for
// free wherever the unpack copies (also a gradient this rank did not produce, so every rank
// observes the same ones), and then confirmed on param.grad. The averages are the same on
// every rank, so every rank comes to the same verdict without an exchange. Not seen: gradient_as_bucket_view (no copy
// out of the bucket) and a ShardedOptimizer's shards (documented).
std::string Reducer::averaged_nonfinite_message() const {
  if (!nonfinite_.defined() || std::isfinite(norms_.cpu().const_data_ptr<double>()[1])) {
    return "";
  }
  std::vector<std::pair<std::string, int64_t>> found;  // the error path: a pass over param.grad
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (observed_[i] && grad.defined()) {
      const int64_t count = at::logical_not(at::isfinite(grad)).sum().item<int64_t>();
      if (count > 0) found.emplace_back(names_[i], count);
    }
  }
  if (found.empty()) {
    return "";  // the CUDA kernel sums |x| in float: finite values can add up past its range
  }
  const auto& dtype = options_.reduce_dtype;  // finalize may hold mutex_: no locking getter
  const std::string reduction =
      comm_hook_ ? "the comm hook's reduction"
                 : (dtype ? c10::str("the reduction in ", dtype_name(*dtype), " (reduce_dtype)")
                          : std::string("the reduction"));
  return health_.averaged_nonfinite_message(found, stats_.step, reduction);
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

void Reducer::set_nonfinite_handler(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  nonfinite_handler_ = std::move(handler);
}

StragglerReport Reducer::straggler_report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return health_.report();
}

std::string Reducer::take_straggler_warning() {
  std::lock_guard<std::mutex> lock(mutex_);
  return health_.take_warning();
}

void Reducer::shadow_health_exchange() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.health_exchanges = 0;
  stats_.health_exchange_bytes = 0;
  exchange_health(/*joined=*/true);
}

// Turns this iteration's absolute times into a StepTiming relative to the
// first hook and keeps it in the ring. See Note [Step telemetry].
void Reducer::record_step(double backward_end, double finalize_end) {
  const double origin = ready_order_.empty() ? backward_end : step_origin_;
  StepTiming step;
  step.step = stats_.step;
  step.origin_us = origin;
  step.forward_us = forward_time_ - origin;
  step.backward_end_us = backward_end - origin;
  step.finalize_end_us = finalize_end - origin;
  step.bucket_caps_bytes = options_.bucket_caps_bytes;
  step.last_bucket_bytes = options_.last_bucket_bytes;
  step.reduce_dtype = stats_.reduce_dtype;  // of the layout this step ran with
  std::vector<std::pair<double, double>> busy;  // [launch, complete] per bucket
  for (const auto& bucket : buckets_) {
    BucketTiming t = bucket.timing;
    t.ready_first_us -= origin;
    t.ready_last_us -= origin;
    t.launch_us -= origin;
    t.complete_us -= origin;
    step.exposed_wait_us += t.wait_us;
    if (!bucket.skipped) {
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

  last_ready_time_.assign(params_.size(), kNaN);
  for (size_t i = 0; i < params_.size(); ++i) {
    last_ready_time_[i] = ready_time_[i] - origin;
  }
  history_.push_back(std::move(step));
  while (history_.size() > trace_capacity_) {
    history_.pop_front();
  }
}

void Reducer::wait_for_bucket(size_t index) {
  Bucket& bucket = buckets_[index];
  if (!bucket.collective) {
    return;
  }
  auto collective = std::move(bucket.collective);
  try {
    collective->wait(options_.timeout);
  } catch (const std::exception& e) {
    wait_for_launched_quietly();
    TORCH_CHECK(false, "FusedReducer: all-reduce of bucket ", index, " of ", buckets_.size(),
                " (", bucket.params.size(), " parameters, ", megabytes(bucket.bytes),
                ", first '", names_[bucket.params.front()], "') over ", transport_->name(),
                " failed: ", e.what(),
                ". A peer rank may have died or stopped calling backward; check the other "
                "ranks' logs.");
  }
}

void Reducer::wait_for_launched_quietly() {
  for (auto& bucket : buckets_) {
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
  forward_time_ = now_us();
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
    rebuild_from_rank0();
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
  ready_time_.assign(params_.size(), kNaN);
  for (auto& bucket : buckets_) {
    bucket.pending = static_cast<int64_t>(bucket.params.size());
    bucket.collective.reset();
    bucket.timing = BucketTiming{};
    bucket.timing.bytes = bucket.bytes;
    bucket.timing.params = static_cast<int64_t>(bucket.params.size());
    bucket.timing.ready_first_us = kNaN;
    bucket.timing.ready_last_us = kNaN;
  }
  expect_hooks_ = false;
  finished_since_forward_ = false;
  ended_with_unready_ = false;
  decided_unused_.assign(params_.size(), 0);
  finalized_graph_task_ = -1;
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

// Rank 0 decides the layout inputs (its limits and its observed order) and
// broadcasts them; every rank then runs the same deterministic assignment on
// parameters whose sizes were verified equal at construction.
void Reducer::rebuild_from_rank0() {
  // The message has the same length on every rank whatever their lists:
  // [number of caps, last, reduce dtype, caps padded to `count`, order]. A
  // group has at most `count` buckets, so later entries of a list never apply.
  const auto count = static_cast<int64_t>(params_.size());
  constexpr int64_t kHeader = 3;
  const int64_t ncaps =
      std::min<int64_t>(static_cast<int64_t>(options_.bucket_caps_bytes.size()), count);
  at::Tensor message = at::zeros({kHeader + 2 * count}, at::kLong);
  auto* data = message.data_ptr<int64_t>();
  data[0] = ncaps;
  data[1] = options_.last_bucket_bytes;
  data[2] = options_.reduce_dtype ? static_cast<int64_t>(*options_.reduce_dtype) : kNoReduceDtype;
  std::copy(options_.bucket_caps_bytes.begin(), options_.bucket_caps_bytes.begin() + ncaps,
            data + kHeader);
  const auto order = observed_order();
  std::copy(order.begin(), order.end(), data + kHeader + count);

  std::vector<at::Tensor> tensors{message.to(control_device_)};
  c10d::BroadcastOptions broadcast;
  broadcast.rootRank = 0;
  auto work = group_->broadcast(tensors, broadcast);
  try {
    work->wait(options_.timeout);
    release_work(std::move(work));  // See Note [Releasing process-group work]
  } catch (const std::exception& e) {
    release_work(std::move(work));
    TORCH_CHECK(false, "FusedReducer: broadcasting the rebuilt bucket layout from rank 0 failed: ",
                e.what(), ". A peer rank may have died.");
  }
  message = tensors[0].cpu();
  data = message.data_ptr<int64_t>();
  options_.bucket_caps_bytes.assign(data + kHeader, data + kHeader + data[0]);
  options_.last_bucket_bytes = data[1];
  options_.reduce_dtype = data[2] == kNoReduceDtype
                              ? std::nullopt
                              : std::optional<at::ScalarType>(static_cast<at::ScalarType>(data[2]));
  build_buckets(assign(std::vector<int64_t>(data + kHeader + count, data + kHeader + 2 * count)));
  rebuild_pending_ = false;
  stats_.rebuilds += 1;
}

// The dtype of parameter `index`'s slot: the reduce dtype for floating-point
// gradients when one is set, else the gradient's own. See Note [Reduce dtype].
at::ScalarType Reducer::bucket_dtype(int64_t index) const {
  const at::ScalarType type = params_[index].scalar_type();
  if (options_.reduce_dtype && at::isFloatingType(type)) {
    return *options_.reduce_dtype;
  }
  return type;
}

// gradient_as_bucket_view: param.grad becomes a view of its slot, which needs
// the slot to have the gradient's dtype.
void Reducer::check_bucket_view_dtypes(std::optional<at::ScalarType> dtype) const {
  if (!options_.gradient_as_bucket_view || !dtype) {
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::ScalarType type = params_[i].scalar_type();
    TORCH_CHECK_VALUE(
        !at::isFloatingType(type) || type == *dtype,
        "FusedReducer: gradient_as_bucket_view=True needs buckets in the gradients' own dtype, "
        "but reduce_dtype=", dtype_name(*dtype), " differs from the dtype of parameter '",
        names_[i], "' (", dtype_name(type), "): a ", dtype_name(type),
        " gradient cannot be a view of a ", dtype_name(*dtype), " bucket. Use "
        "gradient_as_bucket_view=False, or reduce_dtype=None or ", dtype_name(type), ".");
  }
}

std::vector<std::vector<int64_t>> Reducer::assign(const std::vector<int64_t>& order) {
  // Bucket limits count bytes of the bucket dtype (what the collective moves).
  for (size_t i = 0; i < params_.size(); ++i) {
    infos_[i].bytes = params_[i].numel() *
                      static_cast<int64_t>(c10::elementSize(bucket_dtype(static_cast<int64_t>(i))));
  }
  // Skipped parameters get buckets of their own: Note [Skipping unused parameters].
  std::vector<TensorInfo> infos = infos_;
  for (size_t i = 0; i < skipped_.size(); ++i) {
    infos[i].group = 2 * infos[i].group + (skipped_[i] ? 1 : 0);
  }
  return assign_buckets(infos, order, {options_.bucket_caps_bytes, options_.last_bucket_bytes});
}

void Reducer::build_buckets(const std::vector<std::vector<int64_t>>& assignment) {
  for (Bucket& old : buckets_) {
    release_after_copies(old);  // Note [Releasing GPU buckets]
  }
  if (!options_.gradient_as_bucket_view) {
    // Nothing lives in the old buckets between steps (the gradients are in param.grad): release
    // them before making the new ones, so a rebuild needs no more memory than a step. With
    // gradient_as_bucket_view the gradients are views of them, moved into the new buckets below
    // (both layouts exist for that moment, as in DDP's rebuild). See Note [Bucket memory].
    buckets_.clear();
  }
  std::vector<Bucket> buckets(assignment.size());
  bucket_of_.assign(params_.size(), -1);
  slot_of_.assign(params_.size(), -1);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.params = assignment[b];
    const auto& first = params_[bucket.params.front()];
    const at::ScalarType dtype = bucket_dtype(bucket.params.front());
    // See Note [Slot layout].
    const int64_t align =
        std::max<int64_t>(1, kSlotAlignBytes / static_cast<int64_t>(c10::elementSize(dtype)));
    std::vector<int64_t>& offsets = bucket.offsets;
    int64_t numel = 0;
    for (int64_t index : bucket.params) {
      offsets.push_back(numel);
      numel += (params_[index].numel() + align - 1) / align * align;
    }
    if (sharded_) {
      // Equal shards, each starting on a slot boundary: Note [Sharded mode].
      const int64_t shard = (numel + world_size_ * align - 1) / (world_size_ * align) * align;
      numel = shard * world_size_;
    }
    bucket.flat = allocate_flat(numel, first.options().dtype(dtype).requires_grad(false));
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const int64_t index = bucket.params[slot];
      const auto& param = params_[index];
      bucket.views.push_back(
          param.is_non_overlapping_and_dense()
              ? bucket.flat.as_strided(param.sizes(), param.strides(), offsets[slot])
              : bucket.flat.narrow(0, offsets[slot], param.numel()).view(param.sizes()));
      bucket.bytes += infos_[index].bytes;
      bucket_of_[index] = static_cast<int64_t>(b);
      slot_of_[index] = static_cast<int64_t>(slot);
      if (options_.gradient_as_bucket_view) {
        // Move existing gradients into the new buffer so param.grad stays a view.
        at::Tensor& grad = params_[index].mutable_grad();
        if (grad.defined()) {
          bucket.views.back().copy_(grad);
          grad = bucket.views.back();
        }
      }
    }
    bucket.pending = static_cast<int64_t>(bucket.params.size());
    bucket.skipped = !skipped_.empty() && skipped_[bucket.params.front()];
  }
  buckets_ = std::move(buckets);
  sharded_layout_ = sharded_;
  stats_.bucket_caps_bytes = options_.bucket_caps_bytes;
  stats_.last_bucket_bytes = options_.last_bucket_bytes;
  stats_.reduce_dtype = options_.reduce_dtype;
}

// ---------------------------------------------------------------------------
// Settings and introspection
// ---------------------------------------------------------------------------

void Reducer::set_bucket_caps_bytes(std::vector<int64_t> caps) {
  check_bucket_caps(caps);
  std::lock_guard<std::mutex> lock(mutex_);
  options_.bucket_caps_bytes = std::move(caps);
  rebuild_pending_ = true;
}

// A one-entry list [c] means [c, c]: setting the first limit or the cap of it
// keeps the other at c.
void Reducer::set_first_bucket_bytes(int64_t bytes) {
  check_bucket_bytes("first_bucket_bytes", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& caps = options_.bucket_caps_bytes;
  if (caps.size() == 1) {
    caps.push_back(caps.front());
  }
  caps.front() = bytes;
  rebuild_pending_ = true;
}

void Reducer::set_bucket_cap_bytes(int64_t bytes) {
  check_bucket_bytes("bucket_cap_bytes", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& caps = options_.bucket_caps_bytes;
  if (caps.size() == 1) {
    caps.push_back(caps.front());
  }
  caps.back() = bytes;
  rebuild_pending_ = true;
}

void Reducer::set_last_bucket_bytes(int64_t bytes) {
  check_last_bucket_bytes(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  options_.last_bucket_bytes = bytes;
  rebuild_pending_ = true;
}

void Reducer::set_reduce_dtype(std::optional<at::ScalarType> dtype) {
  check_reduce_dtype(dtype);
  check_bucket_view_dtypes(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  options_.reduce_dtype = dtype;
  rebuild_pending_ = true;
}

std::optional<at::ScalarType> Reducer::reduce_dtype() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.reduce_dtype;
}

int64_t Reducer::last_bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.last_bucket_bytes;
}

std::vector<int64_t> Reducer::bucket_caps_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_caps_bytes;
}

int64_t Reducer::first_bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_caps_bytes.front();
}

int64_t Reducer::bucket_cap_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_caps_bytes.back();
}

void Reducer::request_rebuild() {
  std::lock_guard<std::mutex> lock(mutex_);
  rebuild_pending_ = true;
}

void Reducer::set_sync_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_enabled_ = enabled;
}

void Reducer::set_divide_factor(int64_t ranks) {
  TORCH_CHECK(ranks >= 0 && ranks <= world_size_, "FusedReducer: divide factor must be between 1 "
              "and the world size (", world_size_, "), or 0 for the world size; got ", ranks);
  std::lock_guard<std::mutex> lock(mutex_);
  divide_factor_ = ranks;
}

void Reducer::set_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!sharded_ || !hook, "FusedReducer: a communication hook replaces the all-reduce, "
              "but a ShardedOptimizer reduce-scatters the buckets; use one or the other");
  comm_hook_ = std::move(hook);
}

void Reducer::set_sharded(bool sharded) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (sharded == sharded_) {
    return;
  }
  TORCH_CHECK(!sharded || !comm_hook_, "FusedReducer: a ShardedOptimizer reduce-scatters the "
              "buckets, but a communication hook is registered; use one or the other");
  sharded_ = sharded;
  rebuild_pending_ = true;  // the padding of the layout changes
}

void Reducer::set_released_gradients(std::vector<at::Tensor> placeholders) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(placeholders.empty() || placeholders.size() == params_.size(),
              "FusedReducer: ", placeholders.size(), " released-gradient placeholders for ",
              params_.size(), " parameters");
  released_gradients_ = std::move(placeholders);
}

void Reducer::clear_released_gradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < released_gradients_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined() && grad.is_same(released_gradients_[i])) {
      grad.reset();
    }
  }
}

bool Reducer::sharded() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sharded_;
}

bool Reducer::sharded_layout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sharded_layout_;
}

std::vector<at::Tensor> Reducer::bucket_flats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> flats;
  for (const auto& bucket : buckets_) {
    flats.push_back(bucket.flat);
  }
  return flats;
}

std::vector<std::vector<int64_t>> Reducer::bucket_offsets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<int64_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.offsets);
  }
  return result;
}

bool Reducer::has_comm_hook() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(comm_hook_);
}

std::vector<ZeroBucket> Reducer::zero_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<ZeroBucket> result;
  size_t last = buckets_.size();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!buckets_[b].skipped) {
      last = b;
    }
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    if (bucket.skipped) {
      continue;  // never reduced: nothing to shadow
    }
    ZeroBucket zero;
    zero.flat = at::zeros_like(bucket.flat);
    for (const auto& view : bucket.views) {
      zero.views.push_back(zero.flat.as_strided(view.sizes(), view.strides(),
                                                view.storage_offset() - bucket.flat.storage_offset()));
    }
    zero.params = bucket.params;
    zero.is_last = b == last;
    result.push_back(std::move(zero));
  }
  return result;
}

at::Tensor Reducer::joined_used_map() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!used_map_.defined()) {
    used_map_ = at::zeros({static_cast<int64_t>(params_.size())},
                          at::TensorOptions().dtype(at::kInt).device(params_.front().device()));
  }
  return used_map_;
}

// A joined rank shadowed one step of the others: if that was their first, they
// rebuild at their next forward, and so must this rank (it receives rank 0's
// layout like everyone else).
void Reducer::note_shadowed_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
  if (!rebuilt_after_first_step_) {
    rebuilt_after_first_step_ = true;
    rebuild_pending_ = rebuilds_after_first_step();
    if (last_ready_order_.empty()) {
      last_ready_order_ = observed_order();
    }
  }
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

std::vector<int64_t> Reducer::bucket_sizes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> sizes;
  for (const auto& bucket : buckets_) {
    sizes.push_back(bucket.bytes);
  }
  return sizes;
}

std::vector<int64_t> Reducer::bucket_numels() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> numels;
  for (const auto& bucket : buckets_) {
    numels.push_back(bucket.flat.numel());
  }
  return numels;
}

std::vector<std::vector<int64_t>> Reducer::bucket_params() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<int64_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.params);
  }
  return result;
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ReducerStats stats = stats_;
  stats.buckets = static_cast<int64_t>(buckets_.size());
  stats.transport = transport_->name();
  return stats;
}

std::vector<StepTiming> Reducer::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {history_.begin(), history_.end()};
}

std::vector<double> Reducer::last_ready_times() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_ready_time_;
}

std::vector<int64_t> Reducer::last_ready_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return observed_order();
}

void Reducer::set_trace_capacity(int64_t steps) {
  TORCH_CHECK(steps > 0, "FusedReducer: trace capacity must be a positive number of steps, got ",
              steps);
  std::lock_guard<std::mutex> lock(mutex_);
  trace_capacity_ = static_cast<size_t>(steps);
  while (history_.size() > trace_capacity_) {
    history_.pop_front();
  }
}

int64_t Reducer::completed_steps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.step;
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
