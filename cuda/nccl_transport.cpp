#include "nccl_transport.h"

#include <c10/cuda/CUDAGuard.h>

#include <sstream>
#include <thread>

#include "cuda_check.h"

namespace fused_reducer {
namespace {

[[noreturn]] void throw_nccl_error(ncclResult_t result, const char* call, const char* file,
                                   int line, ncclComm_t comm) {
  std::ostringstream msg;
  msg << "FusedReducer: NCCL call " << call << " failed at " << file << ":" << line << ": "
      << ncclGetErrorString(result);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && detail[0] != '\0') {
    msg << " (" << detail << ")";
  }
  msg << ". Set NCCL_DEBUG=INFO for NCCL's own log.";
  throw std::runtime_error(msg.str());
}

// ncclInProgress is not an error for a non-blocking communicator: the caller
// then waits with wait_until_enqueued.
#define FR_NCCL_CHECK(call, comm)                                              \
  do {                                                                         \
    const ncclResult_t fr_result_ = (call);                                    \
    if (fr_result_ != ncclSuccess && fr_result_ != ncclInProgress) {           \
      throw_nccl_error(fr_result_, #call, __FILE__, __LINE__, (comm));         \
    }                                                                          \
  } while (0)

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default:
      TORCH_CHECK(false, "FusedReducer: NCCL transport cannot reduce dtype ", t.scalar_type());
  }
}

class PendingNccl : public PendingCollective {
 public:
  PendingNccl(std::shared_ptr<NcclTransport> transport, cudaEvent_t done, at::Tensor flat)
      : transport_(std::move(transport)), done_(done), flat_(std::move(flat)) {}
  ~PendingNccl() override { cudaEventDestroy(done_); }
  void wait(std::chrono::milliseconds timeout) override {
    transport_->wait_event(done_, timeout);
    // Readers of the result on the current stream come after the all-reduce.
    const auto current = c10::cuda::getCurrentCUDAStream(flat_.device().index());
    FR_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), done_, 0));
  }

 private:
  std::shared_ptr<NcclTransport> transport_;
  cudaEvent_t done_;
  at::Tensor flat_;  // keeps the buffer alive while NCCL may write it
};

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  FR_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

int nccl_version() {
  int version = 0;
  FR_NCCL_CHECK(ncclGetVersion(&version), nullptr);
  return version;
}

NcclTransport::NcclTransport(const std::string& unique_id, int rank, int world_size, int device,
                             std::chrono::milliseconds timeout)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {
  TORCH_CHECK(unique_id.size() == sizeof(ncclUniqueId::internal),
              "FusedReducer: an NCCL unique id has ", sizeof(ncclUniqueId::internal),
              " bytes, got ", unique_id.size());
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  c10::cuda::CUDAGuard guard(device_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a missing peer times out instead of hanging
  FR_NCCL_CHECK(ncclCommInitRankConfig(&comm_, world_size_, id, rank_, &config), comm_);
  wait_until_enqueued("creating the NCCL communicator (waiting for every rank to join)", timeout_);
}

NcclTransport::~NcclTransport() {
  if (comm_ == nullptr) {
    return;
  }
  // Abort never waits for peers, so teardown cannot hang after a failure.
  if (aborted_.load()) {
    return;
  }
  ncclResult_t state = ncclSuccess;
  ncclCommGetAsyncError(comm_, &state);
  if (state == ncclSuccess) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
}

void NcclTransport::abort_and_throw(const std::string& why) {
  if (!aborted_.exchange(true)) {
    ncclCommAbort(comm_);
  }
  throw std::runtime_error("FusedReducer: " + why + "; the NCCL communicator (rank " +
                           std::to_string(rank_) + " of " + std::to_string(world_size_) +
                           ") was aborted. A peer rank may have died or be stuck.");
}

void NcclTransport::wait_until_enqueued(const char* what, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    FR_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state), comm_);
    if (state == ncclSuccess) {
      return;
    }
    if (state != ncclInProgress) {
      throw_nccl_error(state, what, __FILE__, __LINE__, comm_);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort_and_throw(std::string("timed out after ") + std::to_string(timeout.count()) +
                      " ms " + what);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclTransport::wait_event(cudaEvent_t done, std::chrono::milliseconds timeout) {
  TORCH_CHECK(!aborted_.load(), "FusedReducer: the NCCL communicator was aborted after an earlier "
              "error; recreate the FusedReducer");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int spins = 0;; ++spins) {
    const cudaError_t query = cudaEventQuery(done);
    if (query == cudaSuccess) {
      return;
    }
    if (query != cudaErrorNotReady) {
      FR_CUDA_CHECK(query);
    }
    ncclResult_t state = ncclSuccess;
    FR_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state), comm_);
    if (state != ncclSuccess && state != ncclInProgress) {
      abort_and_throw(std::string("NCCL reported an asynchronous error: ") +
                      ncclGetErrorString(state) + " (" + ncclGetLastError(comm_) + ")");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort_and_throw("all-reduce timed out after " + std::to_string(timeout.count()) + " ms");
    }
    if (spins > 1000) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

std::unique_ptr<PendingCollective> NcclTransport::allreduce_sum(at::Tensor& flat) {
  return allreduce(flat, ncclSum);
}

std::unique_ptr<PendingCollective> NcclTransport::allreduce_average(at::Tensor& flat) {
  return allreduce(flat, ncclAvg);
}

bool NcclTransport::averages() const {
  static const bool has_avg = nccl_version() >= 21000;  // ncclAvg arrived in NCCL 2.10
  return has_avg;
}

std::unique_ptr<PendingCollective> NcclTransport::allreduce(at::Tensor& flat, ncclRedOp_t op) {
  TORCH_CHECK(flat.is_cuda() && flat.device().index() == device_ && flat.is_contiguous(),
              "FusedReducer: the NCCL transport reduces contiguous tensors on cuda:", device_,
              ", got ", flat.device(), flat.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(!aborted_.load(), "FusedReducer: the NCCL communicator was aborted after an earlier "
              "error; recreate the FusedReducer");
  c10::cuda::CUDAGuard guard(device_);
  // The bucket was filled on the compute stream: the all-reduce waits for it.
  const auto compute = c10::cuda::getCurrentCUDAStream(device_);
  cudaEvent_t filled = nullptr;
  cudaEvent_t done = nullptr;
  FR_CUDA_CHECK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));
  FR_CUDA_CHECK(cudaEventRecord(filled, compute.stream()));
  FR_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), filled, 0));
  FR_CUDA_CHECK(cudaEventDestroy(filled));  // destruction is deferred until it completes
  FR_NCCL_CHECK(ncclAllReduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), nccl_type(flat),
                              op, comm_, stream_.stream()),
                comm_);
  wait_until_enqueued("enqueuing an all-reduce", timeout_);
  FR_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  FR_CUDA_CHECK(cudaEventRecord(done, stream_.stream()));
  return std::make_unique<PendingNccl>(shared_from_this(), done, flat);
}

std::string NcclTransport::name() const {
  return "nccl";
}

}  // namespace fused_reducer
