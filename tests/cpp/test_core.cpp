// C++ tests of the torch-side core that need no process group: the bucket copy
// (Note [Bucket copies]) against plain ATen arithmetic, and how a process-group collective is
// waited (Note [Process-group work without host stalls]) with a fake c10d::Work, and the used
// map's crossing to a GPU and back (Note [Used map on the GPU]) with a fake asynchronous device.
#include <ATen/ATen.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <mutex>
#include <thread>

#include "bucket_copy.h"
#include "process_group_transport.h"
#include "used_map.h"

namespace {

using std::chrono::milliseconds;

// Records the timeouts it is waited with; completes when told to.
class FakeWork : public c10d::Work {
 public:
  bool done = false;
  std::vector<milliseconds> waits;
  bool isCompleted() override { return done; }
  bool wait(milliseconds timeout) override {
    waits.push_back(timeout);
    return true;
  }
};

// The error message `call` raises, or "" if it returns.
template <typename F>
std::string error_of(F call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

int check_process_group_waits() {
  using fused_reducer::PendingWork;
  using fused_reducer::WorkDeadlines;
  int failures = 0;
  auto fail = [&](const std::string& what) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  };
  if (!fused_reducer::stream_ordered_wait(c10::DeviceType::CUDA, "nccl") ||
      fused_reducer::stream_ordered_wait(c10::DeviceType::CPU, "gloo") ||
      fused_reducer::stream_ordered_wait(c10::DeviceType::CUDA, "gloo")) {
    fail("only NCCL work on CUDA tensors is waited stream-ordered");
  }

  // CPU work (gloo): the host blocks in wait, bounded by the timeout.
  auto deadlines = std::make_shared<WorkDeadlines>();
  auto cpu = c10::make_intrusive<FakeWork>();
  PendingWork(cpu, false, "all-reduce #1", deadlines).wait(milliseconds(1234));
  if (cpu->waits != std::vector<milliseconds>{milliseconds(1234)}) {
    fail("CPU work is waited with the reducer's timeout");
  }

  // Stream-ordered work: waited with kNoTimeout (the host does not block), no error before
  // its deadline even though it has not completed.
  auto gpu = c10::make_intrusive<FakeWork>();
  PendingWork(gpu, true, "all-reduce of bucket 0", deadlines).wait(milliseconds(60000));
  if (gpu->waits != std::vector<milliseconds>{::kNoTimeout}) {
    fail("stream-ordered work is waited with kNoTimeout");
  }
  if (!error_of([&] { deadlines->check(); }).empty()) {
    fail("no error for uncompleted work before its deadline");
  }

  // Past its deadline and still not completed: the next call raises, naming it and the timeout.
  auto late = c10::make_intrusive<FakeWork>();
  PendingWork(late, true, "all-reduce of bucket 3", deadlines).wait(milliseconds(30));
  if (!error_of([&] { deadlines->check(); }).empty()) {
    fail("no error right after the wait, before the deadline");
  }
  std::this_thread::sleep_for(milliseconds(80));
  const std::string message = error_of([&] { deadlines->check(); });
  if (message.find("all-reduce of bucket 3 did not complete within 30 ms") == std::string::npos) {
    fail("an uncompleted stream-ordered work past its deadline raises; got '" + message + "'");
  }
  if (error_of([&] { deadlines->check(); }).empty()) {
    fail("the overdue work is raised again by the next call");
  }
  // A later wait raises for it too, before making its stream wait.
  auto next = c10::make_intrusive<FakeWork>();
  PendingWork pending(next, true, "all-reduce of bucket 4", deadlines);
  if (error_of([&] { pending.wait(milliseconds(60000)); }).find("bucket 3 did not complete") ==
      std::string::npos) {
    fail("the next wait raises for the overdue work");
  }
  late->done = true;
  gpu->done = true;
  next->done = true;
  if (!error_of([&] { deadlines->check(); }).empty()) {
    fail("completed work is forgotten: no error once it is done");
  }

  // Waited already past its deadline: raises at once, without waiting.
  auto stale = c10::make_intrusive<FakeWork>();
  PendingWork old(stale, true, "all-reduce of bucket 5", deadlines);
  std::this_thread::sleep_for(milliseconds(80));
  if (error_of([&] { old.wait(milliseconds(30)); }).find("bucket 5 did not complete within 30 ms") ==
          std::string::npos ||
      !stale->waits.empty()) {
    fail("a wait past the deadline raises instead of waiting");
  }
  return failures;
}

// Note [Used map on the GPU], with a fake device whose copies are asynchronous: the copy back
// lands on the host only when the host waits for the stream. Records every device call.
int check_used_map_exchange() {
  int failures = 0;
  auto fail = [&](const std::string& what) {
    std::cerr << "FAILED: used map: " << what << "\n";
    ++failures;
  };
  std::vector<std::string> calls;
  std::vector<std::function<void()>> queued;  // what the fake stream has not done yet
  fused_reducer::DeviceCalls fake;
  fake.host_buffer = [&](int64_t count, bool pinned) {
    calls.push_back(pinned ? "pinned buffer" : "pageable buffer");
    return at::zeros({count}, at::kInt);
  };
  fake.to_device = [&](const at::Tensor& host, c10::Device, bool non_blocking) {
    calls.push_back(non_blocking ? "to device, non-blocking" : "to device, blocking");
    return host.clone();  // the "device" copy (read from the host at once: pinned)
  };
  fake.to_host = [&](at::Tensor& host, const at::Tensor& device, bool non_blocking) {
    calls.push_back(non_blocking ? "to host, non-blocking" : "to host, blocking");
    at::Tensor source = device.clone();
    auto land = [host, source]() mutable { host.copy_(source); };
    if (non_blocking) {
      queued.push_back(land);  // lands when the stream gets there
    } else {
      land();
    }
  };
  fake.wait_for_current_stream = [&](c10::Device) {
    calls.push_back("wait for the stream");
    for (auto& job : queued) job();
    queued.clear();
  };
  fused_reducer::UsedMapExchange exchange(fake);
  const c10::Device gpu(c10::DeviceType::CUDA, 0);
  auto doubled = [&](at::Tensor& map) {
    calls.push_back("all-reduce");
    map.mul_(2);
  };
  for (int step = 0; step < 2; ++step) {
    calls.clear();
    const std::vector<char> used{1, 0, 1, static_cast<char>(step)};
    auto result = exchange.exchange(used, gpu, doubled);
    const std::vector<std::string> expected =
        step == 0 ? std::vector<std::string>{"pinned buffer", "to device, non-blocking",
                                             "all-reduce", "to host, non-blocking",
                                             "wait for the stream"}
                  : std::vector<std::string>{"to device, non-blocking", "all-reduce",
                                             "to host, non-blocking", "wait for the stream"};
    if (calls != expected) {
      std::string got;
      for (const auto& c : calls) got += c + "; ";
      fail("step " + std::to_string(step) + " made the calls: " + got);
    }
    const auto host = result.host;
    if (host.data_ptr<int32_t>()[0] != 2 || host.data_ptr<int32_t>()[1] != 0 ||
        host.data_ptr<int32_t>()[3] != 2 * step) {
      fail("the host reads the all-reduced map only after waiting for it (step " +
           std::to_string(step) + ")");
    }
  }
  calls.clear();
  fused_reducer::UsedMapExchange on_host(fake);
  auto on_cpu = on_host.exchange({1, 1}, c10::Device(c10::kCPU), doubled);
  if (calls != std::vector<std::string>{"pageable buffer", "all-reduce"} ||
      on_cpu.host.data_ptr<int32_t>()[1] != 2) {
    fail("on CPU the map is all-reduced in place, with no copy and no wait");
  }
  return failures;
}

// Note [Releasing process-group work]: a work the backend's thread still holds is parked, not
// released, and is destroyed on the releasing side once it is ours alone; one the backend
// never lets go of is never destroyed by us.
class CountedWork : public c10d::Work {
 public:
  explicit CountedWork(std::thread::id* destroyed_on) : destroyed_on_(destroyed_on) {}
  ~CountedWork() override { *destroyed_on_ = std::this_thread::get_id(); }

 private:
  std::thread::id* destroyed_on_;
};

int check_work_release() {
  int failures = 0;
  auto fail = [&](const std::string& what) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  };
  // Works parked by the checks before (their fakes held by the test), left as they are.
  const size_t base = fused_reducer::settle_released_works(milliseconds(0));
  std::thread::id destroyed_on;
  {  // ours alone: destroyed at once, here
    fused_reducer::release_work(c10::make_intrusive<CountedWork>(&destroyed_on));
    if (destroyed_on != std::this_thread::get_id()) fail("a work that is ours alone is dropped");
  }
  destroyed_on = std::thread::id();
  auto work = c10::make_intrusive<CountedWork>(&destroyed_on);
  c10::intrusive_ptr<c10d::Work> backend_ref = work;  // the backend thread's reference
  std::mutex handoff;
  std::unique_lock<std::mutex> held(handoff);
  std::thread backend([&] {
    std::lock_guard<std::mutex> wait_for_release(handoff);
    backend_ref.reset();  // the backend lets go after the reducer released it
  });
  fused_reducer::release_work(std::move(work));
  if (destroyed_on != std::thread::id()) fail("a work the backend holds was destroyed");
  if (fused_reducer::settle_released_works(milliseconds(0)) != base + 1) fail("it is parked");
  held.unlock();
  backend.join();
  if (destroyed_on != std::thread::id()) fail("the backend's release destroyed it on its thread");
  if (fused_reducer::settle_released_works(milliseconds(100)) != base) fail("settled once ours alone");
  if (destroyed_on != std::this_thread::get_id()) fail("destroyed on the settling thread");
  // Never let go of by the backend: never destroyed (settle gives up at its deadline).
  destroyed_on = std::thread::id();
  auto stuck = c10::make_intrusive<CountedWork>(&destroyed_on);
  static auto* forever = new c10::intrusive_ptr<c10d::Work>(stuck);  // leaked, like the backend's
  fused_reducer::release_work(std::move(stuck));
  const auto start = std::chrono::steady_clock::now();
  if (fused_reducer::settle_released_works(milliseconds(50)) != base + 1) fail("a stuck work stays");
  if (std::chrono::steady_clock::now() - start > std::chrono::seconds(5)) fail("settle bounded");
  if (destroyed_on != std::thread::id() || !forever->defined()) fail("a stuck work is kept");
  return failures;
}

}  // namespace

int main() {
  int failures = check_process_group_waits();
  failures += check_used_map_exchange();
  failures += check_work_release();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    auto a = at::randn({7, 3}).to(dtype);
    auto b = at::randn({5}).to(dtype);
    auto flat = at::full({26}, 123.0, dtype);  // poisoned
    auto va = flat.narrow(0, 0, 21).view({7, 3});
    auto vb = flat.narrow(0, 21, 5);
    fused_reducer::scaled_copy({{a, va}, {b, vb}}, 0.5);
    if (!at::equal(va, a * 0.5) || !at::equal(vb, b * 0.5)) {
      std::cerr << "FAILED: scaled copy into a flat buffer, dtype " << dtype << "\n";
      ++failures;
    }
    fused_reducer::scaled_copy({{at::Tensor(), vb}}, 0.5);
    if (!at::equal(vb, at::zeros_like(vb))) {
      std::cerr << "FAILED: an undefined source writes zeros, dtype " << dtype << "\n";
      ++failures;
    }
  }
  if (failures == 0) std::cout << "core: all checks passed\n";
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
