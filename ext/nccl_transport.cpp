#ifdef FUSED_REDUCER_WITH_CUDA
#include "nccl_transport.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <sstream>

#include <unistd.h>

#include "cuda_check.h"
#include "transport_registry.h"

namespace fused_reducer {
namespace {

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default:
      TORCH_CHECK(false, "FusedReducer: the NCCL transport cannot move dtype ", t.scalar_type(),
                  "; it takes float32, float16, bfloat16, float64, int32 and int64");
  }
}

// A CUDA event destroyed when its last owner (the pending collective, the
// watchdog) lets go; CUDA defers the release until the event has completed.
std::shared_ptr<cudaEvent_t> make_event() {
  auto* event = new cudaEvent_t(nullptr);
  FR_CUDA_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  return std::shared_ptr<cudaEvent_t>(event, [](cudaEvent_t* e) {
    cudaEventDestroy(*e);
    delete e;
  });
}

// Raises the refusal of Note [No NCCL collective under graph capture] (cuda/nccl_comm.h).
void refuse_under_capture(cudaStream_t stream, int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FR_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  const std::string refusal = cuda::capture_refusal(status, device);
  TORCH_CHECK(refusal.empty(), refusal);
}

// See Note [NCCL without host stalls].
class PendingNccl : public PendingCollective {
 public:
  PendingNccl(std::shared_ptr<cuda::Watchdog> watchdog, std::shared_ptr<cudaEvent_t> done,
              int device)
      : watchdog_(watchdog), done_(std::move(done)), device_(device) {}
  void wait(std::chrono::milliseconds /*timeout: the watchdog's*/) override {
    watchdog_->check();
    c10::cuda::CUDAGuard guard(device_);
    const auto current = c10::cuda::getCurrentCUDAStream(device_);
    FR_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), *done_, 0));
  }
  bool completed() override {
    // A query from a capturing stream's thread would invalidate the capture: then simply "not yet".
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const auto current = c10::cuda::getCurrentCUDAStream(device_);
    if (cudaStreamIsCapturing(current.stream(), &status) != cudaSuccess ||
        status != cudaStreamCaptureStatusNone) {
      return false;
    }
    return cudaEventQuery(*done_) == cudaSuccess;
  }

 private:
  std::shared_ptr<cuda::Watchdog> watchdog_;
  std::shared_ptr<cudaEvent_t> done_;
  int device_;
};

}  // namespace

std::string nccl_unique_id() { return cuda::nccl_unique_id(); }
int nccl_version() { return cuda::nccl_version(); }

NcclTransport::NcclTransport(const std::string& unique_id, int rank, int world_size, int device,
                             std::chrono::milliseconds timeout)
    : owner_pid_(getpid()),
      device_(device),
      timeout_(timeout),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {
  c10::cuda::CUDAGuard guard(device_);
  comm_ = std::make_shared<cuda::NcclComm>(unique_id, rank, world_size, device, timeout);
  watchdog_ = std::make_shared<cuda::Watchdog>(comm_);
}

NcclTransport::~NcclTransport() {
  close(std::chrono::seconds(5));
}

void NcclTransport::check() {
  if (watchdog_) {
    watchdog_->check();
  }
}

void NcclTransport::close(std::chrono::milliseconds deadline) {
  if (!watchdog_) {
    return;
  }
  if (getpid() != owner_pid_) {
    // A forked child has no watchdog thread to join and must not touch the parent's
    // communicator: both are abandoned, never destroyed (Note [Process life]).
    (void)new std::shared_ptr<cuda::Watchdog>(std::move(watchdog_));
    (void)new std::shared_ptr<cuda::NcclComm>(std::move(comm_));
    return;
  }
  watchdog_->drain(deadline);
  // Stopped here, not by its last owner: a pending collective may still hold it, and its thread
  // must make no call on the communicator once close() releases it.
  watchdog_->stop();
  watchdog_.reset();
  comm_->close(deadline);
}

std::unique_ptr<PendingCollective> NcclTransport::allreduce_sum(at::Tensor& flat) {
  return allreduce(flat, ncclSum, "");
}

std::unique_ptr<PendingCollective> NcclTransport::allreduce_sum_labeled(at::Tensor& flat,
                                                                        const std::string& label) {
  return allreduce(flat, ncclSum, label);
}

std::unique_ptr<PendingCollective> NcclTransport::allreduce(at::Tensor& flat, ncclRedOp_t op,
                                                            const std::string& label) {
  return launch(flat, "all-reduce", label, [&](cudaStream_t stream) {
    comm_->allreduce(flat.data_ptr(), static_cast<size_t>(flat.numel()), nccl_type(flat), op,
                     stream, timeout_);
  });
}

void NcclTransport::check_shardable(const at::Tensor& flat, const char* what) const {
  TORCH_CHECK(watchdog_,
              "FusedReducer: the NCCL transport was closed; construct a new FusedReducer");
  const int64_t world = comm_->world_size();
  TORCH_CHECK(flat.numel() % world == 0, "FusedReducer: the ", what, " over NCCL needs a bucket "
              "whose number of elements is a multiple of the world size (each of the ", world,
              " ranks owns an equal shard); got ", flat.numel(), " elements (", flat.numel(),
              " % ", world, " = ", flat.numel() % world, ")");
}

std::unique_ptr<PendingCollective> NcclTransport::reduce_scatter_sum(at::Tensor& flat,
                                                                     const std::string& label) {
  check_shardable(flat, "reduce-scatter");
  return launch(flat, "reduce-scatter", label, [&](cudaStream_t stream) {
    const auto shard = static_cast<size_t>(flat.numel() / comm_->world_size());
    comm_->reduce_scatter(flat.data_ptr(), shard, nccl_type(flat), ncclSum, stream, timeout_);
  });
}

std::unique_ptr<PendingCollective> NcclTransport::all_gather(at::Tensor& flat,
                                                             const std::string& label) {
  check_shardable(flat, "all-gather");
  return launch(flat, "all-gather", label, [&](cudaStream_t stream) {
    const auto shard = static_cast<size_t>(flat.numel() / comm_->world_size());
    comm_->all_gather(flat.data_ptr(), shard, nccl_type(flat), stream, timeout_);
  });
}

std::unique_ptr<PendingCollective> NcclTransport::launch(
    at::Tensor& flat, const char* kind, const std::string& label,
    const std::function<void(cudaStream_t)>& enqueue) {
  TORCH_CHECK(watchdog_,
              "FusedReducer: the NCCL transport was closed; construct a new FusedReducer");
  watchdog_->check();
  TORCH_CHECK(flat.is_cuda() && flat.device().index() == device_ && flat.is_contiguous(),
              "FusedReducer: the NCCL transport's ", kind, " takes contiguous tensors on cuda:",
              device_, ", got ", flat.device(), flat.is_contiguous() ? "" : " (non-contiguous)");
  (void)nccl_type(flat);  // refused before anything is recorded
  c10::cuda::CUDAGuard guard(device_);
  // The bucket was filled on the current stream: the collective waits for it on the GPU.
  const auto current = c10::cuda::getCurrentCUDAStream(device_);
  refuse_under_capture(current.stream(), device_);
  auto filled = make_event();
  FR_CUDA_CHECK(cudaEventRecord(*filled, current.stream()));
  FR_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), *filled, 0));
  // The caching allocator must not hand this memory out again before NCCL is done with it.
  c10::cuda::CUDACachingAllocator::recordStream(flat.storage().data_ptr(), stream_);
  try {
    enqueue(stream_.stream());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
  auto done = make_event();
  FR_CUDA_CHECK(cudaEventRecord(*done, stream_.stream()));
  std::ostringstream what;
  ++launched_;
  if (label.empty()) {
    what << kind << " #" << launched_ << " (" << flat.numel() * flat.element_size() << " bytes)";
  } else {
    what << kind << " of " << label;
  }
  what << " on cuda:" << device_;
  watchdog_->watch(done, timeout_, what.str());
  return std::make_unique<PendingNccl>(watchdog_, done, device_);
}

std::string NcclTransport::name() const {
  return "nccl";
}

// Made by transports/transport.py's nccl_transport once rank 0's unique id reached every rank;
// registered in CUDA builds only.
FUSED_REDUCER_REGISTER_TRANSPORT("nccl", [](const TransportArgs& args) {
  return std::make_shared<NcclTransport>(args.id, args.rank, args.world_size, args.device,
                                         args.timeout);
});

}  // namespace fused_reducer

#endif  // FUSED_REDUCER_WITH_CUDA
