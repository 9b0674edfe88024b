// The shared-memory segment of the shm transport and its all-reduce protocol
// (header, slots, arrivals, waits). Torch-free, like cuda/: it is tested alone,
// with ranks as threads and as processes, under ThreadSanitizer and
// AddressSanitizer + UBSan (tests/cpp/test_shm_segment.cpp). ShmTransport
// (shm_transport.h) adds the worker thread, the jobs and the dtypes.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace fused_reducer::shm {

constexpr uint64_t kMagic = 0x46525f53484d3033ULL;  // "FR_SHM03": RankState::op
constexpr int kMaxWorld = 64;
constexpr int64_t kMinChunkBytes = 4096;
constexpr int64_t kMaxChunkBytes = int64_t(1) << 30;
// The longest wait there is: longer timeouts (inf, timedelta.max) are clamped to
// it ("no timeout" in practice) and stay far from overflowing a steady_clock
// time point in nanoseconds.
constexpr std::chrono::milliseconds kLongestTimeout{int64_t(365) * 24 * 3600 * 1000};

// Seconds (a user's timeout) to milliseconds: NaN and <= 0 give 0 (fail at once),
// inf and anything beyond kLongestTimeout give kLongestTimeout. Never overflows.
std::chrono::milliseconds timeout_from_seconds(double seconds);
std::chrono::milliseconds clamp_timeout(std::chrono::milliseconds timeout);

// One cache line per rank, so arrivals do not contend.
struct alignas(64) RankState {
  std::atomic<uint64_t> arrived{0};  // 2k+1: chunk k copied in; 2k+2: its part summed
  std::atomic<int64_t> pid{0};
  std::atomic<uint64_t> start_time{0};  // /proc/<pid>/stat starttime: tells a reused pid apart
  std::atomic<uint64_t> pid_namespace{0};  // inode of /proc/self/ns/pid (0: unknown)
  std::atomic<int64_t> numel{0};     // the bucket being reduced, checked equal across ranks
  std::atomic<int32_t> dtype{0};
  std::atomic<int32_t> op{0};        // its Collective, likewise
};

// Note [Shared-memory segment trust]
// Every process that can open the segment can rewrite it, so nothing read from
// it decides where a rank reads or writes: the slot offsets and the mapping's
// size come from this rank's own world size and chunk size (Layout), checked for
// range and overflow, and the header's copies of them are compared once, at
// attach. Attaching also requires a regular file owned by this user with mode
// 0600 and exactly the expected size. Values read from the header later (arrival
// counters, pids, bucket sizes) can at worst make a wait pass or fail early,
// never an access out of bounds.
struct Header {
  uint64_t magic;       // offset 0
  int32_t world;        // offset 8: checked at attach, never used for offsets
  int64_t chunk_bytes;  // offset 16: likewise
  std::atomic<uint32_t> wake{0};     // futex word: bumped by every arrival
  std::atomic<int32_t> sleepers{0};  // ranks asleep on `wake` (arrivals skip the syscall otherwise)
  std::atomic<int32_t> stopped{0};   // rank + 1 of the first rank that failed or closed
  RankState ranks[kMaxWorld];
};

// Errors of the protocol; the transport turns them into Python RuntimeErrors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The job's own wait gave up (timed out): the bucket is no longer this rank's to touch.
class Cancelled : public Error {
 public:
  using Error::Error;
};

// Where everything lies, from local values only (See Note [Shared-memory segment trust]).
struct Layout {
  int world = 0;
  int64_t chunk_bytes = 0;
  size_t data_offset = 0;
  size_t total_bytes = 0;

  // Throws Error naming the value out of range.
  static Layout make(int world, int64_t chunk_bytes);
  // Slot `index` of set `set`: 0..world-1 are the ranks' inputs, world the result.
  size_t slot_offset(int set, int index) const {
    return data_offset + (static_cast<size_t>(set) * static_cast<size_t>(world + 1) +
                          static_cast<size_t>(index)) * static_cast<size_t>(chunk_bytes);
  }
};

// How long a wait may take and what else ends it.
struct WaitLimits {
  std::chrono::milliseconds timeout{kLongestTimeout};
  // close(): waits give up after this steady_clock time (ns since its epoch).
  const std::atomic<int64_t>* abort_after_ns = nullptr;
  // The bucket's own wait gave up: throw Cancelled.
  const std::atomic<bool>* cancelled = nullptr;
  // Peers' processes are checked for liveness (Segment::peers_watchable()).
  bool check_peers = false;
  // Where a wait tells the rank it is waiting for (-1 once none), for the caller's messages.
  std::atomic<int>* waiting_for = nullptr;
};

class Segment {
 public:
  // Creates the segment `name` (a POSIX shm name "/...", O_EXCL, mode 0600) and
  // reserves its pages. Throws Error naming why it cannot.
  static std::unique_ptr<Segment> create(const std::string& name, int world, int64_t chunk_bytes);
  // Maps an existing segment after checking it (See Note [Shared-memory segment trust]).
  static std::unique_ptr<Segment> attach(const std::string& name, int world, int64_t chunk_bytes);
  // Unmaps, in the process that mapped it only: the mapping is not inherited by
  // forked children (MADV_DONTFORK), and a child must not unmap what may now be
  // something else at that address.
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const Layout& layout() const { return layout_; }
  const std::string& name() const { return name_; }
  Header& header() { return *header_; }
  char* slot(int set, int index) { return base_ + layout_.slot_offset(set, index); }
  // Removes the segment's name (idempotent; the mapping stays).
  void unlink();

  // Records this process (pid, start time, pid namespace) as `rank`.
  void register_rank(int rank);
  // True when every rank registered from this pid namespace: their pids mean
  // the same processes here, so peers' exits can be noticed.
  bool peers_watchable() const;

  void arrive(int rank, uint64_t arrival);
  // Until every rank has arrived at `arrival`; throws Error (a peer stopped,
  // exited, the timeout, close()) or Cancelled.
  void wait_for_all(uint64_t arrival, const char* phase, const WaitLimits& limits);
  // Marks the segment stopped by `rank` (the first one wins) and wakes every waiter.
  void stop(int rank);

 private:
  Segment(std::string name, Layout layout, char* base);
  std::string name_;
  Layout layout_;
  char* base_;
  Header* header_;
  pid_t mapped_by_;
};

// What a rank runs on a bucket (Note [Shared-memory reduce-scatter and all-gather] in
// shm_transport.h); compared across ranks with the bucket's size and dtype.
enum class Collective : int32_t { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2 };
// "all-reduce", "reduce-scatter", "all-gather", or "an unknown collective (<code>)": any int32.
std::string collective_name(int32_t code);

// One bucket as the protocol sees it: plain elements of `element_bytes`, moved in
// and out through callbacks (the transport does that under the job's lock).
struct BucketIo {
  int64_t numel = 0;          // elements summed (complex: twice the complex count)
  int64_t element_bytes = 0;  // 1, 2, 4 or 8
  int64_t check_numel = 0;    // what every rank must agree on (the caller's count)
  int32_t check_dtype = 0;    //   and dtype code
  std::function<std::string(int32_t)> dtype_name;  // for the mismatch message; any int32
  // Bucket elements [first, first + count) -> `slot`.
  std::function<void(char* slot, int64_t first, int64_t count)> copy_in;
  // `slot` -> bucket elements [first, first + count).
  std::function<void(const char* slot, int64_t first, int64_t count)> copy_out;
  // out[0..count) = in[0][..] + ... + in[world-1][..], in rank order.
  std::function<void(char* out, const std::vector<const char*>& in, int64_t count)> sum;
};

// Sums `bucket` across the ranks, chunk by chunk (Note [Shared-memory all-reduce]
// in shm_transport.h). `chunks_done` counts the chunks this rank has moved so
// far (the same on every rank) and is advanced.
void reduce(Segment& segment, int rank, const BucketIo& bucket, uint64_t& chunks_done,
            const WaitLimits& limits);
// Sharded mode (Note [Shared-memory reduce-scatter and all-gather]): bucket.numel is a
// multiple of the world size (else Error naming both) and rank r owns elements
// [r * numel / world, (r + 1) * numel / world). reduce_scatter() sums as reduce() does, the
// same code over the same parts in the same order, but copies out only this rank's shard;
// all_gather() copies in only this rank's shard (bucket.sum is not called) and copies out
// the whole bucket.
void reduce_scatter(Segment& segment, int rank, const BucketIo& bucket, uint64_t& chunks_done,
                    const WaitLimits& limits);
void all_gather(Segment& segment, int rank, const BucketIo& bucket, uint64_t& chunks_done,
                const WaitLimits& limits);
// Any of the three.
void run(Segment& segment, int rank, Collective op, const BucketIo& bucket, uint64_t& chunks_done,
         const WaitLimits& limits);

// out = in[0] + in[1] + ... in rank order, for plain arithmetic types. Integers
// wrap around like torch's and gloo's sums: summed as unsigned (a signed overflow
// is undefined behaviour in C++).
template <typename T>
void sum_inputs(T* out, const std::vector<const T*>& in, int64_t n) {
  static_assert(std::is_arithmetic_v<T>);
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    using U = std::make_unsigned_t<T>;
    for (int64_t i = 0; i < n; ++i) {
      U acc = static_cast<U>(in[0][i]);
      for (size_t r = 1; r < in.size(); ++r) acc = static_cast<U>(acc + static_cast<U>(in[r][i]));
      out[i] = static_cast<T>(acc);  // modular since C++20
    }
  } else {
    const T* a = in[0];
    if (in.size() == 1) {
      for (int64_t i = 0; i < n; ++i) out[i] = a[i];
      return;
    }
    const T* b = in[1];
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    for (size_t r = 2; r < in.size(); ++r) {
      const T* c = in[r];
      for (int64_t i = 0; i < n; ++i) out[i] += c[i];
    }
  }
}

// Process identity helpers (Linux /proc), exposed for the tests.
uint64_t process_start_time(pid_t pid);  // 0 when unknown
uint64_t pid_namespace_id();             // 0 when unknown
// False once `pid` has exited (also as an unreaped zombie), or when it is now
// another process than the one that started at `start_time` (0: not checked).
bool process_alive(pid_t pid, uint64_t start_time);

}  // namespace fused_reducer::shm
