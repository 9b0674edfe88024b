#include "used_map.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace fused_reducer {

DeviceCalls real_device_calls() {
  DeviceCalls calls;
  calls.host_buffer = [](int64_t count, bool pinned) {
    return at::empty({count}, at::TensorOptions(at::kInt).pinned_memory(pinned));
  };
  calls.to_device = [](const at::Tensor& host, c10::Device device, bool non_blocking) {
    return host.to(device, non_blocking);
  };
  calls.to_host = [](at::Tensor& host, const at::Tensor& device, bool non_blocking) {
    host.copy_(device, non_blocking);
  };
  calls.wait_for_current_stream = [](c10::Device device) {
    c10::Event copied(device.type());
    copied.record(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
    copied.synchronize();
  };
  return calls;
}

UsedMapExchange::Result UsedMapExchange::exchange(const std::vector<char>& locally_used,
                                                  c10::Device device,
                                                  const std::function<void(at::Tensor&)>& reduce) {
  const auto count = static_cast<int64_t>(locally_used.size());
  if (!host_.defined() || host_.numel() != count) {
    host_ = calls_.host_buffer(count, device.is_cuda());
  }
  std::copy(locally_used.begin(), locally_used.end(), host_.data_ptr<int32_t>());
  if (device.is_cpu()) {
    at::Tensor map = host_.clone();  // join keeps the device map: not the reused buffer
    reduce(map);
    return {map, map};
  }
  at::Tensor map = calls_.to_device(host_, device, /*non_blocking=*/true);
  reduce(map);
  calls_.to_host(host_, map, /*non_blocking=*/true);
  calls_.wait_for_current_stream(device);  // the step's one host wait
  return {host_, map};
}

}  // namespace fused_reducer
