#include "bucket_layout.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <sys/mman.h>

#include <algorithm>
#include <map>
#include <utility>

#include "process_group_transport.h"

namespace fused_reducer {
namespace {

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

// The rank-0 layout message carries the reduce dtype as an int64: -1 for none.
constexpr int64_t kNoReduceDtype = -1;

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

// How Python spells a dtype, for error messages.
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(type);
  }
}

// Note [Reduce dtype]
// The reduce dtype (FusedReducer(reduce_dtype=...), model.reduce_dtype)
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
// so changing it later has no effect. Here the limits live in the reducer's
// options (Reducer::options_) and every layout (the initial one, the automatic
// rebuild after the first step, and every rebuild a user asks for) is built
// from them, so a value set by the user holds until it is set again. Rank 0's
// values travel with the layout broadcast, and every rank keeps them (the
// reducer copies in_force() back into its options), so ranks cannot disagree.

void check_reduce_dtype(std::optional<at::ScalarType> dtype) {
  if (!dtype || *dtype == at::kFloat || *dtype == at::kBFloat16 || *dtype == at::kHalf) {
    return;
  }
  TORCH_CHECK_VALUE(false, "FusedReducer: reduce_dtype=", dtype_name(*dtype),
                    " is not supported; accepted: torch.bfloat16, torch.float16, torch.float32, "
                    "or None (each gradient's own dtype)");
}


BucketLayout::BucketLayout(std::vector<at::Tensor> params, std::vector<std::string> names,
                           const ReducerOptions& options,
                           c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device control_device)
    : params_(std::move(params)),
      names_(std::move(names)),
      gradient_as_bucket_view_(options.gradient_as_bucket_view),
      ddp_first_layout_(options.ddp_first_layout),
      timeout_(options.timeout),
      group_(std::move(group)),
      control_device_(control_device),
      world_size_(group_->getSize()) {
  // One bucket group per (dtype, device), numbered in registration order.
  std::map<std::pair<int, std::string>, int64_t> groups;
  for (const auto& p : params_) {
    auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
    auto it = groups.emplace(key, static_cast<int64_t>(groups.size())).first;
    infos_.push_back({static_cast<int64_t>(p.numel() * p.element_size()), it->second});
  }
}

void BucketLayout::build_initial(const LayoutLimits& limits) {
  // Before any gradient was seen, expect them in reverse registration order.
  std::vector<int64_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = static_cast<int64_t>(order.size() - 1 - i);
  }
  const std::vector<char> none;
  if (ddp_first_layout_) {
    std::reverse(order.begin(), order.end());
    auto assignment = assign(limits, order, none);
    std::reverse(assignment.begin(), assignment.end());
    build_buckets(limits, assignment, none, /*sharded=*/false);
  } else {
    build_buckets(limits, assign(limits, order, none), none, /*sharded=*/false);
  }
}

// Rank 0 decides the layout inputs (its limits and its observed order) and
// broadcasts them; every rank then runs the same deterministic assignment on
// parameters whose sizes were verified equal at construction.
void BucketLayout::rebuild_from_rank0(const LayoutLimits& limits,
                                      const std::vector<int64_t>& order,
                                      const std::vector<char>& skipped, bool sharded) {
  // The message has the same length on every rank whatever their lists:
  // [number of caps, last, reduce dtype, caps padded to `count`, order]. A
  // group has at most `count` buckets, so later entries of a list never apply.
  const auto count = static_cast<int64_t>(params_.size());
  constexpr int64_t kHeader = 3;
  const int64_t ncaps =
      std::min<int64_t>(static_cast<int64_t>(limits.bucket_caps_bytes.size()), count);
  at::Tensor message = at::zeros({kHeader + 2 * count}, at::kLong);
  auto* data = message.data_ptr<int64_t>();
  data[0] = ncaps;
  data[1] = limits.last_bucket_bytes;
  data[2] = limits.reduce_dtype ? static_cast<int64_t>(*limits.reduce_dtype) : kNoReduceDtype;
  std::copy(limits.bucket_caps_bytes.begin(), limits.bucket_caps_bytes.begin() + ncaps,
            data + kHeader);
  std::copy(order.begin(), order.end(), data + kHeader + count);

  std::vector<at::Tensor> tensors{message.to(control_device_)};
  c10d::BroadcastOptions broadcast;
  broadcast.rootRank = 0;
  auto work = group_->broadcast(tensors, broadcast);
  try {
    work->wait(timeout_);
    release_work(std::move(work));  // See Note [Releasing process-group work]
  } catch (const std::exception& e) {
    release_work(std::move(work));
    TORCH_CHECK(false, "FusedReducer: broadcasting the rebuilt bucket layout from rank 0 failed: ",
                e.what(), ". A peer rank may have died.");
  }
  message = tensors[0].cpu();
  data = message.data_ptr<int64_t>();
  LayoutLimits rank0;
  rank0.bucket_caps_bytes.assign(data + kHeader, data + kHeader + data[0]);
  rank0.last_bucket_bytes = data[1];
  rank0.reduce_dtype = data[2] == kNoReduceDtype
                           ? std::nullopt
                           : std::optional<at::ScalarType>(static_cast<at::ScalarType>(data[2]));
  const std::vector<int64_t> rank0_order(data + kHeader + count, data + kHeader + 2 * count);
  build_buckets(rank0, assign(rank0, rank0_order, skipped), skipped, sharded);
  rebuilds_ += 1;
}

// The dtype of parameter `index`'s slot: the reduce dtype for floating-point
// gradients when one is set, else the gradient's own. See Note [Reduce dtype].
at::ScalarType BucketLayout::bucket_dtype(int64_t index,
                                          std::optional<at::ScalarType> reduce_dtype) const {
  const at::ScalarType type = params_[index].scalar_type();
  if (reduce_dtype && at::isFloatingType(type)) {
    return *reduce_dtype;
  }
  return type;
}

void check_bucket_view_dtypes(bool gradient_as_bucket_view,
                              std::optional<at::ScalarType> reduce_dtype,
                              const std::vector<at::ScalarType>& param_dtypes,
                              const std::vector<std::string>& names) {
  if (!gradient_as_bucket_view || !reduce_dtype) {
    return;
  }
  TORCH_INTERNAL_ASSERT(param_dtypes.size() == names.size());
  for (size_t i = 0; i < param_dtypes.size(); ++i) {
    const at::ScalarType type = param_dtypes[i];
    if (at::isFloatingType(type) && type != *reduce_dtype) {
      const std::string bucket = dtype_name(*reduce_dtype);
      const std::string grad = dtype_name(type);
      throw ModelSettingError(
          "FusedReducer: gradient_as_bucket_view=True needs buckets in the gradients' own dtype, "
          "but reduce_dtype=" + bucket + " differs from the dtype of parameter '" + names[i] +
          "' (" + grad + "): a " + grad + " gradient cannot be a view of a " + bucket +
          " bucket. Use gradient_as_bucket_view=False, or reduce_dtype=None or " + grad + ".");
    }
  }
}

void BucketLayout::check_bucket_view_dtypes(std::optional<at::ScalarType> dtype) const {
  std::vector<at::ScalarType> dtypes;
  dtypes.reserve(params_.size());
  for (const auto& p : params_) {
    dtypes.push_back(p.scalar_type());
  }
  fused_reducer::check_bucket_view_dtypes(gradient_as_bucket_view_, dtype, dtypes, names_);
}

std::vector<std::vector<int64_t>> BucketLayout::assign(const LayoutLimits& limits,
                                                       const std::vector<int64_t>& order,
                                                       const std::vector<char>& skipped) {
  // Bucket limits count bytes of the bucket dtype (what the collective moves).
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::ScalarType dtype = bucket_dtype(static_cast<int64_t>(i), limits.reduce_dtype);
    infos_[i].bytes = params_[i].numel() * static_cast<int64_t>(c10::elementSize(dtype));
  }
  // Skipped parameters get buckets of their own: Note [Skipping unused parameters].
  std::vector<TensorInfo> infos = infos_;
  for (size_t i = 0; i < skipped.size(); ++i) {
    infos[i].group = 2 * infos[i].group + (skipped[i] ? 1 : 0);
  }
  return assign_buckets(infos, order, {limits.bucket_caps_bytes, limits.last_bucket_bytes});
}

void BucketLayout::build_buckets(const LayoutLimits& limits,
                                 const std::vector<std::vector<int64_t>>& assignment,
                                 const std::vector<char>& skipped, bool sharded) {
  for (Bucket& old : buckets_) {
    old.release_after_copies();  // Note [Releasing GPU buckets]
  }
  if (!gradient_as_bucket_view_) {
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
    const at::ScalarType dtype = bucket_dtype(bucket.params.front(), limits.reduce_dtype);
    // See Note [Slot layout].
    const int64_t align =
        std::max<int64_t>(1, kSlotAlignBytes / static_cast<int64_t>(c10::elementSize(dtype)));
    std::vector<int64_t>& offsets = bucket.offsets;
    int64_t numel = 0;
    for (int64_t index : bucket.params) {
      offsets.push_back(numel);
      numel += (params_[index].numel() + align - 1) / align * align;
    }
    if (sharded) {
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
      if (gradient_as_bucket_view_) {
        // Move existing gradients into the new buffer so param.grad stays a view.
        at::Tensor& grad = params_[index].mutable_grad();
        if (grad.defined()) {
          bucket.views.back().copy_(grad);
          grad = bucket.views.back();
        }
      }
    }
    bucket.skipped = !skipped.empty() && skipped[bucket.params.front()];
  }
  buckets_ = std::move(buckets);
  in_force_.sharded = sharded;
  static_cast<LayoutLimits&>(in_force_) = limits;
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
void Bucket::note_copy_stream() {
  if (flat.is_cpu()) {
    return;  // host copies are complete when they return
  }
  const c10::Stream current =
      c10::impl::getDeviceGuardImpl(flat.device().type())->getStream(flat.device());
  if (std::find(copy_streams.begin(), copy_streams.end(), current) == copy_streams.end()) {
    copy_streams.push_back(current);
  }
}

void Bucket::release_after_copies() {
  if (!flat.defined() || flat.is_cpu()) {
    return;
  }
  note_copy_stream();  // the rebuild's stream
  for (const c10::Stream& stream : copy_streams) {
    flat.record_stream(stream);
  }
}

// ---------------------------------------------------------------------------
// Introspection
// ---------------------------------------------------------------------------

std::vector<at::Tensor> BucketLayout::flats() const {
  std::vector<at::Tensor> flats;
  for (const auto& bucket : buckets_) {
    flats.push_back(bucket.flat);
  }
  return flats;
}

std::vector<std::vector<int64_t>> BucketLayout::offsets() const {
  std::vector<std::vector<int64_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.offsets);
  }
  return result;
}

std::vector<int64_t> BucketLayout::sizes() const {
  std::vector<int64_t> sizes;
  for (const auto& bucket : buckets_) {
    sizes.push_back(bucket.bytes);
  }
  return sizes;
}

std::vector<int64_t> BucketLayout::numels() const {
  std::vector<int64_t> numels;
  for (const auto& bucket : buckets_) {
    numels.push_back(bucket.flat.numel());
  }
  return numels;
}

std::vector<std::vector<int64_t>> BucketLayout::params() const {
  std::vector<std::vector<int64_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.params);
  }
  return result;
}

std::vector<ZeroBucket> BucketLayout::zero_buckets() const {
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

}  // namespace fused_reducer
