// The health checks: what the reducer learns about every rank for almost nothing,
// because every gradient passes through it and every rank meets in its collectives.
//
//   check_finite   each rank counts NaN/Inf in its local gradients during the copy
//                  into the buckets (Note [Statistics from the copy]); at the end of
//                  backward the counts are exchanged and every rank raises the same
//                  error naming the ranks and parameters.
//   stragglers     each rank measures how long its last bucket waited for the others
//                  (its slack); the rank whose buckets were ready last waits least.
//
// HealthChecks holds the checks' options and per-rank state, builds the row each rank
// contributes and reads the verdicts from the sums (the check_finite error, the straggler
// report): arithmetic on the host, no collective. HealthExchange (health_exchange.h) measures
// on the route and runs the exchange (Note [Health exchange]). Adding a check: docs/DESIGN.md,
// "Extension points".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "setting_error.h"

namespace fused_reducer {

struct HealthOptions {
  bool check_finite = false;
  // A rank's median over the window moves once half the window is late (5 steps), so a rank
  // slow from the start is named at the first exchange (step 10), one turning slow mid-run
  // within 5 to 14 steps. An exchange is one small collective every 10 steps, counted apart
  // from the gradients' (Stats::health_exchanges).
  int64_t straggler_interval = 10;      // steps between straggler exchanges; 0: off
  int64_t straggler_window = 10;        // steps whose median slack a rank reports
  // Late beyond this; 0: automatic, Note [A straggler is late relative to the step].
  double straggler_threshold_ms = 0;
  int64_t straggler_warn_steps = 20;    // one warning when a rank stays late this many steps
};

// Every field of HealthOptions, once, by the name Python sets it by (ReducerOptions.health.<name>,
// filled from FusedReducer's keyword arguments through core/config.py's HealthConfig):
// bindings.cpp binds what this lists, so a new option is a field above and a line here.
// Throws ModelSettingError naming the first option out of its range.
void check_health_options(const HealthOptions& options);

template <class Visit>
void for_each_health_option(Visit&& visit) {
  visit("check_finite", &HealthOptions::check_finite);
  visit("straggler_interval", &HealthOptions::straggler_interval);
  visit("straggler_window", &HealthOptions::straggler_window);
  visit("straggler_threshold_ms", &HealthOptions::straggler_threshold_ms);
  visit("straggler_warn_steps", &HealthOptions::straggler_warn_steps);
}

struct StragglerReport {
  int64_t step = 0;                  // the synchronised step of the last exchange (0: none yet)
  std::vector<double> lateness_ms;   // per rank; NaN: no measurement (joined, or none yet)
  std::vector<double> slack_ms;      // per rank: median wait of its last bucket for the others
  int64_t slowest = -1;
  std::vector<int64_t> stragglers;   // late beyond threshold_ms in the last exchange
  std::vector<int64_t> late_steps;   // per rank: steps it has been late in a row
  double threshold_ms = 0;
  double median_step_ms = 0;
  double jitter_ms = 0;              // median over ranks of the interquartile range of their slacks
  int64_t interval = 0;
  int64_t window = 0;
};

class HealthChecks {
 public:
  HealthChecks(HealthOptions options, int rank, int world_size);

  const HealthOptions& options() const { return options_; }

  // Whether the next synchronised step exchanges (every rank decides alike: same count of
  // steps).
  bool next_step_exchanges() const;
  // One synchronised step of this rank ended: `slack_ms` are the slacks measured since the
  // last call (how long a step's last bucket waited for the others: this step's on CPU; on
  // GPU those of the steps whose timing events the device has finished, none or several),
  // its forward + backward took `step_ms`. Returns next_step_exchanges() as it was.
  bool end_step(const std::vector<double>& slack_ms, double step_ms);
  // A joined rank shadowed one step of the others (join): same decision, no sample.
  bool shadow_step();

  // This rank's contribution to the exchange: float64 [kRow * world], zeros except its
  // own kRow entries, one column per number a check exchanges (NaN: none). A new check adds
  // its columns before kRow.
  enum Column : int64_t {
    kNonfinite,   // check_finite: NaN/Inf elements in this rank's local gradients
    kSlackMs,     // stragglers: median slack over the window
    kStepMs,      // stragglers: median step (forward + backward)
    kSlackIqrMs,  // stragglers: interquartile range of the slacks
    kRow          // the number of columns
  };
  at::Tensor row(int64_t nonfinite, bool joined) const;
  static int64_t total_nonfinite(const at::Tensor& summed_rows);
  // Reads the summed rows: lateness, stragglers, the warning to log.
  void update_stragglers(const at::Tensor& summed_rows);
  // The default threshold: Note [A straggler is late relative to the step].
  static constexpr double kLateFractionOfStep = 0.15;
  static constexpr double kJitterFactor = 1.0;
  static constexpr double kSchedulerNoiseMs = 1.0;
  static double automatic_threshold_ms(double median_step_ms, double jitter_ms);

  // The second exchange, when some rank counted non-finite elements: float64
  // [world * kDetail]: this rank's number of offending parameters, then up to
  // kNamed (parameter index, count) pairs, the first in `order` (ready order).
  static constexpr int64_t kNamed = 3;
  static constexpr int64_t kDetail = 1 + 2 * kNamed;
  at::Tensor detail_row(const std::vector<int64_t>& counts, const std::vector<int64_t>& order) const;
  // The error every rank raises, built from the summed rows alone (so it is the same text
  // on every rank). `sharded`: the averages went to the ShardedOptimizer's shards, not param.grad.
  std::string nonfinite_message(const at::Tensor& summed_rows, const at::Tensor& summed_detail,
                                const std::vector<std::string>& names, int64_t step,
                                bool sharded) const;

  // The error when every rank's local gradients were finite but their average is not
  // (Note [Averages that overflow] in health_exchange.cpp): `found` (parameter name, non-finite
  // elements of its average), `reduction` says what reduced them.
  std::string averaged_nonfinite_message(const std::vector<std::pair<std::string, int64_t>>& found,
                                         int64_t step, const std::string& reduction) const;

  StragglerReport report() const { return report_; }
  std::string take_warning();

 private:
  HealthOptions options_;
  int rank_;
  int world_size_;
  int64_t steps_ = 0;  // synchronised (or shadowed) steps
  std::deque<double> slack_ms_;
  std::deque<double> step_ms_;
  StragglerReport report_;
  int64_t last_update_step_ = 0;
  std::vector<char> warned_;
  std::string warning_;
};

}  // namespace fused_reducer
