// The transports by name: each transport's own source file registers how it is made
// (FUSED_REDUCER_REGISTER_TRANSPORT), and Python makes one by that name through
// _C.make_registered_transport (python/fused_reducer/transports/transport.py, TRANSPORTS), so
// neither the bindings nor the build list the transports. Recipe: docs/DESIGN.md, "Extension
// points".
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace fused_reducer {

// What a transport is made from; each reads the fields it needs and ignores the others.
struct TransportArgs {
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // the group to run on (process_group)
  std::string id;          // what the ranks agreed on: a segment name (shm), an NCCL unique id
  bool create = false;     // this rank creates what `id` names (shm: rank 0)
  int rank = 0;
  int world_size = 1;
  int device = -1;         // CUDA device index (nccl)
  int64_t chunk_bytes = 0; // slot size (shm)
  std::chrono::milliseconds timeout{0};  // bounds the joining and every collective
};

using TransportFactory = std::function<std::shared_ptr<Transport>(const TransportArgs&)>;

// Registers `factory` under `name` during static initialisation; a name registered twice
// is a build error reported at import (TORCH_INTERNAL_ASSERT).
struct TransportRegistration {
  TransportRegistration(const char* name, TransportFactory factory);
};

#define FUSED_REDUCER_REGISTER_TRANSPORT(name, factory)             \
  static const ::fused_reducer::TransportRegistration               \
      fused_reducer_transport_registration_(name, factory)

// The transport registered as `name`, made from `args`; raises naming the registered ones if
// there is none (a CPU build has no "nccl").
std::shared_ptr<Transport> make_registered_transport(const std::string& name,
                                                     const TransportArgs& args);
// Every registered name, sorted.
std::vector<std::string> registered_transports();

}  // namespace fused_reducer
