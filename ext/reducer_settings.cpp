// Reducer's settings and introspection: each takes the lock, then reads or changes one of
// the units (bucket_layout.h, unused_parameters.h, step_telemetry.h, health_exchange.h) or a
// switch of the route. The route itself is in reducer.cpp.
#include "reducer.h"

#include <c10/util/Exception.h>

#include <utility>

namespace fused_reducer {

// ---------------------------------------------------------------------------
// Settings and introspection
// ---------------------------------------------------------------------------

void Reducer::set_bucket_caps_bytes(std::vector<int64_t> caps) {
  check_bucket_caps(caps);
  std::lock_guard<std::mutex> lock(mutex_);
  options_.bucket_caps_bytes = std::move(caps);
  rebuild_pending_ = true;
}

// A one-entry list [c] means [c, c]: setting the first limit or the cap of it
// keeps the other at c.
void Reducer::set_first_bucket_bytes(int64_t bytes) {
  check_bucket_bytes("first_bucket_bytes", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& caps = options_.bucket_caps_bytes;
  if (caps.size() == 1) {
    caps.push_back(caps.front());
  }
  caps.front() = bytes;
  rebuild_pending_ = true;
}

void Reducer::set_bucket_cap_bytes(int64_t bytes) {
  check_bucket_bytes("bucket_cap_bytes", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& caps = options_.bucket_caps_bytes;
  if (caps.size() == 1) {
    caps.push_back(caps.front());
  }
  caps.back() = bytes;
  rebuild_pending_ = true;
}

void Reducer::set_last_bucket_bytes(int64_t bytes) {
  check_last_bucket_bytes(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  options_.last_bucket_bytes = bytes;
  rebuild_pending_ = true;
}

void Reducer::set_reduce_dtype(std::optional<at::ScalarType> dtype) {
  check_reduce_dtype(dtype);
  layout_.check_bucket_view_dtypes(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  options_.reduce_dtype = dtype;
  rebuild_pending_ = true;
}

std::optional<at::ScalarType> Reducer::reduce_dtype() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.reduce_dtype;
}

int64_t Reducer::last_bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.last_bucket_bytes;
}

std::vector<int64_t> Reducer::bucket_caps_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_caps_bytes;
}

int64_t Reducer::first_bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_caps_bytes.front();
}

int64_t Reducer::bucket_cap_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.bucket_caps_bytes.back();
}

void Reducer::request_rebuild() {
  std::lock_guard<std::mutex> lock(mutex_);
  rebuild_pending_ = true;
}

void Reducer::request_rebuild_from_order(std::vector<int64_t> order) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto n = static_cast<int64_t>(params_.size());
  TORCH_CHECK(static_cast<int64_t>(order.size()) == n, "request_rebuild_from_order: expected ",
              n, " parameter indices (each once), got ", order.size());
  std::vector<char> seen(params_.size(), 0);
  for (int64_t index : order) {
    TORCH_CHECK(index >= 0 && index < n && !seen[index], "request_rebuild_from_order: index ",
                index, " is out of range [0, ", n, ") or repeated");
    seen[index] = 1;
  }
  last_ready_order_ = std::move(order);
  rebuilt_after_first_step_ = true;
  rebuild_pending_ = true;
}

bool Reducer::rebuild_pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rebuild_pending_;
}

void Reducer::set_sync_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_enabled_ = enabled;
}

void Reducer::set_divide_factor(int64_t ranks) {
  TORCH_CHECK(ranks >= 0 && ranks <= world_size_, "FusedReducer: divide factor must be between 1 "
              "and the world size (", world_size_, "), or 0 for the world size; got ", ranks);
  std::lock_guard<std::mutex> lock(mutex_);
  divide_factor_ = ranks;
}

void Reducer::set_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!sharded_ || !hook, "FusedReducer: a communication hook replaces the all-reduce, "
              "but a ShardedOptimizer reduce-scatters the buckets; use one or the other");
  comm_hook_ = std::move(hook);
}

void Reducer::set_sharded(bool sharded) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (sharded == sharded_) {
    return;
  }
  TORCH_CHECK(!sharded || !comm_hook_, "FusedReducer: a ShardedOptimizer reduce-scatters the "
              "buckets, but a communication hook is registered; use one or the other");
  sharded_ = sharded;
  rebuild_pending_ = true;  // the padding of the layout changes
}

void Reducer::set_released_gradients(std::vector<at::Tensor> placeholders) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(placeholders.empty() || placeholders.size() == params_.size(),
              "FusedReducer: ", placeholders.size(), " released-gradient placeholders for ",
              params_.size(), " parameters");
  released_gradients_ = std::move(placeholders);
}

void Reducer::clear_released_gradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < released_gradients_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined() && grad.is_same(released_gradients_[i])) {
      grad.reset();
    }
  }
}

bool Reducer::sharded() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sharded_;
}

bool Reducer::sharded_layout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.in_force().sharded;
}

std::vector<at::Tensor> Reducer::bucket_flats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.flats();
}

std::vector<std::vector<int64_t>> Reducer::bucket_offsets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.offsets();
}

bool Reducer::has_comm_hook() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(comm_hook_);
}

std::vector<ZeroBucket> Reducer::zero_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.zero_buckets();
}

at::Tensor Reducer::joined_used_map() {
  std::lock_guard<std::mutex> lock(mutex_);
  return unused_.joined_used_map(params_.front().device());
}

// A joined rank shadowed one step of the others: if that was their first, they
// rebuild at their next forward, and so must this rank (it receives rank 0's
// layout like everyone else).
void Reducer::note_shadowed_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  unused_.clear_used();
  if (!rebuilt_after_first_step_) {
    rebuilt_after_first_step_ = true;
    rebuild_pending_ = rebuilds_after_first_step();
    if (last_ready_order_.empty()) {
      last_ready_order_ = observed_order();
    }
  }
}

std::vector<int64_t> Reducer::bucket_sizes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.sizes();
}

std::vector<int64_t> Reducer::bucket_numels() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.numels();
}

std::vector<std::vector<int64_t>> Reducer::bucket_params() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_.params();
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ReducerStats stats = stats_;
  const LayoutInForce& layout = layout_.in_force();
  stats.rebuilds = layout_.rebuilds();
  stats.bucket_caps_bytes = layout.bucket_caps_bytes;
  stats.last_bucket_bytes = layout.last_bucket_bytes;
  stats.reduce_dtype = layout.reduce_dtype;
  stats.buckets = static_cast<int64_t>(layout_.buckets().size());
  stats.transport = transport_->name();
  return stats;
}

std::vector<StepTiming> Reducer::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return telemetry_.history();
}

std::vector<double> Reducer::last_ready_times() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return telemetry_.last_ready_times();
}

std::vector<int64_t> Reducer::last_ready_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return observed_order();
}

void Reducer::set_trace_capacity(int64_t steps) {
  std::lock_guard<std::mutex> lock(mutex_);
  telemetry_.set_capacity(steps);
}

int64_t Reducer::completed_steps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.step;
}

// ---------------------------------------------------------------------------
// Training health (health_exchange.h runs the checks of health_checks.h)
// ---------------------------------------------------------------------------

void Reducer::set_nonfinite_handler(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  health_.set_nonfinite_handler(std::move(handler));
}

StragglerReport Reducer::straggler_report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return health_.report();
}

std::string Reducer::take_straggler_warning() {
  std::lock_guard<std::mutex> lock(mutex_);
  return health_.take_warning();
}

void Reducer::shadow_health_exchange() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.health_exchanges = 0;
  stats_.health_exchange_bytes = 0;
  health_.shadow_step(step_end());
}

std::optional<at::Tensor> Reducer::copy_norms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return health_.copy_norms();
}

void Reducer::begin_forward_sync() {
  health_.begin_forward_sync();
}

void Reducer::end_forward_sync() {
  health_.end_forward_sync();
}

}  // namespace fused_reducer
