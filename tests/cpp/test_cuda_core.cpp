// C++ test of the torch-free CUDA core (cuda/): built and linked against the
// CUDA runtime and NCCL only, never libtorch, which is the layering rule
// (cuda/ knows nothing of ext/ or torch). Without a GPU it checks what needs
// none and says that the device checks were skipped: the copy kernel's
// head/vector/tail split (copy_split.h) on the reducer's slot layout, and the
// communicator's lock discipline and the watchdog's state machine through a
// fake NCCL (NcclApi) and fake completion events.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "copy_split.h"
#include "nccl_comm.h"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  }
}

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds within = std::chrono::milliseconds(5000)) {
  const auto until = std::chrono::steady_clock::now() + within;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// ---------------------------------------------------------------------------
// The copy kernel's split (Note [Copy alignment]), simulated over the kernel's
// own partition: block b owns elements [b * chunk, (b + 1) * chunk) of the
// segments laid end to end.
// ---------------------------------------------------------------------------

using fused_reducer::cuda::copy_chunk_elements;
using fused_reducer::cuda::CopySplit;
using fused_reducer::cuda::split_for_vectors;
using fused_reducer::cuda::vector_elements;

struct Segment {
  uintptr_t src;  // 0: zeros
  uintptr_t dst;
  int64_t numel;
};

struct PathCounts {
  int64_t scalar = 0;
  int64_t vector = 0;
  int64_t all_scalar_ranges = 0;  // ranges of at least one vector that got none
  int64_t ranges = 0;
  bool consistent = true;  // head + vectors * V + tail == n, both sides aligned at the vectors
};

PathCounts simulate(const std::vector<Segment>& segments, size_t src_size, size_t dst_size) {
  const int64_t chunk = copy_chunk_elements(src_size, dst_size);
  const int64_t vec = vector_elements(src_size, dst_size);
  std::vector<int64_t> starts{0};
  for (const auto& s : segments) starts.push_back(starts.back() + s.numel);
  PathCounts counts;
  for (int64_t begin = 0; begin < starts.back(); begin += chunk) {
    const int64_t end = std::min(begin + chunk, starts.back());
    for (size_t seg = 0; seg < segments.size(); ++seg) {
      const int64_t first = std::max(begin, starts[seg]) - starts[seg];
      const int64_t last = std::min(end, starts[seg + 1]) - starts[seg];
      if (first >= last) continue;
      const Segment& s = segments[seg];
      const uintptr_t src = s.src ? s.src + first * src_size : 0;
      const uintptr_t dst = s.dst + first * dst_size;
      const int64_t n = last - first;
      const CopySplit split = split_for_vectors(src, src_size, dst, dst_size, n);
      counts.ranges += 1;
      counts.scalar += split.head + split.tail;
      counts.vector += split.vectors * vec;
      if (split.head + split.vectors * vec + split.tail != n || split.head < 0 || split.tail < 0 ||
          (split.vectors > 0 && (split.head >= vec || split.tail >= vec))) {
        counts.consistent = false;
      }
      if (split.vectors > 0 && ((dst + split.head * dst_size) % 16 != 0 ||
                                (src && (src + split.head * src_size) % 16 != 0))) {
        counts.consistent = false;  // a vector access would be misaligned
      }
      if (split.vectors == 0 && n >= 2 * vec) {
        counts.all_scalar_ranges += 1;
      }
    }
  }
  return counts;
}

// The reducer's slot layout (Note [Slot layout] in ext/bucket_layout.cpp): every slot
// starts at a multiple of 16 bytes of the bucket; gradients are separate
// allocations (the caching allocator aligns them to 512 bytes).
std::vector<Segment> reducer_layout(const std::vector<int64_t>& numels, size_t grad_size,
                                    size_t bucket_size, bool unpack) {
  const int64_t align = std::max<int64_t>(1, 16 / static_cast<int64_t>(bucket_size));
  uintptr_t flat = 1 << 20;   // the bucket's flat buffer
  uintptr_t grad = 1u << 30;  // gradients, 512-byte aligned each
  int64_t offset = 0;
  std::vector<Segment> segments;
  for (int64_t n : numels) {
    const uintptr_t slot = flat + offset * bucket_size;
    segments.push_back(unpack ? Segment{slot, grad, n} : Segment{grad, slot, n});
    offset += (n + align - 1) / align * align;
    grad += (n * grad_size + 511) / 512 * 512;
  }
  return segments;
}

void test_copy_split() {
  const std::vector<int64_t> numels{1, 3, 7, 8, 31, 1000, 4097, 9999, 65537, 1 << 20, 333333};
  const size_t sizes[] = {2, 4, 8};
  for (size_t grad : sizes) {
    for (size_t bucket : sizes) {
      for (bool unpack : {false, true}) {
        const size_t src = unpack ? bucket : grad;
        const size_t dst = unpack ? grad : bucket;
        const PathCounts c = simulate(reducer_layout(numels, grad, bucket, unpack), src, dst);
        const std::string what = std::string(unpack ? "unpack" : "pack") + " of " +
                                 std::to_string(grad) + "-byte gradients, " +
                                 std::to_string(bucket) + "-byte bucket";
        expect(c.consistent, what + ": split adds up and vectors are aligned on both sides");
        // Every range of the reducer's layout vectorises: at most V - 1 scalar elements before
        // and after the vectors. Aligning the wider side instead (the old rule) leaves about
        // half of a widening unpack's ranges all scalar.
        expect(c.all_scalar_ranges == 0,
               what + ": " + std::to_string(c.all_scalar_ranges) + " of " +
                   std::to_string(c.ranges) + " ranges fell back to scalar");
        const int64_t vec = vector_elements(src, dst);
        expect(c.scalar <= c.ranges * 2 * (vec - 1),
               what + ": scalar elements only in heads and tails (" + std::to_string(c.scalar) +
                   " scalar, " + std::to_string(c.vector) + " vector)");
      }
    }
  }

  // Widening bf16 -> fp32 from every head offset: the narrower (source) side decides the head.
  for (int64_t first = 0; first < 64; ++first) {
    const uintptr_t src = 4096 + first * 2;
    const uintptr_t dst = 8192 + first * 4;
    const CopySplit split = split_for_vectors(src, 2, dst, 4, 10000);
    expect(split.vectors > 0 && split.head < 8 && (src + split.head * 2) % 16 == 0 &&
               (dst + split.head * 4) % 16 == 0,
           "bf16 -> fp32 from element " + std::to_string(first) + " vectorises after " +
               std::to_string(split.head) + " scalar elements");
    // Narrowing fp32 -> bf16: the destination is the narrower side.
    const CopySplit back = split_for_vectors(dst, 4, src, 2, 10000);
    expect(back.vectors > 0 && back.head < 8 && (src + back.head * 2) % 16 == 0,
           "fp32 -> bf16 from element " + std::to_string(first) + " vectorises");
  }
  // No common alignment: all scalar, never a misaligned vector.
  {
    const CopySplit odd = split_for_vectors(4096 + 2, 2, 8192, 4, 10000);  // src one bf16 off
    expect(odd.head == 10000 && odd.vectors == 0 && odd.tail == 0,
           "bf16 source one element off an fp32 destination's alignment: all scalar");
    const CopySplit unaligned = split_for_vectors(4096 + 1, 2, 8192, 2, 100);
    expect(unaligned.head == 100 && unaligned.vectors == 0,
           "a source not aligned to its own element size: all scalar");
    const CopySplit same = split_for_vectors(4096 + 4, 4, 8192 + 4, 4, 100);
    expect(same.head == 3 && same.vectors == 24 && same.tail == 1,
           "fp32 -> fp32 with both 4 bytes off: 3 head, 24 vectors of 4, 1 tail");
    const CopySplit zeros = split_for_vectors(0, 2, 8192 + 4, 4, 100);
    expect(zeros.head == 3 && zeros.vectors == 12 && zeros.tail == 1,
           "zeros into fp32: only the destination is aligned (vectors of 8 for a 2-byte pair)");
    const CopySplit tiny = split_for_vectors(4096 + 2, 2, 8192 + 4, 4, 3);
    expect(tiny.head == 3 && tiny.vectors == 0 && tiny.tail == 0,
           "a range shorter than its head: all scalar");
    const CopySplit empty = split_for_vectors(4096, 2, 8192, 4, 0);
    expect(empty.head == 0 && empty.vectors == 0 && empty.tail == 0, "an empty range");
  }
}

// ---------------------------------------------------------------------------
// A fake NCCL: every call on the communicator takes a while, and counts calls
// that overlap another one or come after the communicator was released.
// ---------------------------------------------------------------------------

using fused_reducer::cuda::NcclApi;
using fused_reducer::cuda::NcclComm;
using fused_reducer::cuda::Watchdog;

struct FakeNccl {
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::atomic<int> after_release{0};
  std::atomic<bool> released{false};
  std::atomic<int> calls{0};
  std::atomic<int> aborts{0};
  std::atomic<int> destroys{0};
  std::atomic<int> all_reduces{0};
  std::atomic<int> flag_unset_at_release{0};  // aborted() was false inside abort/destroy
  std::atomic<ncclResult_t> state{ncclSuccess};  // what ncclCommGetAsyncError reports
  std::atomic<int> in_progress_polls{0};         // ... after ncclInProgress this many times
  std::atomic<ncclResult_t> finalize_state{ncclSuccess};
  std::atomic<bool> hold_all_reduce{false};    // ncclAllReduce does not return while set
  std::atomic<bool> inside_all_reduce{false};
  // Sharded mode: calls, what the last one was given, and a hold like the all-reduce's.
  std::atomic<int> reduce_scatters{0};
  std::atomic<int> all_gathers{0};
  std::atomic<const void*> last_send{nullptr};
  std::atomic<void*> last_recv{nullptr};
  std::atomic<size_t> last_count{0};
  std::atomic<bool> hold_sharded{false};
  std::atomic<bool> inside_sharded{false};
  std::chrono::microseconds call_time{100};
  const NcclComm* comm = nullptr;
};
FakeNccl* fake = nullptr;
char fake_storage;
const ncclComm_t kFakeComm = reinterpret_cast<ncclComm_t>(&fake_storage);

class Call {
 public:
  explicit Call(ncclComm_t comm) {
    fake->calls += 1;
    if (comm != kFakeComm || fake->released.load()) fake->after_release += 1;
    if (fake->inside.fetch_add(1) != 0) fake->overlaps += 1;
    std::this_thread::sleep_for(fake->call_time);
  }
  ~Call() { fake->inside -= 1; }
};

ncclResult_t fake_all_reduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                             ncclComm_t comm, cudaStream_t) {
  Call call(comm);
  fake->all_reduces += 1;
  fake->inside_all_reduce = true;
  while (fake->hold_all_reduce.load()) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  fake->inside_all_reduce = false;
  return ncclInProgress;
}
void sharded_call(const void* send, void* recv, size_t count) {
  fake->last_send = send;
  fake->last_recv = recv;
  fake->last_count = count;
  fake->inside_sharded = true;
  while (fake->hold_sharded.load()) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  fake->inside_sharded = false;
}
ncclResult_t fake_reduce_scatter(const void* send, void* recv, size_t recv_count, ncclDataType_t,
                                 ncclRedOp_t, ncclComm_t comm, cudaStream_t) {
  Call call(comm);
  fake->reduce_scatters += 1;
  sharded_call(send, recv, recv_count);
  return ncclInProgress;
}
ncclResult_t fake_all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t,
                             ncclComm_t comm, cudaStream_t) {
  Call call(comm);
  fake->all_gathers += 1;
  sharded_call(send, recv, send_count);
  return ncclInProgress;
}
ncclResult_t fake_get_async_error(ncclComm_t comm, ncclResult_t* state) {
  Call call(comm);
  if (fake->in_progress_polls.load() > 0) {
    fake->in_progress_polls -= 1;
    *state = ncclInProgress;
  } else {
    *state = fake->state.load();
  }
  return ncclSuccess;
}
ncclResult_t fake_finalize(ncclComm_t comm) {
  Call call(comm);
  fake->state = fake->finalize_state.load();
  return ncclInProgress;
}
void released(ncclComm_t comm) {
  Call call(comm);
  if (fake->comm != nullptr && !fake->comm->aborted()) fake->flag_unset_at_release += 1;
  fake->released = true;
}
ncclResult_t fake_destroy(ncclComm_t comm) {
  released(comm);
  fake->destroys += 1;
  return ncclSuccess;
}
ncclResult_t fake_abort(ncclComm_t comm) {
  released(comm);
  fake->aborts += 1;
  return ncclSuccess;
}
const char* fake_last_error(ncclComm_t) { return "fake NCCL detail"; }

const NcclApi kFakeApi{fake_all_reduce,     fake_get_async_error, fake_finalize,
                       fake_destroy,        fake_abort,           fake_last_error,
                       fake_reduce_scatter, fake_all_gather};

void expect_clean(const FakeNccl& f, const std::string& what) {
  expect(f.overlaps.load() == 0,
         what + ": no NCCL call overlapped another (" + std::to_string(f.overlaps.load()) + ")");
  expect(f.after_release.load() == 0, what + ": no NCCL call after the release (" +
                                          std::to_string(f.after_release.load()) + ")");
  expect(f.flag_unset_at_release.load() == 0, what + ": aborted() was set before the release");
  expect(f.aborts.load() + f.destroys.load() <= 1, what + ": released once");
}

// Fake completion events: a cudaEvent_t is only a handle here.
struct FakeEvents {
  std::mutex mutex;
  std::map<cudaEvent_t, cudaError_t> state;
  int next = 1;
  std::shared_ptr<cudaEvent_t> make(cudaError_t initial = cudaErrorNotReady) {
    std::lock_guard<std::mutex> lock(mutex);
    auto* event = new cudaEvent_t(reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(next++)));
    state[*event] = initial;
    return std::shared_ptr<cudaEvent_t>(event);
  }
  void set(const std::shared_ptr<cudaEvent_t>& event, cudaError_t value) {
    std::lock_guard<std::mutex> lock(mutex);
    state[*event] = value;
  }
  Watchdog::EventQuery query() {
    return [this](cudaEvent_t event) {
      std::lock_guard<std::mutex> lock(mutex);
      return state.at(event);
    };
  }
};

// The watchdog thread's cudaSetDevice, faked: these tests run without a GPU.
cudaError_t device_selected(int) { return cudaSuccess; }
cudaError_t no_such_device(int) { return cudaErrorInvalidDevice; }

std::string watchdog_error(const Watchdog& watchdog) {
  return error_of([&] { watchdog.check(); });
}

void test_comm_lock_discipline() {
  using namespace std::chrono_literals;
  {  // The watchdog's abort while the hook thread keeps all-reducing (enqueue polls included).
    FakeNccl f;
    fake = &f;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    std::atomic<bool> go{true};
    std::atomic<bool> hook_failed{false};
    std::string hook_error;  // read after hook_failed (or the join)
    std::thread hook([&] {
      while (go.load()) {
        f.in_progress_polls = 3;  // each enqueue is polled a few times
        const std::string e = error_of(
            [&] { comm->allreduce(nullptr, 1, ncclFloat32, ncclSum, nullptr, 10000ms); });
        if (!e.empty()) {
          hook_error = e;
          hook_failed = true;
          return;
        }
      }
    });
    std::thread poller([&] {  // the watchdog's polls
      for (int i = 0; i < 50 && go.load(); ++i) {
        comm->async_error();
        (void)comm->last_error();
        std::this_thread::sleep_for(200us);
      }
      comm->abort();
    });
    poller.join();
    expect(eventually([&] { return hook_failed.load(); }), "the hook thread sees the abort");
    go = false;
    hook.join();
    expect(contains(hook_error, "aborted after an earlier error"),
           "an all-reduce after the abort names it: " + hook_error);
    expect(f.all_reduces.load() > 1, "the hook thread was not starved by the polls (" +
                                         std::to_string(f.all_reduces.load()) + " all-reduces)");
    expect(comm->aborted() && f.aborts.load() == 1, "aborted once");
    expect(!comm->close(100ms), "close() after an abort releases nothing");
    expect(comm->async_error() == ncclInvalidUsage, "a released communicator reports misuse");
    expect_clean(f, "abort racing the hook thread");
    f.comm = nullptr;
  }
  {  // An abort while the hook thread is inside ncclAllReduce waits for that call to return
     // (the same lock), deterministically.
    FakeNccl f;
    fake = &f;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    f.hold_all_reduce = true;
    std::thread hook([&] {
      (void)error_of([&] { comm->allreduce(nullptr, 1, ncclFloat32, ncclSum, nullptr, 10000ms); });
    });
    expect(eventually([&] { return f.inside_all_reduce.load(); }), "the hook is inside NCCL");
    std::thread watchdog([&] { comm->abort(); });
    std::this_thread::sleep_for(20ms);
    expect(f.aborts.load() == 0, "the abort waits while ncclAllReduce runs on the communicator");
    f.hold_all_reduce = false;
    watchdog.join();
    hook.join();
    expect(f.aborts.load() == 1 && comm->aborted(), "then it aborts");
    expect_clean(f, "abort while inside ncclAllReduce");
    f.comm = nullptr;
  }
  {  // An enqueue that never completes: the abort gets in between its polls.
    FakeNccl f;
    fake = &f;
    NcclComm comm(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = &comm;
    f.state = ncclInProgress;
    std::string hook_error;
    const auto start = std::chrono::steady_clock::now();
    std::thread hook([&] {
      hook_error = error_of(
          [&] { comm.allreduce(nullptr, 1, ncclFloat32, ncclSum, nullptr, 30000ms); });
    });
    std::this_thread::sleep_for(20ms);
    comm.abort();
    hook.join();
    expect(std::chrono::steady_clock::now() - start < 5s,
           "a stuck enqueue ends at the abort, not at its own 30 s timeout");
    expect(contains(hook_error, "aborted") && contains(hook_error, "enqueuing an all-reduce"),
           "the stuck enqueue says it was aborted: " + hook_error);
    expect_clean(f, "abort during a stuck enqueue");
    f.comm = nullptr;
  }
  {  // Its own timeout aborts too, and says so.
    FakeNccl f;
    fake = &f;
    NcclComm comm(kFakeApi, kFakeComm, 1, 2, 0);
    f.comm = &comm;
    f.state = ncclInProgress;
    const std::string e =
        error_of([&] { comm.allreduce(nullptr, 1, ncclFloat32, ncclSum, nullptr, 20ms); });
    expect(contains(e, "timed out after 20 ms enqueuing an all-reduce") &&
               contains(e, "rank 1 of 2"),
           "an enqueue past its timeout: " + e);
    expect(comm.aborted() && f.aborts.load() == 1, "... aborts the communicator");
    expect_clean(f, "enqueue timeout");
    f.comm = nullptr;
  }
  {  // Clean close: finalize polled, then destroy, flag first; idempotent; nothing after.
    FakeNccl f;
    fake = &f;
    NcclComm comm(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = &comm;
    f.in_progress_polls = 5;
    expect(comm.close(5000ms), "close() finalizes cleanly");
    expect(f.destroys.load() == 1 && f.aborts.load() == 0, "... and destroys once");
    expect(!comm.close(5000ms), "close() is idempotent");
    comm.abort();
    const std::string e =
        error_of([&] { comm.allreduce(nullptr, 1, ncclFloat32, ncclSum, nullptr, 1000ms); });
    expect(contains(e, "closed"), "an all-reduce after close() is refused: " + e);
    expect_clean(f, "clean close");
    f.comm = nullptr;
  }
  {  // A finalize that never ends: aborted at the deadline. And an abort racing the close.
    FakeNccl f;
    fake = &f;
    NcclComm comm(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = &comm;
    f.finalize_state = ncclInProgress;
    std::thread racer([&] {
      for (int i = 0; i < 20; ++i) {
        comm.async_error();
        std::this_thread::sleep_for(100us);
      }
      comm.abort();
    });
    expect(!comm.close(30ms), "a stuck finalize is not clean");
    racer.join();
    expect(f.aborts.load() == 1 && f.destroys.load() == 0, "... it is aborted, once");
    expect_clean(f, "stuck finalize racing an abort");
    f.comm = nullptr;
  }
  fake = nullptr;
}

// Sharded mode (Note [NCCL reduce-scatter and all-gather]): ncclReduceScatter and ncclAllGather go
// through the communicator's locks like ncclAllReduce (no overlap with the watchdog's polls, an
// abort waits while one runs, none after the release), in place on this rank's shard.
void test_sharded_collectives() {
  using namespace std::chrono_literals;
  using fused_reducer::cuda::nccl_type_bytes;
  expect(nccl_type_bytes(ncclBfloat16) == 2 && nccl_type_bytes(ncclFloat64) == 8 &&
             nccl_type_bytes(ncclInt32) == 4 && nccl_type_bytes(ncclUint8) == 1,
         "NCCL element sizes");
  expect(contains(error_of([] { (void)nccl_type_bytes(static_cast<ncclDataType_t>(99)); }),
                  "data type 99"),
         "an unknown NCCL type is refused");
  static float buffer[3 * 8];
  for (const bool gather : {false, true}) {
    const std::string kind = gather ? "all-gather" : "reduce-scatter";
    auto run = [&](NcclComm& comm, std::chrono::milliseconds timeout) {
      if (gather) {
        comm.all_gather(buffer, 8, ncclFloat32, nullptr, timeout);
      } else {
        comm.reduce_scatter(buffer, 8, ncclFloat32, ncclSum, nullptr, timeout);
      }
    };
    {  // In place on rank 2's shard, while the watchdog polls; then its abort.
      FakeNccl f;
      fake = &f;
      auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 2, 3, 0);
      f.comm = comm.get();
      std::atomic<bool> go{true};
      std::string hook_error;
      std::atomic<bool> hook_failed{false};
      std::thread hook([&] {
        while (go.load()) {
          f.in_progress_polls = 3;
          const std::string e = error_of([&] { run(*comm, 10000ms); });
          if (!e.empty()) {
            hook_error = e;
            hook_failed = true;
            return;
          }
        }
      });
      std::thread poller([&] {
        for (int i = 0; i < 50 && go.load(); ++i) {
          comm->async_error();
          (void)comm->last_error();
          std::this_thread::sleep_for(200us);
        }
        comm->abort();
      });
      poller.join();
      expect(eventually([&] { return hook_failed.load(); }), kind + ": the hook sees the abort");
      go = false;
      hook.join();
      const int calls = gather ? f.all_gathers.load() : f.reduce_scatters.load();
      expect(calls > 1 && f.all_reduces.load() == 0,
             kind + ": went through its own NCCL entry point (" + std::to_string(calls) + ")");
      const void* shard = buffer + 2 * 8;
      const bool in_place = gather ? (f.last_send.load() == shard && f.last_recv.load() == buffer)
                                   : (f.last_send.load() == buffer && f.last_recv.load() == shard);
      expect(in_place && f.last_count.load() == 8,
             kind + ": in place, this rank's shard of 8 elements");
      expect(contains(hook_error, "aborted after an earlier error") &&
                 contains(hook_error, gather ? "an all-gather" : "a reduce-scatter"),
             kind + " after the abort names it: " + hook_error);
      expect_clean(f, kind + " racing the watchdog");
      f.comm = nullptr;
    }
    {  // An abort while the hook thread is inside the call waits for it (the same lock).
      FakeNccl f;
      fake = &f;
      auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
      f.comm = comm.get();
      f.hold_sharded = true;
      std::thread hook([&] { (void)error_of([&] { run(*comm, 10000ms); }); });
      expect(eventually([&] { return f.inside_sharded.load(); }), kind + ": inside NCCL");
      std::thread watchdog([&] { comm->abort(); });
      std::this_thread::sleep_for(20ms);
      expect(f.aborts.load() == 0, "the abort waits while the " + kind + " runs");
      f.hold_sharded = false;
      watchdog.join();
      hook.join();
      expect(f.aborts.load() == 1 && comm->aborted(), kind + ": then it aborts");
      expect_clean(f, "abort while inside the " + kind);
      f.comm = nullptr;
    }
    {  // A stuck enqueue times out and aborts; after close(), refused.
      FakeNccl f;
      fake = &f;
      NcclComm comm(kFakeApi, kFakeComm, 1, 2, 0);
      f.comm = &comm;
      f.state = ncclInProgress;
      const std::string e = error_of([&] { run(comm, 20ms); });
      expect(contains(e, "timed out after 20 ms enqueuing " +
                             std::string(gather ? "an all-gather" : "a reduce-scatter")),
             kind + " enqueue past its timeout: " + e);
      expect(comm.aborted() && f.aborts.load() == 1, kind + ": ... aborts the communicator");
      expect_clean(f, kind + " enqueue timeout");
      f.comm = nullptr;
    }
    {
      FakeNccl f;
      fake = &f;
      NcclComm comm(kFakeApi, kFakeComm, 0, 2, 0);
      f.comm = &comm;
      expect(comm.close(5000ms), "close() finalizes cleanly");
      const std::string e = error_of([&] { run(comm, 1000ms); });
      expect(contains(e, "closed"), kind + " after close() is refused: " + e);
      expect_clean(f, kind + " after close");
      f.comm = nullptr;
    }
  }
  {  // An API without the sharded entry points refuses them instead of calling null.
    FakeNccl f;
    fake = &f;
    const NcclApi old{fake_all_reduce, fake_get_async_error, fake_finalize,
                      fake_destroy,    fake_abort,           fake_last_error};
    NcclComm comm(old, kFakeComm, 0, 2, 0);
    f.comm = &comm;
    expect(contains(error_of([&] { comm.reduce_scatter(buffer, 8, ncclFloat32, ncclSum, nullptr,
                                                       1000ms); }), "no reduce-scatter"),
           "no reduce-scatter entry point");
    expect(contains(error_of([&] { comm.all_gather(buffer, 8, ncclFloat32, nullptr, 1000ms); }),
                    "no all-gather"),
           "no all-gather entry point");
    expect(comm.close(5000ms), "close() finalizes cleanly");
    f.comm = nullptr;
  }
  fake = nullptr;
}

void test_watchdog() {
  using namespace std::chrono_literals;
  const std::string bucket = "all-reduce of bucket 3 of 7 (12 parameters, 4.00 MB, first "
                             "'layer.weight') on cuda:0";
  {  // Completion: popped in order, no error, drain returns.
    FakeNccl f;
    fake = &f;
    FakeEvents events;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    Watchdog watchdog(comm, events.query(), device_selected);
    auto a = events.make(), b = events.make();
    watchdog.watch(a, 10000ms, "a");
    watchdog.watch(b, 10000ms, "b");
    std::this_thread::sleep_for(5ms);
    expect(watchdog.in_flight() == 2, "two collectives in flight");
    events.set(b, cudaSuccess);  // b completes first: the oldest (a) still decides
    std::this_thread::sleep_for(5ms);
    expect(watchdog.in_flight() == 2, "collectives retire in order");
    events.set(a, cudaSuccess);
    watchdog.drain(5000ms);
    expect(watchdog.in_flight() == 0, "drain() returns once all completed");
    expect(watchdog_error(watchdog).empty() && !comm->aborted(), "no error, not aborted");
    watchdog.stop();
    expect_clean(f, "watchdog, completions");
    f.comm = nullptr;
  }
  {  // Timeout: the error names the bucket, the communicator is aborted under its lock while the
     // hook thread keeps calling into it.
    FakeNccl f;
    fake = &f;
    FakeEvents events;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    Watchdog watchdog(comm, events.query(), device_selected);
    auto stuck = events.make();
    watchdog.watch(stuck, 30ms, bucket);
    std::atomic<bool> go{true};
    std::thread hook([&] {
      while (go.load()) {
        f.in_progress_polls = 2;
        if (!error_of([&] {
               comm->allreduce(nullptr, 1, ncclFloat32, ncclSum, nullptr, 10000ms);
             }).empty()) {
          return;
        }
      }
    });
    expect(eventually([&] { return !watchdog_error(watchdog).empty(); }), "the timeout is seen");
    watchdog.drain(5000ms);  // returns on the error
    watchdog.stop();  // joins: the abort is complete
    go = false;
    hook.join();
    const std::string e = watchdog_error(watchdog);
    expect(contains(e, "bucket 3 of 7") && contains(e, "first 'layer.weight'") &&
               contains(e, "did not complete within its timeout") &&
               contains(e, "rank 0 of 2") && !contains(e, "all-reduce #"),
           "the timeout names the bucket: " + e);
    expect(comm->aborted() && f.aborts.load() == 1, "the watchdog aborted the communicator");
    expect(watchdog.in_flight() == 0, "nothing left in flight");
    expect_clean(f, "watchdog timeout racing the hook thread");
    f.comm = nullptr;
  }
  {  // NCCL's asynchronous error, and the first failure is the one reported.
    FakeNccl f;
    fake = &f;
    FakeEvents events;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    Watchdog watchdog(comm, events.query(), device_selected);
    auto first = events.make(), second = events.make();
    watchdog.watch(first, 10000ms, bucket);
    watchdog.watch(second, 10000ms, "all-reduce of bucket 4 of 7");
    f.state = ncclRemoteError;
    expect(eventually([&] { return !watchdog_error(watchdog).empty(); }),
           "the async error is seen");
    watchdog.stop();
    const std::string e = watchdog_error(watchdog);
    expect(contains(e, "bucket 3 of 7") && !contains(e, "bucket 4 of 7") &&
               contains(e, "asynchronous error") && contains(e, "fake NCCL detail"),
           "NCCL's asynchronous error names the oldest bucket and NCCL's detail: " + e);
    expect(comm->aborted(), "... and aborts");
    expect_clean(f, "watchdog, asynchronous error");
    f.comm = nullptr;
  }
  {  // A failed kernel.
    FakeNccl f;
    fake = &f;
    FakeEvents events;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    Watchdog watchdog(comm, events.query(), device_selected);
    watchdog.watch(events.make(cudaErrorLaunchFailure), 10000ms, bucket);
    expect(eventually([&] { return !watchdog_error(watchdog).empty(); }), "the GPU error is seen");
    watchdog.stop();
    const std::string e = watchdog_error(watchdog);
    expect(contains(e, "bucket 3 of 7") && contains(e, "failed on the GPU"),
           "a failed kernel names the bucket: " + e);
    expect_clean(f, "watchdog, GPU error");
    f.comm = nullptr;
  }
  {  // The thread cannot select the communicator's device: it reports that and aborts at once
     // instead of watching nothing.
    FakeNccl f;
    fake = &f;
    FakeEvents events;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 3);
    f.comm = comm.get();
    Watchdog watchdog(comm, events.query(), no_such_device);
    expect(eventually([&] { return !watchdog_error(watchdog).empty(); }),
           "a failed cudaSetDevice is reported");
    watchdog.watch(events.make(), 10000ms, bucket);
    watchdog.drain(5000ms);  // returns on the error, does not wait for the deadline
    watchdog.stop();
    const std::string e = watchdog_error(watchdog);
    expect(contains(e, "could not select cuda:3") && contains(e, "aborted"),
           "the error names the device: " + e);
    expect(comm->aborted() && f.aborts.load() == 1, "... and the communicator is aborted");
    expect_clean(f, "watchdog without its device");
    f.comm = nullptr;
  }
  {  // Stopped explicitly while a pending collective still holds it: its thread is joined and
     // makes no call on the communicator, which can then be closed safely.
    FakeNccl f;
    fake = &f;
    FakeEvents events;
    auto comm = std::make_shared<NcclComm>(kFakeApi, kFakeComm, 0, 2, 0);
    f.comm = comm.get();
    auto watchdog = std::make_shared<Watchdog>(comm, events.query(), device_selected);
    std::shared_ptr<Watchdog> pending = watchdog;  // as PendingNccl holds it
    watchdog->watch(events.make(), 10000ms, bucket);
    std::this_thread::sleep_for(5ms);
    watchdog->stop();
    watchdog.reset();
    const int calls = f.calls.load();
    std::this_thread::sleep_for(20ms);
    expect(f.calls.load() == calls, "a stopped watchdog makes no NCCL call");
    pending->watch(events.make(), 10000ms, "after stop");
    expect(pending->in_flight() == 0, "a stopped watchdog watches nothing");
    f.finalize_state = ncclSuccess;
    expect(comm->close(1000ms), "the communicator closes cleanly after the watchdog stopped");
    std::this_thread::sleep_for(5ms);
    expect(watchdog_error(*pending).empty(), "stopping is not an error");
    pending->stop();  // idempotent
    pending.reset();
    expect_clean(f, "watchdog stopped while a pending collective holds it");
    f.comm = nullptr;
  }
  fake = nullptr;
}

}  // namespace

int main() {
  using fused_reducer::cuda::NcclComm;
  using namespace std::chrono_literals;

  expect(fused_reducer::cuda::nccl_version() >= 21000, "NCCL >= 2.10 (ncclAvg)");
  test_copy_split();
  test_comm_lock_discipline();
  test_sharded_collectives();
  test_watchdog();

  {  // Note [No NCCL collective under graph capture]: the refusal names the device, why, the fix.
    using fused_reducer::cuda::capture_refusal;
    expect(capture_refusal(cudaStreamCaptureStatusNone, 0).empty(), "no capture, no refusal");
    const std::string active = capture_refusal(cudaStreamCaptureStatusActive, 2);
    expect(contains(active, "cuda:2") && contains(active, "being captured into a CUDA graph") &&
               contains(active, "torch.cuda.graph") && contains(active, "outside the graph"),
           "the refusal under capture names the device and the fix: " + active);
    expect(contains(capture_refusal(cudaStreamCaptureStatusInvalidated, 0), "invalidated"),
           "an invalidated capture is refused too");
  }
  const std::string bad_id = error_of([] { NcclComm comm("short", 0, 1, 0, 1000ms); });
  expect(bad_id.find("unique id has 128 bytes") != std::string::npos,
         "a malformed unique id is refused naming the expected size: " + bad_id);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::cout << "no GPU: device checks of the CUDA core skipped\n";
  } else {
    // World size 1 on GPU 0: in-place sum of ones stays ones; average too.
    NcclComm comm(fused_reducer::cuda::nccl_unique_id(), 0, 1, 0, 30000ms);
    float* data = nullptr;
    expect(cudaMalloc(&data, 1024 * sizeof(float)) == cudaSuccess, "cudaMalloc");
    float host[1024];
    for (float& x : host) x = 1.0f;
    cudaMemcpy(data, host, sizeof(host), cudaMemcpyHostToDevice);
    comm.allreduce(data, 1024, ncclFloat32, ncclSum, nullptr, 30000ms);
    cudaMemcpy(host, data, sizeof(host), cudaMemcpyDeviceToHost);
    expect(host[0] == 1.0f && host[1023] == 1.0f, "world-1 all-reduce keeps the values");
    expect(comm.close(10000ms), "close() finalizes cleanly");
    expect(!comm.close(10000ms), "close() is idempotent");
    const std::string after = error_of([&] {
      comm.allreduce(data, 1024, ncclFloat32, ncclSum, nullptr, 1000ms);
    });
    expect(after.find("closed") != std::string::npos || after.find("aborted") != std::string::npos,
           "an all-reduce after close() is refused: " + after);
    cudaFree(data);
  }
  if (failures == 0) {
    std::cout << "cuda core: all checks passed\n";
  }
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
