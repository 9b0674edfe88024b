// The used-parameter map of find_unused_parameters, crossing from the host to the parameters'
// device, all-reduced there, and back. See Note [Used map on the GPU].
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace fused_reducer {

// Note [Used map on the GPU]
// Which parameters any rank used decides which get a gradient, so the host must read the
// all-reduced map: one host wait per step (DDP waits here too). That wait must be the only one,
// and as short as the map allows: the map crosses through a pinned host buffer with
// non-blocking copies (a pageable host-to-device copy makes the host wait for the current stream
// first, and .cpu() waits for all of it), and the host waits on an event recorded after the copy
// back. The buffer is reused: the host rewrites it only after the event of the step before. On
// CPU the map is all-reduced in place, no copy.
//
// The device calls go through DeviceCalls so that a test can record them and play the GPU's
// asynchrony (tests/cpp/test_core.cpp); real_device_calls() makes them with ATen and c10::Event.
struct DeviceCalls {
  std::function<at::Tensor(int64_t count, bool pinned)> host_buffer;  // int32, on the host
  std::function<at::Tensor(const at::Tensor& host, c10::Device device, bool non_blocking)>
      to_device;
  std::function<void(at::Tensor& host, const at::Tensor& device, bool non_blocking)> to_host;
  std::function<void(c10::Device device)> wait_for_current_stream;  // event recorded now, waited
};
DeviceCalls real_device_calls();

class UsedMapExchange {
 public:
  explicit UsedMapExchange(DeviceCalls calls = real_device_calls()) : calls_(std::move(calls)) {}

  struct Result {
    at::Tensor host;    // the all-reduced map, readable now (valid until the next exchange)
    at::Tensor device;  // the same on the parameters' device (a new tensor each step)
  };
  // `reduce` all-reduces its argument in place and returns once the result may be read on the
  // caller's stream (or raises).
  Result exchange(const std::vector<char>& locally_used, c10::Device device,
                  const std::function<void(at::Tensor&)>& reduce);

 private:
  DeviceCalls calls_;
  at::Tensor host_;
};

}  // namespace fused_reducer
