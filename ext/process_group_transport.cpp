#include "process_group_transport.h"

namespace fused_reducer {
namespace {

class PendingWork : public PendingCollective {
 public:
  explicit PendingWork(c10::intrusive_ptr<c10d::Work> work) : work_(std::move(work)) {}
  bool completed() override { return work_->isCompleted(); }
  void wait(std::chrono::milliseconds timeout) override {
    if (!work_->wait(timeout)) {
      throw std::runtime_error(
          "timed out after " + std::to_string(timeout.count()) + " ms");
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

}  // namespace

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {}

std::unique_ptr<PendingCollective> ProcessGroupTransport::allreduce_sum(at::Tensor& flat) {
  std::vector<at::Tensor> tensors{flat};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return std::make_unique<PendingWork>(group_->allreduce(tensors, options));
}

std::string ProcessGroupTransport::name() const {
  return "process_group(" + group_->getBackendName() + ")";
}

}  // namespace fused_reducer
