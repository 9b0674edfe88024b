// Transport over a c10d ProcessGroup: any backend, called from C++ on whole buckets.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "transport.h"

namespace fused_reducer {

class ProcessGroupTransport : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group);
  std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) override;
  std::string name() const override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace fused_reducer
