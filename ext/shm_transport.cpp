#include "shm_transport.h"

#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <climits>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

namespace fused_reducer {

namespace {

constexpr uint64_t kMagic = 0x46525f53484d3031ULL;  // "FR_SHM01"
constexpr int kMaxWorld = 64;
constexpr size_t kPage = 4096;
constexpr auto kSleepSlice = std::chrono::milliseconds(20);
constexpr auto kPeerCheckEvery = std::chrono::milliseconds(100);

std::string os_error(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

}  // namespace

// One cache line per rank, so arrivals do not contend.
struct alignas(64) RankState {
  std::atomic<uint64_t> arrived{0};  // 2k+1: chunk k copied in; 2k+2: its part summed
  std::atomic<int64_t> pid{0};
  std::atomic<int64_t> numel{0};     // the bucket being reduced, checked equal across ranks
  std::atomic<int32_t> dtype{0};
};

struct ShmTransport::Segment {
  uint64_t magic;
  int32_t world;
  int64_t chunk_bytes;
  std::atomic<uint32_t> wake{0};     // futex word: bumped by every arrival
  std::atomic<int32_t> sleepers{0};  // ranks asleep on `wake` (arrivals skip the syscall otherwise)
  std::atomic<int32_t> stopped{0};   // rank + 1 of the first rank that failed or closed
  RankState ranks[kMaxWorld];

  static size_t data_offset() { return (sizeof(Segment) + kPage - 1) / kPage * kPage; }
  static size_t bytes(int world, int64_t chunk_bytes) {
    return data_offset() + size_t(2) * (world + 1) * chunk_bytes;
  }
  // Slot `index` of set `set`: 0..world-1 are the ranks' inputs, world the result.
  char* slot(int set, int index) {
    return reinterpret_cast<char*>(this) + data_offset() +
           (size_t(set) * (world + 1) + index) * chunk_bytes;
  }
};

struct ShmTransport::Job {
  explicit Job(at::Tensor t) : flat(std::move(t)) {}
  at::Tensor flat;
  std::mutex mutex;
  std::condition_variable finished;
  std::atomic<bool> done{false};
  std::string error;

  void finish(const std::string& failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      error = failure;
      done = true;
    }
    finished.notify_all();
    flat = at::Tensor();  // the reducer keeps the buffer; we need not
  }
};

namespace {

class PendingShm : public PendingCollective {
 public:
  explicit PendingShm(std::shared_ptr<ShmTransport::Job> job) : job_(std::move(job)) {}
  bool completed() override { return job_->done.load(std::memory_order_acquire); }
  void wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(job_->mutex);
    if (!job_->finished.wait_for(lock, timeout, [&] { return job_->done.load(); })) {
      throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms");
    }
    if (!job_->error.empty()) {
      throw std::runtime_error(job_->error);
    }
  }

 private:
  std::shared_ptr<ShmTransport::Job> job_;
};

// False once `pid` has exited, also while it is a zombie not yet reaped by its
// parent (kill() still succeeds then).
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return true;  // no /proc: trust kill()
  char line[512];
  const size_t n = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[n] = '\0';
  const char* state = std::strrchr(line, ')');  // "pid (comm) S ..."
  return state == nullptr || state[1] == '\0' || (state[2] != 'Z' && state[2] != 'X');
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// out = in[0] + in[1] + ... in rank order (gradients; integers: the reducer's
// used-parameter counts). Half types accumulate in float and round once, which for
// two ranks is exactly what a half-precision add gives.
template <typename T>
void sum_inputs(T* out, const std::vector<const T*>& in, int64_t n) {
  if constexpr (!std::is_same_v<T, c10::Half> && !std::is_same_v<T, c10::BFloat16>) {
    const T* a = in[0];
    const T* b = in.size() > 1 ? in[1] : nullptr;
    if (b == nullptr) {
      std::memcpy(out, a, n * sizeof(T));
      return;
    }
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    for (size_t r = 2; r < in.size(); ++r) {
      const T* c = in[r];
      for (int64_t i = 0; i < n; ++i) out[i] += c[i];
    }
  } else {
    constexpr int64_t kBlock = 512;
    float acc[kBlock];
    for (int64_t start = 0; start < n; start += kBlock) {
      const int64_t len = std::min(kBlock, n - start);
      for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<float>(in[0][start + i]);
      for (size_t r = 1; r < in.size(); ++r) {
        for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(in[r][start + i]);
      }
      for (int64_t i = 0; i < len; ++i) out[start + i] = static_cast<T>(acc[i]);
    }
  }
}

}  // namespace

ShmTransport::ShmTransport(const std::string& name, bool create, int rank, int world_size,
                           int64_t chunk_bytes, std::chrono::milliseconds timeout)
    : shm_name_(name), rank_(rank), world_(world_size), chunk_bytes_(chunk_bytes),
      timeout_(timeout) {
  TORCH_CHECK(world_size >= 1 && world_size <= kMaxWorld, "FusedReducer shm transport: world size ",
              world_size, " is outside 1..", kMaxWorld, "; use backend='process_group'");
  TORCH_CHECK(rank >= 0 && rank < world_size, "FusedReducer shm transport: rank ", rank,
              " outside the world of ", world_size);
  TORCH_CHECK(chunk_bytes >= 4096 && chunk_bytes % 64 == 0,
              "FusedReducer shm transport: chunk_bytes must be a multiple of 64, >= 4096; got ",
              chunk_bytes);
  mapped_bytes_ = Segment::bytes(world_size, chunk_bytes);
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    throw std::runtime_error(os_error("cannot open shared memory " + name));
  }
  if (create) {
    // Reserve the pages now: an exhausted /dev/shm fails here, not with SIGBUS mid-step.
    int err = posix_fallocate(fd, 0, static_cast<off_t>(mapped_bytes_));
    if (err != 0) {
      ::close(fd);
      shm_unlink(name.c_str());
      errno = err;
      throw std::runtime_error(os_error("cannot reserve " + std::to_string(mapped_bytes_ >> 20) +
                                        " MiB of shared memory in /dev/shm"));
    }
  } else {
    struct stat info {};
    if (fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) < mapped_bytes_) {
      ::close(fd);
      throw std::runtime_error("shared memory " + name + " is smaller than expected");
    }
  }
  void* base = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    throw std::runtime_error(os_error("cannot map shared memory " + name));
  }
  if (create) {
    segment_ = new (base) Segment();
    segment_->world = world_size;
    segment_->chunk_bytes = chunk_bytes;
    std::atomic_thread_fence(std::memory_order_release);
    segment_->magic = kMagic;
  } else {
    segment_ = static_cast<Segment*>(base);
    if (segment_->magic != kMagic || segment_->world != world_size ||
        segment_->chunk_bytes != chunk_bytes) {
      munmap(base, mapped_bytes_);
      segment_ = nullptr;
      throw std::runtime_error("shared memory " + name +
                               " was made for another world size or chunk size");
    }
  }
  owner_pid_ = getpid();
  segment_->ranks[rank].pid.store(owner_pid_);
  worker_ = std::thread([this] { run_worker(); });
}

ShmTransport::~ShmTransport() {
  close(std::chrono::milliseconds(10000));
  if (segment_ != nullptr && getpid() == owner_pid_) {
    munmap(segment_, mapped_bytes_);
  }
}

void ShmTransport::unlink() { shm_unlink(shm_name_.c_str()); }

void ShmTransport::start_peer_checks() {
  // Ranks in another pid namespace (containers sharing /dev/shm) are not
  // visible; then only the timeout and the stop word guard the waits.
  bool visible = true;
  for (int r = 0; r < world_; ++r) {
    pid_t pid = static_cast<pid_t>(segment_->ranks[r].pid.load());
    visible = visible && pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
  }
  check_peers_ = visible;
}

std::unique_ptr<PendingCollective> ShmTransport::allreduce_sum(at::Tensor& flat) {
  TORCH_CHECK(flat.device().is_cpu() && flat.is_contiguous(),
              "FusedReducer shm transport: buckets must be contiguous CPU tensors; got ",
              flat.device(), flat.is_contiguous() ? "" : " (not contiguous)");
  const auto dtype = flat.scalar_type();
  const bool summable = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                        dtype == at::kBFloat16 || dtype == at::kByte || dtype == at::kChar ||
                        dtype == at::kShort || dtype == at::kInt || dtype == at::kLong;
  TORCH_CHECK(summable,
              "FusedReducer shm transport sums real floating-point and integer buckets, not ",
              dtype, "; use backend='process_group'");
  // Named as the backends name theirs ("gloo:all_reduce"), so profilers count it alike.
  RECORD_FUNCTION("shm:all_reduce", std::vector<c10::IValue>({flat}));
  auto job = std::make_shared<Job>(flat);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "FusedReducer shm transport: all-reduce after close()");
    queue_.push_back(job);
  }
  queued_.notify_one();
  return std::make_unique<PendingShm>(std::move(job));
}

void ShmTransport::check() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_.empty()) {
    throw std::runtime_error(error_);
  }
}

void ShmTransport::close(std::chrono::milliseconds deadline) {
  if (getpid() != owner_pid_) {
    return;  // a forked child (DataLoader worker): the worker thread and the peers are the parent's
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!worker_.joinable()) return;
    stopping_ = true;
  }
  // Buckets already started get until the deadline; then the worker's waits give up.
  abort_after_ = (std::chrono::steady_clock::now() + deadline).time_since_epoch().count();
  queued_.notify_all();
  worker_.join();
  // Peers still waiting for this rank fail at once instead of at their timeout.
  stop_peers();
}

void ShmTransport::stop_peers() {
  int32_t none = 0;
  segment_->stopped.compare_exchange_strong(none, rank_ + 1);
  segment_->wake.fetch_add(1);
  futex(&segment_->wake, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmTransport::fail(const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) error_ = error;
  }
  stop_peers();
}

void ShmTransport::run_worker() {
  while (true) {
    std::shared_ptr<Job> job;
    std::string failure;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = queue_.front();
      failure = error_;
    }
    if (failure.empty()) {
      try {
        reduce(job->flat);
      } catch (const std::exception& e) {
        failure = e.what();
        fail(failure);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.pop_front();
    }
    job->finish(failure);
  }
}

void ShmTransport::arrive(uint64_t arrival) {
  segment_->ranks[rank_].arrived.store(arrival);
  segment_->wake.fetch_add(1);
  if (segment_->sleepers.load() > 0) {
    futex(&segment_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void ShmTransport::wait_for_all(uint64_t arrival, const char* phase) {
  const auto start = std::chrono::steady_clock::now();
  auto last_peer_check = start;
  for (int round = 0;; ++round) {
    const uint32_t seen = segment_->wake.load();
    int missing = -1;
    for (int r = 0; r < world_ && missing < 0; ++r) {
      if (segment_->ranks[r].arrived.load() < arrival) missing = r;
    }
    if (missing < 0) return;
    const int32_t stopped = segment_->stopped.load();
    if (stopped != 0) {
      throw std::runtime_error("rank " + std::to_string(stopped - 1) +
                               " stopped reducing (it failed, closed its FusedReducer or is "
                               "exiting) while this rank waited for it (" + phase + ")");
    }
    if (round < 64) {  // a peer usually arrives within microseconds: spin briefly first
      std::this_thread::yield();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now.time_since_epoch().count() > abort_after_.load()) {
      throw std::runtime_error(std::string("closed while waiting for rank ") +
                               std::to_string(missing) + " (" + phase + ")");
    }
    if (now - start > timeout_) {
      throw std::runtime_error("timed out after " + std::to_string(timeout_.count()) +
                               " ms waiting for rank " + std::to_string(missing) + " (" + phase +
                               "); it may be stuck, or running other collectives in another order");
    }
    if (check_peers_ && now - last_peer_check > kPeerCheckEvery) {
      last_peer_check = now;
      const auto pid = static_cast<pid_t>(segment_->ranks[missing].pid.load());
      if (!process_alive(pid)) {
        throw std::runtime_error("rank " + std::to_string(missing) + " (pid " +
                                 std::to_string(pid) + ") exited while this rank waited for it (" +
                                 phase + ")");
      }
    }
    timespec slice{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice).count()};
    segment_->sleepers.fetch_add(1);
    futex(&segment_->wake, FUTEX_WAIT, seen, &slice);
    segment_->sleepers.fetch_sub(1);
  }
}

void ShmTransport::reduce(at::Tensor& flat) {
  const int64_t numel = flat.numel();
  const int64_t element = flat.element_size();
  const auto dtype = flat.scalar_type();
  RankState& me = segment_->ranks[rank_];
  me.numel.store(numel);
  me.dtype.store(static_cast<int32_t>(dtype));
  const int64_t chunk_elements = chunk_bytes_ / element;
  char* data = static_cast<char*>(flat.data_ptr());
  for (int64_t start = 0; start == 0 || start < numel; start += chunk_elements) {
    const int64_t len = std::min(chunk_elements, numel - start);
    const int set = static_cast<int>(chunks_done_ % 2);
    const uint64_t copied_in = 2 * chunks_done_ + 1;
    std::memcpy(segment_->slot(set, rank_), data + start * element, len * element);
    arrive(copied_in);
    wait_for_all(copied_in, "inputs");
    if (start == 0) {
      for (int r = 0; r < world_; ++r) {
        const RankState& peer = segment_->ranks[r];
        if (peer.numel.load() != numel || peer.dtype.load() != static_cast<int32_t>(dtype)) {
          throw std::runtime_error(
              "ranks reduce different buckets: this rank (" + std::to_string(rank_) + ") has " +
              std::to_string(numel) + " elements of " + std::string(c10::toString(dtype)) +
              ", rank " + std::to_string(r) + " has " + std::to_string(peer.numel.load()) +
              " elements of " +
              std::string(c10::toString(static_cast<at::ScalarType>(peer.dtype.load()))) +
              "; the models (or their bucket settings) differ across ranks");
        }
      }
    }
    // This rank's part of the chunk, cache-line aligned.
    const int64_t per_line = std::max<int64_t>(1, 64 / element);
    const int64_t part = (len + world_ * per_line - 1) / (world_ * per_line) * per_line;
    const int64_t lo = std::min(len, rank_ * part);
    const int64_t hi = std::min(len, lo + part);
    if (hi > lo) {
      AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "shm_sum", [&] {
        std::vector<const scalar_t*> inputs;
        for (int r = 0; r < world_; ++r) {
          inputs.push_back(reinterpret_cast<const scalar_t*>(segment_->slot(set, r)) + lo);
        }
        sum_inputs(reinterpret_cast<scalar_t*>(segment_->slot(set, world_)) + lo, inputs, hi - lo);
      });
    }
    arrive(copied_in + 1);
    wait_for_all(copied_in + 1, "sums");
    std::memcpy(data + start * element, segment_->slot(set, world_), len * element);
    ++chunks_done_;
    if (numel == 0) break;
  }
}

}  // namespace fused_reducer
