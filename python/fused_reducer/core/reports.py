"""What a FusedReducer reports about itself: its layout, its step telemetry and health, and the
tuning layer's exports. A base class of FusedReducer (core/wrapper.py), which keeps the module
surface; everything here reads the model's attachment (core/attachment.py)."""
import math

from .plugins import tool


class Reports:
    """FusedReducer's reports; ``attachment`` and ``_trace_steps`` are the wrapper's."""

    def _attachment_or_raise(self):
        """The attachment; a closed or unpickled model has none until attached again."""
        attachment = self.attachment
        if attachment is None:
            raise RuntimeError("FusedReducer: this model was closed or unpickled; run a forward "
                               "(after unpickling) or wrap the module again (after close())")
        return attachment

    def _checked_attachment(self):
        """The attachment, once a collective that failed in the background (NCCL watchdog)
        has raised: setters and reports say so like forward does."""
        attachment = self._attachment_or_raise()
        attachment.transport.check()
        return attachment

    def autotune_report(self):
        """{done, trials: [{first_bucket_bytes, bucket_cap_bytes, last_bucket_bytes, step_ms,
        ...}], choice: {...} or None, ...}; see docs/TUNING.md."""
        tuner = self._attachment_or_raise().tuner
        if tuner is None:
            return {"done": False, "state": "not started", "trials": [], "choice": None}
        return tuner.report()

    # -- training health -------------------------------------------------------------------------
    def straggler_report(self):
        """Which ranks are late, from each rank's slack: how long it waited for the others in
        the step's collectives, its last bucket's and its forward's (Note [Lateness from slack]
        in ext/health_checks.cpp), exchanged every `straggler_interval` steps (every step
        with check_finite): lateness_ms (per rank: how long after the earliest rank it reached
        them, median of its last `straggler_window` steps; None: not measured), slack_ms (per
        rank: that wait, the same median),
        slowest, stragglers (late beyond threshold_ms in the last exchange), late_steps (per
        rank, steps late in a row; the warning comes at straggler_warn_steps), threshold_ms
        (straggler_threshold_ms, or automatic: 15 % of median_step_ms, and at least jitter_ms,
        the ranks' median step-to-step scatter of their slack, and 1 ms: Note [A straggler is
        late relative to the step] in ext/health_checks.cpp), median_step_ms, jitter_ms,
        step (of the last exchange, 0: none yet), interval, window, measured (whether any
        rank's lateness is known yet).
        On CPU the slack is read off the host clock; on GPU buckets off CUDA timing events on
        the compute stream, once the device has finished them (Note [Lateness from slack on
        the GPU] in ext/reducer.cpp). The same on every rank; local, no collective."""
        report = dict(self._checked_attachment().reducer.straggler_report())
        for key in ("lateness_ms", "slack_ms"):
            report[key] = [None if math.isnan(v) else v for v in report[key]]
        report["measured"] = any(v is not None for v in report["lateness_ms"])
        return report

    # -- the layout and the telemetry ------------------------------------------------------------
    def bucket_sizes(self):
        """Bytes per bucket of the layout in force, in launch order."""
        return list(self._attachment_or_raise().reducer.bucket_sizes())

    def bucket_parameter_names(self):
        """Parameter names per bucket of the layout in force, in launch order."""
        attachment = self._attachment_or_raise()
        names = attachment.param_names
        return [[names[i] for i in bucket] for bucket in attachment.reducer.bucket_params()]

    def stats(self):
        """step; allreduces and allreduce_bytes: the gradients' collectives of the last
        completed step (one per bucket, plus the used map's with find_unused_parameters, as
        DDP); health_exchanges and health_exchange_bytes: that step's check_finite / straggler
        exchange, counted apart (every step with check_finite, else every straggler_interval
        steps); rebuilds, limits, reduce_dtype (of the layout in force: str(torch.dtype) or None);
        telemetry of the last step: buckets_detail (per bucket: bytes, params, ready_first_us,
        ready_last_us, launch_us, pack_us, complete_us, wait_us; microseconds after the step's
        first gradient), overlap, exposed_wait_us, backward_end_us."""
        return dict(self._attachment_or_raise().reducer.stats())

    def step_history(self):
        """Telemetry of the last steps kept (at most trace_steps), oldest first: one dict per
        step like stats()'s telemetry, with the limits in force and per-bucket records."""
        return list(self._attachment_or_raise().reducer.history())

    @property
    def trace_steps(self):
        """How many steps of telemetry are kept for step_history() and export_trace()."""
        return self._trace_steps

    @trace_steps.setter
    def trace_steps(self, steps):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ValueError(f"trace_steps must be a positive int, got {steps!r}")
        self._trace_steps = steps
        if self.attachment is not None:
            self.attachment.reducer.set_trace_capacity(steps)

    def export_trace(self, path, steps=None):
        """Write the telemetry of the last `steps` steps (default all kept) as a Chrome trace
        (JSON, opens in Perfetto / chrome://tracing): a row for the step, one for backward and
        the end-of-backward wait, one per bucket (fill, copy, all-reduce, exposed wait). `path`
        may contain "{rank}". Returns the path written."""
        return tool("export_trace", "FusedReducer.export_trace")(self, path, steps)

    def export_profile(self, path):
        """Write this run's profile (JSON, versioned) for `python -m fused_reducer.plan`:
        per-parameter bytes and median ready times, step phases, limits, probed transport,
        machine (docs/PLANNING.md). Collective: call on every rank after >= 2 steps; rank 0
        writes `path` (every rank with "{rank}" in it). Returns the path written or None."""
        export_profile = tool("export_profile", "FusedReducer.export_profile")
        self._checked_attachment()
        return export_profile(self, path)
