"""Autotune of the bucket limits (first_bucket_bytes, bucket_cap_bytes, last_bucket_bytes) from
measured training steps. Driven by FusedReducer.forward, once per synchronised step; nothing
here runs per parameter. docs/TUNING.md describes it for users.

1. Wait until the reducer has completed `min_steps` steps, so the gradient-ready order and the
   per-parameter ready times (C++ telemetry, Note [Step telemetry]) are known.
2. Probe the transport the reducer uses (probe.py): a few all-reduces of a small and a large
   flat buffer give a per-collective latency and a bandwidth (max over ranks).
3. Model (rank 0): every candidate of `candidate_grid` is turned into its bucket layout by the
   reducer's own assignment (_C.assign_buckets on the observed order; candidates with identical
   layouts are one configuration) and simulated: a bucket launches, strictly in order, when its
   last gradient is ready; the transport runs one bucket at a time, each costing latency +
   bytes / bandwidth. Overlap with backward is scored twice (costmodel.CostModel, the model the
   planner uses too: free, as with NCCL on a GPU, and contended, as with gloo threads sharing
   the CPU cores); the starting configuration (the incumbent), the layouts of a planner hint
   (`planner_hint`: the best layouts `python -m fused_reducer.plan` predicted for this world
   size) and the best predictions of both scores, alternately, make the shortlist of
   `max_candidates`. Rank 0 broadcasts this plan.
4. Measure with successive halving: each round sets a candidate's limits at a forward (a safe
   point: gradients stay exact), discards one warm-up step (it contains the rebuild), then times
   `round_steps[r]` steps, forward to forward (step_clock: on CUDA, by events on the current
   stream, read at the trial's end). Per step the slowest rank counts (one small MAX
   all-reduce per trial). After each round the better half of the challengers stays (median
   step time over all their samples); the incumbent always stays, as the reference.
5. Decide (rank 0, broadcast): the fastest survivor, unless it does not beat the incumbent by
   `margin` and by `z` standard errors of the difference (noise), in which case the incumbent
   stays. The choice becomes the value of the
   properties (and so persists across rebuilds); one INFO line on the "fused_reducer" logger
   announces it.
"""
import logging
import math
import numbers
import statistics
import time
import weakref

import torch
import torch.distributed as dist

from ..core.plugins import provide
from .costmodel import (CostModel, ParamInfo, candidate, candidate_grid, caps_of, limits_json,
                        step_periods)
from .probe import probe_transport
from ..transports.transport import control_allreduce

log = logging.getLogger("fused_reducer")

_INVALID = 1e30  # a step that cannot be timed (no backward between two forwards) on some rank
VERIFY_TOLERANCE = 0.10  # verify: a prediction further than this from the measured step is wrong


def verification_table(verification):
    """The verify table as text: one line per layout of the plan."""
    lines = [f"# autotune verify: the plan (world {verification['plan_world_size']}) against "
             f"this run (world {verification['world_size']}), step ms, slowest rank, median",
             f"#  {'layout':14s} {'first':>9s} {'cap':>9s} {'last':>9s} {'buckets':>7s} "
             f"{'predicted':>9s} {'measured':>9s} {'error':>7s}"]
    for r in verification["rows"]:
        measured = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.2f}"
        error = "-" if r["error_pct"] is None else f"{r['error_pct']:+6.1f}%"
        lines.append(f"   {r['label']:14s} {r['first_bucket_bytes']:9d} {r['bucket_cap_bytes']:9d} "
                     f"{r['last_bucket_bytes']:9d} {r['buckets']:7d} {r['predicted_ms']:9.2f} "
                     f"{measured:>9s} {error:>7s}"
                     + ("  WRONG" if r["wrong"] else "  (not measured)" if r["wrong"] is None
                        else ""))
    verdict = (f"the plan is wrong here for {', '.join(verification['wrong'])} (beyond "
               f"{verification['tolerance_pct']:.0f} %)" if verification["wrong"]
               else f"every prediction within {verification['tolerance_pct']:.0f} %")
    lines.append(f"# {verdict}")
    return "\n".join(lines)


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"autotune: {name} must be an int >= {low}, got {value!r}")


def _finite(x):
    return x if x is not None and math.isfinite(x) else None


class HostClock:
    """Step times of a CPU model: the host does the work, so forward to forward on the host's
    clock is the step."""

    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, end):
        return (end - start) * 1e3


class CudaClock:
    """Step times of a CUDA model, from events recorded on the current stream at each forward.

    The host runs ahead of the GPU (and a trial's rebuild drains it first), so host gaps between
    forwards are mostly enqueue time; the events measure the step where it runs. They are read
    only at the end of a trial (elapsed_ms waits for the later one): one host sync per trial, where
    the tuner's MAX all-reduce syncs anyway."""

    def __init__(self, device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start, end):
        end.synchronize()
        return start.elapsed_time(end)


def step_clock(device):
    """The clock that times training steps of a model on `device` (see HostClock, CudaClock)."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()


class Autotuner:
    """State machine driven by FusedReducer.forward; see the module docstring.

    max_candidates: configurations measured in the first round, the incumbent included (default
    None: a fifth of the distinct layouts, at least 3 and at most 6).
    round_steps: timed steps per trial in each successive-halving round (after one discarded
    warm-up step per trial); the number of rounds is len(round_steps).
    margin, z: the best challenger replaces the incumbent only if its median step time is lower
    by more than `margin` (a fraction) and by more than `z` standard errors of the difference
    (estimated from the samples' spread), so that measurement noise does not move a good
    configuration.
    candidates: an explicit list of (first, cap, last) to choose from instead of the grid.
    min_steps: completed steps before tuning starts (ready order and times must be known).
    planner_hint: a plan (the dict of `python -m fused_reducer.plan --json`, or its file path)
    or a list of (first, cap, last): these layouts are measured first, right after the
    incumbent, and the shortlist defaults to them and the incumbent (at least 2, at most 6), so
    a plan made before scaling out saves trial steps on the large cluster. From a plan, the
    entry for this world size (else the nearest) is used.
    verify: with a plan as planner_hint, measure exactly its best layouts and DDP's default
    (and the starting configuration), interleaved in every round (no halving), and compare
    each with the plan's predicted step time: rank 0 prints the table, a layout whose
    measured step differs from the prediction by more than VERIFY_TOLERANCE (10 %) is flagged
    as wrong, and autotune_report()["verification"] holds the rows. The measured best is kept
    (the usual rule: the starting configuration stays unless clearly beaten).
    """

    @property
    def model(self):
        return self._model()

    def __init__(self, model, max_candidates=None, round_steps=(2, 4), warmup_steps=1,
                 margin=0.02, z=2.0, candidates=None, min_steps=2, planner_hint=None,
                 verify=False):
        # Every option is checked here, on every rank: a bad one found later, inside a forward
        # on rank 0 alone, would leave the other ranks waiting for its plan.
        if max_candidates is not None:
            _check_int("max_candidates", max_candidates, 2)
        try:
            round_steps = list(round_steps)
        except TypeError:
            round_steps = []
        if not round_steps:
            raise ValueError(f"autotune: round_steps must be a non-empty list of ints >= 1, got "
                             f"{round_steps!r}")
        for steps in round_steps:
            _check_int("round_steps entries", steps, 1)
        _check_int("warmup_steps", warmup_steps, 0)
        _check_int("min_steps", min_steps, 1)
        for name, value in (("margin", margin), ("z", z)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"autotune: {name} must be a finite number >= 0, got {value!r}")
        self._model = weakref.ref(model)  # the model owns its tuner: no reference cycle
        self.max_candidates = None if max_candidates is None else int(max_candidates)
        self.round_steps = [int(s) for s in round_steps]
        self.warmup_steps = int(warmup_steps)
        self.margin = float(margin)
        self.z = float(z)
        self.decision = None
        self.explicit = None
        if candidates is not None:
            from .plan import checked_layouts
            self.explicit = checked_layouts("autotune candidates", candidates)
            if not self.explicit:
                raise ValueError("autotune: candidates is empty; give at least one (first, cap, "
                                 "last) or leave it None for the grid")
        self.min_steps = int(min_steps)
        self.group = model.process_group
        self.clock = step_clock(model.device)
        self.rank = dist.get_rank(self.group)
        self.hint = []
        self.planned = None  # verify: what the plan predicts ({"world_size", "rows"})
        self.verification = None
        if verify and planner_hint is None:
            raise ValueError("autotune(verify=True) needs planner_hint: the plan to verify")
        if planner_hint is not None:
            from .plan import hinted_layouts, planned_steps
            world = dist.get_world_size(self.group)
            self.hint = hinted_layouts(planner_hint, world)
            if verify:
                self.planned = planned_steps(planner_hint, world)
                self.hint = list(dict.fromkeys(self.hint + [c for _, c, _ in
                                                            self.planned["rows"]]))
        self.state = "waiting"
        self.steps_used = 0          # synchronised steps since the plan was made
        self.plan = []               # [{candidate, predicted_ms, buckets}] measured, in order
        self.samples = {}            # candidate -> [step ms, slowest rank]
        self.alive = []              # candidates of the current round
        self.round = 0
        self.queue = []              # candidates still to measure in this round
        self.current = None          # candidate whose layout is in force
        self.to_skip = 0
        self.pending = []            # this trial's steps: (start, end) marks, None if untimed
        self.last_forward = None     # the clock's mark at the last forward
        self.last_completed = None
        self.incumbent = None
        self.choice = None
        self.model_info = None
        self.considered = 0

    def abandon(self):
        """Stop tuning; a trial layout in force gives way to the starting configuration (a new
        autotune() then starts from the user's limits, not from a trial's)."""
        model = self.model
        in_force = candidate(model.bucket_caps_bytes, model.last_bucket_bytes)
        if self.state == "measuring" and in_force == self.current != self.incumbent:
            self._set(self.incumbent)  # (limits set by hand since stay as they are)
        self.state = "done"

    # -- driven by forward ---------------------------------------------------------------------
    def on_forward(self):
        if self.state == "done":
            return
        now = self.clock.mark()
        completed = self.model.attachment.reducer.completed_steps()
        if self.state == "waiting":
            if completed >= self.min_steps:
                # The last step, forward to forward, as a trial would have measured it.
                last_step = (self.clock.elapsed_ms(self.last_forward, now)
                             if self.last_completed is not None
                             and completed == self.last_completed + 1 else None)
                self._make_plan(last_step)
                self.state = "measuring"
                self._next_trial()
                self.steps_used = 1
            self.last_forward, self.last_completed = now, completed
            return
        # state == "measuring": the interval since the last forward was one step of `current`.
        sample = (self.last_forward, now) if completed == self.last_completed + 1 else None
        self.last_forward, self.last_completed = now, completed
        if self.to_skip > 0:
            self.to_skip -= 1
        else:
            self.pending.append(sample)
        if len(self.pending) >= self.round_steps[self.round]:
            self._finish_trial()
            self._next_trial()
        if self.state != "done":
            self.steps_used += 1  # the step starting now is a tuning step

    # -- planning ------------------------------------------------------------------------------
    def _make_plan(self, last_step_ms=None):
        model = self.model
        reducer = model.attachment.reducer
        self.incumbent = candidate(model.bucket_caps_bytes, model.last_bucket_bytes)
        info = ParamInfo(model.attachment.params, model.reduce_dtype)
        latency_us, bytes_per_us = probe_transport(model.attachment.transport, model.device, self.group,
                                                   control_device=model.attachment.control_device)
        plan = None
        if self.rank == 0:
            try:
                plan = self._rank0_plan(info, reducer, latency_us, bytes_per_us, last_step_ms)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they wait
                plan = {"error": f"{type(e).__name__}: {e}"}
        box = [plan]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group,
                                   device=self.model.attachment.control_device)
        plan = box[0]
        if "error" in plan:
            self.state = "done"  # tuning abandoned; the limits in force stay
            raise RuntimeError(f"FusedReducer.autotune: rank 0 could not plan the trials "
                               f"({plan['error']}); training goes on with the limits in force")
        self.plan = plan["trials"]
        self.model_info = plan["model"]
        self.considered = plan["considered"]
        self.current = self.incumbent  # in force now: measuring it needs no rebuild
        self.alive = [tuple(t["candidate"]) for t in self.plan]
        self.samples = {c: [] for c in self.alive}
        self.round = 0
        self.queue = list(self.alive)
        log.debug("rank %d: autotune plan: %d layouts considered, measuring %s (model: %s)",
                  self.rank, self.considered,
                  [(t["candidate"], round(t["predicted_ms"], 2)) for t in self.plan], self.model_info)

    def _rank0_plan(self, info, reducer, latency_us, bytes_per_us, last_step_ms=None):
        order = list(reducer.last_ready_order())
        ready = list(reducer.last_ready_times())
        history = reducer.history()
        last = history[-1] if history else None
        backward_end = last["backward_end_us"] if last else max(
            (t for t in ready if not math.isnan(t)), default=0.0)
        copy_rate = 1e4  # bytes per us (10 GB/s) unless the telemetry says otherwise
        if last:
            packed = [(b["bytes"], b["pack_us"]) for b in last["buckets"]
                      if b["pack_us"] is not None and b["pack_us"] > 0]
            if packed and sum(t for _, t in packed) > 0:
                copy_rate = sum(n for n, _ in packed) / sum(t for _, t in packed)
        cost = CostModel.from_probe(latency_us, bytes_per_us, copy_rate)
        grid = self.explicit or candidate_grid(info.group_bytes, self.incumbent, self.hint)
        grid = [self.incumbent] + self.hint + [c for c in grid
                                               if c != self.incumbent and c not in self.hint]
        layouts = {}
        for candidate in grid:  # one representative per distinct layout; the incumbent's wins,
            key = info.layout(order, candidate)  # then the hint's
            layouts.setdefault(key, candidate)
        # Predictions are offsets from the step observed with the layout in force, so that they
        # read like measured step times.
        current = tuple(tuple(b) for b in reducer.bucket_params())
        observed_ms = _observed_step_ms(history, last_step_ms)
        base = [observed_ms - t / 1e3 for t in cost.predict_us(current, info.sizes, ready,
                                                                backward_end)]
        rows = {}
        for key, candidate in layouts.items():
            free, contended = cost.predict_us(key, info.sizes, ready, backward_end)
            rows[candidate] = {"candidate": list(candidate), "predicted_ms": base[0] + free / 1e3,
                               "predicted_contended_ms": base[1] + contended / 1e3,
                               "buckets": len(key)}
        # The shortlist: the incumbent, then the best of each reading in turn.
        rankings = [sorted(rows, key=lambda c: (rows[c][field], rows[c]["buckets"], c))
                    for field in ("predicted_ms", "predicted_contended_ms")]
        hinted = []
        for candidate in self.hint:
            representative = layouts[info.layout(order, candidate)]
            if representative not in hinted and representative != self.incumbent:
                hinted.append(representative)
        if self.max_candidates:
            size = self.max_candidates
        elif self.explicit:
            size = len(layouts)
        elif self.hint:
            size = min(6, max(2, 1 + len(hinted)))
        else:
            size = min(6, max(3, len(layouts) // 5))
        chosen = ([self.incumbent] + hinted)[:max(size, 1)]
        for i in range(len(rows)):
            for ranking in rankings:
                if len(chosen) < size and ranking[i] not in chosen:
                    chosen.append(ranking[i])
        if self.planned is not None:  # verify: exactly the plan's layouts and the incumbent
            chosen = [self.incumbent] + hinted
            for label, layout, predicted in self.planned["rows"]:
                row = rows[layouts[info.layout(order, layout)]]
                row.setdefault("plan", []).append({"label": label, "predicted_ms": predicted})
        trials = [rows[c] for c in chosen]
        return {"trials": trials, "considered": len(layouts),
                "model": {"latency_us": latency_us, "bandwidth_GBps": bytes_per_us * 1e6 / 1e9,
                          "copy_GBps": copy_rate * 1e6 / 1e9, "backward_us": backward_end}}

    # -- measuring -----------------------------------------------------------------------------
    def _set(self, chosen):
        self.model.bucket_caps_bytes = caps_of(chosen)
        self.model.last_bucket_bytes = chosen[-1]
        self.current = chosen

    def _next_trial(self):
        if not self.queue:
            self._end_round()
            if self.state == "done":
                return
        candidate = self.queue.pop(0)
        if candidate != self.current:
            self._set(candidate)  # the rebuild happens in this forward's prepare_forward
        # The trial's first step holds the rebuild and the tuner's own collectives: not timed.
        self.to_skip = self.warmup_steps
        self.pending = []

    def _finish_trial(self):
        # Read only now (on CUDA this waits for the trial's last event), per rank before the MAX.
        times = [_INVALID if s is None else self.clock.elapsed_ms(*s) for s in self.pending]
        agreed = control_allreduce(times, dist.ReduceOp.MAX, self.group,
                                   self.model.attachment.control_device)
        valid = [t for t in agreed if t < _INVALID / 2]
        self.samples[self.current].extend(valid)
        log.debug("rank %d: autotune trial %s round %d: step ms %s", self.rank, self.current,
                  self.round, [round(t, 2) for t in valid])
        self.pending = []

    def _median(self, candidate):
        values = self.samples[candidate]
        return statistics.median(values) if values else math.inf

    def _end_round(self):
        self.round += 1
        challengers = sorted((c for c in self.alive if c != self.incumbent), key=self._median)
        if self.round >= len(self.round_steps) or not challengers:
            self._decide()
            return
        # Successive halving (the incumbent always stays); verify measures every layout of the
        # plan in every round, interleaved.
        keep = len(challengers) if self.planned is not None else max(1, len(challengers) // 2)
        self.alive = [self.incumbent] + challengers[:keep]
        log.debug("rank %d: autotune round %d: keeping %s, dropping %s", self.rank, self.round,
                  self.alive, challengers[keep:])
        # Start the round with the configuration in force if it is still in: one rebuild fewer.
        self.queue = sorted(self.alive, key=lambda c: c != self.current)

    def _stderr(self, candidate):
        """Standard error of the median step time, from the samples' spread (MAD)."""
        values = self.samples[candidate]
        if len(values) < 2:
            return math.inf
        mid = statistics.median(values)
        sigma = 1.4826 * statistics.median(abs(v - mid) for v in values)
        return 1.2533 * sigma / math.sqrt(len(values))

    def _decide(self):
        best = min((c for c in self.alive), key=self._median)
        incumbent_ms = self._median(self.incumbent)
        gain = incumbent_ms - self._median(best)
        # A challenger must be faster by the margin and by twice the noise of the difference;
        # otherwise it is not clearly faster and what the user had stays.
        needed = max(self.margin * incumbent_ms,
                     self.z * math.hypot(self._stderr(best), self._stderr(self.incumbent)))
        self.decision = {"best_measured": list(best), "gain_ms": _finite(gain),
                         "needed_ms": _finite(needed)}
        if best != self.incumbent and not gain > needed:
            best = self.incumbent
        box = [best]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group,
                                   device=self.model.attachment.control_device)
        best = tuple(box[0])
        self._set(best)
        self.choice = best
        self.state = "done"
        if self.planned is not None:
            self._verify()
        if self.rank == 0:
            log.info("autotune: chose first_bucket_bytes=%d bucket_cap_bytes=%d "
                     "last_bucket_bytes=%d (%s): %.2f ms per step, starting configuration "
                     "%.2f ms; %d configurations measured in %d steps", best[0], best[-2], best[-1],
                     "the starting configuration" if best == self.incumbent else "faster",
                     self._median(best), incumbent_ms, len(self.plan), self.steps_used)

    def _verify(self):
        """Predicted (the plan) against measured (median, slowest rank) per layout of the plan;
        the samples are the same on every rank (agreed by MAX), so is the verdict."""
        rows = []
        for t in self.plan:
            measured = _finite(self._median(tuple(t["candidate"])))  # None: no valid step
            for planned in t.get("plan", []):
                error = None if measured is None else (planned["predicted_ms"] - measured) / measured
                rows.append({"label": planned["label"], **limits_json(tuple(t["candidate"])),
                             "buckets": t["buckets"], "predicted_ms": planned["predicted_ms"],
                             "measured_ms": measured,
                             "error_pct": None if error is None else 100 * error,
                             "wrong": None if error is None else abs(error) > VERIFY_TOLERANCE})
        wrong = [r["label"] for r in rows if r["wrong"]]
        self.verification = {"plan_world_size": self.planned["world_size"],
                             "world_size": dist.get_world_size(self.group),
                             "tolerance_pct": 100 * VERIFY_TOLERANCE, "rows": rows,
                             "wrong": wrong}
        if self.rank == 0:
            print(verification_table(self.verification), flush=True)
            if wrong:
                log.warning("autotune verify: the plan is wrong here for %s (measured and "
                            "predicted step differ by more than %d %%)", ", ".join(wrong),
                            round(100 * VERIFY_TOLERANCE))

    # -- report --------------------------------------------------------------------------------
    def report(self):
        trials = []
        for t in self.plan:
            c = tuple(t["candidate"])
            values = self.samples.get(c, [])
            trials.append({**limits_json(c),
                           "step_ms": statistics.median(values) if values else None,
                           "samples_ms": list(values), "predicted_ms": t["predicted_ms"],
                           "predicted_contended_ms": t["predicted_contended_ms"],
                           "stderr_ms": _finite(self._stderr(c)),
                           "buckets": t["buckets"], "incumbent": c == self.incumbent})
        choice = None
        if self.choice is not None:
            choice = {**limits_json(self.choice), "step_ms": self._median(self.choice)}
        return {"done": self.state == "done", "state": self.state, "trials": trials,
                "choice": choice, "steps_used": self.steps_used,
                "configurations_considered": self.considered, "model": self.model_info,
                "decision": self.decision, "verification": self.verification,
                "incumbent": None if self.incumbent is None else limits_json(self.incumbent)}


def start_autotune(model, **options):
    """FusedReducer.autotune(): a new Autotuner for `model`, once every rank accepted the
    options (collective). A planner_hint file missing on some rank only must not leave the
    others tuning alone: their collectives would wait for it."""
    from ..errors import FusedReducerError
    try:
        tuner, refused = Autotuner(model, **options), None
    except (ValueError, TypeError, OSError) as e:
        tuner, refused = None, e
    ok, = control_allreduce([0.0 if refused else 1.0], dist.ReduceOp.MIN, model.process_group,
                            model.attachment.control_device)
    if refused is not None:
        raise refused
    if not ok:
        raise FusedReducerError("FusedReducer.autotune: another rank refused these options "
                                "(its error says why, e.g. a planner_hint file it cannot "
                                "read); tuning was not started on any rank")
    return tuner


provide("autotuner", start_autotune)  # FusedReducer's hook point: see core/plugins.py


def _observed_step_ms(history, last_step_ms=None):
    """The step of the layout in force as the trials measure theirs, forward to forward (the
    optimizer and data included; under a pipeline schedule the whole schedule step, not only its
    reduced backward, the last microbatch's): the median period between consecutive recorded
    steps, else `last_step_ms` (the tuner's own measure of the step before planning), else the
    last step's forward start to gradients written back; 0 without any."""
    periods = [period for _, period in step_periods(history)]
    if periods:
        return statistics.median(periods) / 1e3
    if last_step_ms is not None:
        return last_step_ms
    last = history[-1] if history else None
    return (last["finalize_end_us"] - last["forward_us"]) / 1e3 if last else 0.0
