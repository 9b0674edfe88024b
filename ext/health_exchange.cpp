#include "health_exchange.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <utility>


namespace fused_reducer {

HealthExchange::HealthExchange(HealthOptions options, int rank, int world_size,
                       std::vector<at::Tensor> params, std::vector<std::string> names,
                       AllReduce allreduce)
    : params_(std::move(params)),
      names_(std::move(names)),
      health_(options, rank, world_size),
      allreduce_(std::move(allreduce)) {
  const auto device = params_.front().device();
  if (health_.options().check_finite) {
    nonfinite_ = at::zeros({static_cast<int64_t>(params_.size())},
                           at::TensorOptions().dtype(at::kLong).device(device));
  }
  norms_ = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device));
  observed_.assign(params_.size(), 0);
}

void HealthExchange::begin_step() {
  // This step's statistics start here (Note [Statistics from the copy]).
  if (nonfinite_.defined()) nonfinite_.zero_();
  norms_.zero_();
  norms_valid_ = false;
  std::fill(observed_.begin(), observed_.end(), 0);
  host_slack_seen_ = false;
}

CopyStats HealthExchange::pack_stats() const {
  CopyStats stats;
  stats.nonfinite = nonfinite_;  // undefined without check_finite
  return stats;
}

CopyStats HealthExchange::unpack_stats() const {
  CopyStats stats;
  stats.norms = norms_;
  return stats;
}

void HealthExchange::observe_without_copy(const CopyJob& job) const {
  if (nonfinite_.defined()) {
    observe_with_aten(job, pack_stats());  // no copy to ride on
  }
}

void HealthExchange::launched() {
  record_slack_event(/*complete=*/false);
}

void HealthExchange::completed(const BucketTiming& timing) {
  record_slack_event(/*complete=*/true);
  if (!std::isnan(timing.ready_last_us)) {
    host_slack_seen_ = true;  // the last such bucket of the step is the one take_slack_samples reads
    host_ready_last_us_ = timing.ready_last_us;
    host_complete_us_ = timing.complete_us;
  }
}

void HealthExchange::end_step(const StepEnd& end, StepTelemetry& telemetry) {
  snapshot_gradients(end.sharded);
  const bool exchanging = health_.next_step_exchanges();
  const bool due = health_.end_step(take_slack_samples(exchanging),
                                    (now_us() - telemetry.forward_time_us()) / 1000.0);
  // Last: the step is complete, so the error below leaves a reducer ready for the next one.
  const std::string nonfinite = due ? exchange(/*joined=*/false, end, &telemetry) : "";
  if (!nonfinite.empty()) {
    if (nonfinite_handler_) {
      nonfinite_handler_(nonfinite);  // raises
    }
    TORCH_CHECK(false, nonfinite);
  }
}

void HealthExchange::shadow_step(const StepEnd& end) {
  if (health_.shadow_step()) {
    exchange(/*joined=*/true, end, nullptr);
  }
}

// What copy_norms() compares param.grad with: the tensors this step left there.
void HealthExchange::snapshot_gradients(bool sharded) {
  norms_valid_ = !sharded;
  grad_snapshot_.assign(params_.size(), {nullptr, 0});
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (!grad.defined()) {
      continue;
    }
    if (!observed_[i]) {
      norms_valid_ = false;  // a gradient no rank produced this step, kept as it was
    }
    grad_snapshot_[i] = {grad.unsafeGetTensorImpl(), grad._version()};
  }
  // Only for a model whose norm was asked for (copy_norms): nothing for one that never is.
  grad_probes_taken_ = norms_valid_ && probes_wanted_;
  grad_probes_ = grad_probes_taken_ ? gradient_probes() : at::Tensor();
}

// Three elements of each gradient (the first, the middle and one of the last two in memory),
// copied: some in-place changes leave the version counter as it was (GradScaler.unscale_,
// whose fused kernel does not bump it; a change through .data; a collective on param.grad),
// but a change to the whole gradient (a scale, new values) shows in them; one to a few
// elements may not. No pass over the gradients: one small gather per step, once the model's
// norm has been asked for.
at::Tensor HealthExchange::gradient_probes() const {
  std::vector<at::Tensor> probes;
  for (const at::Tensor& param : params_) {
    const at::Tensor& grad = param.grad();
    if (!grad.defined() || grad.numel() == 0 || !grad.is_non_overlapping_and_dense()) {
      continue;  // left to the version counter
    }
    const int64_t spread = (grad.numel() - 1) / 2;
    probes.push_back(grad.detach().as_strided({3}, {spread}, grad.storage_offset()));
  }
  return probes.empty() ? at::Tensor() : at::cat(probes);
}

std::optional<at::Tensor> HealthExchange::copy_norms() const {
  probes_wanted_ = true;  // from the next backward on; this one kept none: torch's norm
  if (!norms_valid_ || !grad_probes_taken_) {
    return std::nullopt;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    const void* impl = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
    if (impl != grad_snapshot_[i].first || (impl != nullptr && grad._version() != grad_snapshot_[i].second)) {
      return std::nullopt;  // changed since: clipped, unscaled, accumulated, replaced
    }
  }
  if (grad_probes_.defined()) {
    const at::Tensor now = gradient_probes();
    if (!now.defined() || !at::equal(now, grad_probes_)) {
      return std::nullopt;  // changed without a version bump (unequal also where NaN)
    }
  }
  return norms_.clone();
}

// See Note [Lateness from slack]: from the last reduced bucket being ready to its
// collective being seen complete. On CPU both are host clock readings of this step. On a
// GPU the host runs ahead of the device, so its clock says when work was queued, not done:
// Note [Lateness from slack on the GPU]. `exchanging`: this step exchanges the health row.
std::vector<double> HealthExchange::take_slack_samples(bool exchanging) {
  if (params_.front().is_cpu()) {
    const double forward_ms = std::exchange(forward_sync_ms_, 0.0);
    if (host_slack_seen_) {  // the last reduced bucket whose gradients were ready here
      return {forward_ms + (host_complete_us_ - host_ready_last_us_) / 1000.0};
    }
    return {};
  }
  // Note [Lateness from slack on the GPU]
  // The same slack on the device's own clock: a timing event on the compute stream after the
  // last launched bucket's copy (its gradients ready on the GPU), another after the stream
  // waited for its collective (complete on the GPU); their elapsed time is the slack. Reading
  // it needs both events done, and backward does not wait for the device: each step records
  // into the next of kSlackSlots pairs, and every step reads the pairs the device has finished
  // (a query, no wait), oldest first. A step that exchanges the health row first waits for its
  // own pair: the exchange reads its result back to the host anyway (Note [Health exchange]),
  // which waits for the same work. A pair still unread when its slot comes round again (the
  // host kSlackSlots steps ahead) is dropped; the report is a median over the samples.
  std::vector<double> samples;
  if (exchanging && slack_events_[slack_slot_].recorded) {
    slack_events_[slack_slot_].complete->synchronize();
  }
  for (size_t age = 1; age <= kSlackSlots; ++age) {
    SlackEvents& events = slack_events_[(slack_slot_ + age) % kSlackSlots];  // oldest first
    if (events.recorded && events.ready->query() && events.complete->query()) {
      double forward_ms = 0;  // recorded before the pair: done too, but never read undone
      for (size_t k = 0; k < events.forward_recorded; ++k) {
        auto& [begin, end] = events.forward[k];
        if (begin->query() && end->query()) forward_ms += begin->elapsedTime(*end);
      }
      samples.push_back(forward_ms + events.ready->elapsedTime(*events.complete));
      events.recorded = false;
    }
  }
  slack_slot_ = (slack_slot_ + 1) % kSlackSlots;
  slack_events_[slack_slot_].recorded = false;  // overwritten from now on
  slack_events_[slack_slot_].forward_recorded = 0;
  return samples;
}

bool HealthExchange::slack_on_device() const {
  return !params_.front().is_cpu() && health_.options().straggler_interval > 0;
}

// The forward's collectives (buffer broadcast, join's all-reduces) are where a rank waits
// for one that is late before its forward (data loading) whenever the model has buffers or
// joins: the buckets then find every rank in step. So the waits there count into the step's
// slack, each collective bracketed alone (local work between them would hide a rank slow in
// it), summed over the step's forwards (no_sync micro-steps too): the host clock on CPU (the
// collectives block), a pair of timing events on the compute stream on a GPU (in the step's
// slot, Note [Lateness from slack on the GPU]).
void HealthExchange::begin_forward_sync() {
  forward_sync_open_ = true;
  if (!slack_on_device()) {
    forward_sync_begin_us_ = now_us();
    return;
  }
  SlackEvents& events = slack_events_[slack_slot_];
  if (events.forward.size() == events.forward_recorded) events.forward.emplace_back();
  record_stream_event(events.forward[events.forward_recorded].first);
}

void HealthExchange::end_forward_sync() {
  if (!std::exchange(forward_sync_open_, false)) {
    return;  // no begin (or the collective between raised): nothing to close
  }
  if (!slack_on_device()) {
    forward_sync_ms_ += (now_us() - forward_sync_begin_us_) / 1000.0;
    return;
  }
  SlackEvents& events = slack_events_[slack_slot_];
  record_stream_event(events.forward[events.forward_recorded].second);
  events.forward_recorded += 1;
}

void HealthExchange::record_stream_event(std::optional<c10::Event>& event) const {
  const at::Tensor& first = params_.front();
  if (!event) {
    event.emplace(first.device().type(), c10::EventFlag::BACKEND_DEFAULT);  // timing enabled
  }
  const auto* guard = c10::impl::getDeviceGuardImpl(first.device().type());
  event->record(guard->getStream(first.device()));
}

// Records this step's ready (after a bucket's launch) or complete (after a bucket's wait)
// event on the current stream; the last of each in a step is what take_slack_samples
// reads. GPU only, and only when the straggler exchange is on.
void HealthExchange::record_slack_event(bool complete) {
  if (!slack_on_device()) {
    return;
  }
  SlackEvents& events = slack_events_[slack_slot_];
  record_stream_event(complete ? events.complete : events.ready);
  events.recorded = complete && events.ready.has_value();
}

// Note [Health exchange]
// After the gradients are written, every rank all-reduces one small float64 row per rank
// (health_checks.h: its non-finite count, median slack and step time, zeros in the
// others' entries) over the buckets' transport: every step with check_finite, every
// straggler_interval steps otherwise (every rank counts the same steps, joined ranks
// included, so all issue the same collectives). Only when a count is non-zero, a second
// row names the parameters. Returns the check_finite error, the same text on every rank.
std::string HealthExchange::exchange(bool joined, const StepEnd& end, StepTelemetry* telemetry) {
  int64_t nonfinite = 0;
  std::vector<int64_t> counts;
  if (nonfinite_.defined() && !joined) {
    const at::Tensor host = nonfinite_.cpu();  // the end of backward: the one host sync
    counts.assign(host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel());
    for (const int64_t count : counts) nonfinite += count;
  }
  const at::Tensor rows = allreduce_(health_.row(nonfinite, joined), "health exchange");
  if (health_.options().straggler_interval > 0) {
    health_.update_stragglers(rows);
    if (telemetry != nullptr && !joined) {
      telemetry->set_last_lateness(health_.report().lateness_ms);
    }
  }
  if (HealthChecks::total_nonfinite(rows) == 0) {
    return joined ? "" : averaged_nonfinite_message(end);
  }
  if (counts.empty()) counts.assign(params_.size(), 0);
  const at::Tensor detail = allreduce_(health_.detail_row(counts, *end.ready_order),
                                       "non-finite gradient report");
  return health_.nonfinite_message(rows, detail, names_, end.step, end.sharded_layout);
}

// Note [Averages that overflow]
// check_finite counts each rank's local gradients on their way into the buckets, yet an
// average can come out non-finite from finite ones when the reduction overflows (a float16
// reduce_dtype or a compressing comm hook: sums beyond 65504). The unpack into param.grad
// sums |x| of what it writes (norms_, Note [Statistics from the copy]), so that is seen for
// free wherever the unpack copies (also a gradient this rank did not produce, so every rank
// observes the same ones), and then confirmed on param.grad. The averages are the same on
// every rank, so every rank comes to the same verdict without an exchange. Not seen: gradient_as_bucket_view (no copy
// out of the bucket) and a ShardedOptimizer's shards (documented).
std::string HealthExchange::averaged_nonfinite_message(const StepEnd& end) const {
  if (!nonfinite_.defined() || std::isfinite(norms_.cpu().const_data_ptr<double>()[1])) {
    return "";
  }
  std::vector<std::pair<std::string, int64_t>> found;  // the error path: a pass over param.grad
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (observed_[i] && grad.defined()) {
      const int64_t count = at::logical_not(at::isfinite(grad)).sum().item<int64_t>();
      if (count > 0) found.emplace_back(names_[i], count);
    }
  }
  if (found.empty()) {
    return "";  // the CUDA kernel sums |x| in float: finite values can add up past its range
  }
  return health_.averaged_nonfinite_message(found, end.step, end.reduction());
}

}  // namespace fused_reducer
