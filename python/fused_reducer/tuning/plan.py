"""What-if planner: the bucket layout for a cluster you do not have yet, from one recorded run.

    python -m fused_reducer.plan PROFILE --world 8,64,512 --gpus-per-node 8 --network ib400

PROFILE comes from `model.export_profile(path)` (profile.py). For every world size the planner
predicts, with the one performance model (costmodel.py, which the autotuner uses too), the step
time and exposed communication of DDP's defaults (1 MiB first bucket, 25 MiB cap), of the
profile's own limits and of every (first, cap, last) of the autotuner's candidate grid, and
prints the best with its predicted gain. Links come from `--calibrate` (bench/allreduce_bw.py
JSON, measured) or from presets (published figures, not measured here); the output lists which
inputs were measured and which assumed. docs/PLANNING.md explains how to read it and where the
model is known to be wrong.

Exit status: 0, or 2 on bad input (nothing is written then).
"""
import argparse
import json
import math
import os
import sys

from .costmodel import (DDP_DEFAULT, MiB, CostModel, Gradients, Link, Network,
                        ProbedCollective, calibrated_network, candidate_from_json, candidate_grid,
                        check_topology, limits_json, overlap_cost, predict_sharded_step,
                        predict_step)
from .profile import ProfileError, load_profile, step_compute
from ..settings import MAX_BYTES

PLAN_FORMAT = "fused_reducer.plan"
PLAN_VERSION = 1
DEFAULT_GPUS_PER_NODE = 8

# NCCL's own latencies (src/graph/tuning.cc, ncclTopoTuneModel, protocol Simple, the one large
# buckets use): base latency of a ring all-reduce, and per hop over NVLink and over the network.
NCCL_LAUNCH_US = 8.4
NCCL_NVLINK_HOP_US = 3.4
NCCL_NET_HOP_US = 9.6

# Presets: published line rates; the efficiency (bus bandwidth / line rate), NICs per node where
# marked and the socket latency are assumptions. None of it is measured here; docs/PLANNING.md
# cites the sources.
PRESETS = {
    "nvlink-h100x8": dict(kind="intra", line_GBps=450.0, efficiency=0.8, per_node=1,
                          hop_us=NCCL_NVLINK_HOP_US,
                          source="H100 SXM datasheet: NVLink 900 GB/s bidirectional per GPU "
                                 "(450 GB/s each way), 8 GPUs per HGX board"),
    "nvlink-h200x8": dict(kind="intra", line_GBps=450.0, efficiency=0.8, per_node=1,
                          hop_us=NCCL_NVLINK_HOP_US,
                          source="H200 SXM datasheet: NVLink 900 GB/s bidirectional per GPU "
                                 "(450 GB/s each way), 8 GPUs per HGX board"),
    "ib400": dict(kind="inter", line_GBps=50.0, efficiency=0.9, per_node=8,
                  hop_us=NCCL_NET_HOP_US,
                  source="InfiniBand NDR 400 Gb/s per port (ConnectX-7); DGX H100/H200: 8 such "
                         "ports per node for the compute fabric"),
    "roce200": dict(kind="inter", line_GBps=25.0, efficiency=0.85, per_node=8,
                    hop_us=NCCL_NET_HOP_US,
                    source="RoCE v2 on 200 Gb/s Ethernet ports; 8 per node assumed"),
    "100gbe": dict(kind="inter", line_GBps=12.5, efficiency=0.7, per_node=1,
                   hop_us=2 * NCCL_NET_HOP_US,
                   source="100 Gb/s Ethernet, one NIC per node, NCCL over TCP sockets "
                          "(no RDMA): hop latency assumed twice NCCL's network figure"),
}
DEFAULT_INTRA, DEFAULT_INTER = "nvlink-h100x8", "ib400"


class PlanInputError(ValueError):
    """Bad input to the planner: reported on stderr, exit status 2."""


def preset_link(name):
    try:
        p = PRESETS[name]
    except KeyError:
        raise PlanInputError(f"unknown network preset {name!r}: choose from "
                             f"{', '.join(PRESETS)}") from None
    return Link(name, p["hop_us"], bytes_per_us=p["line_GBps"] * p["efficiency"] * 1e3,
                per_node=p["per_node"], measured=False,
                source=f"preset (not measured here): {p['source']}; bus bandwidth = "
                       f"{p['efficiency']:.0%} of the line rate (assumed)")


# -- inputs ---------------------------------------------------------------------------------------
def read_calibration(paths):
    """{world: [(bytes, time_us)]} from bench/allreduce_bw.py --json files: in-place rows of the
    'fused' implementation (the path a bucket takes), else 'torch'. Returns (measurements, meta
    per world)."""
    measurements, metas = {}, {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            world = int(data["meta"]["world_size"])
            rows = [r for r in data["rows"] if r.get("inplace")]
            impls = {r["impl"] for r in rows}
            impl = next((i for i in ("fused", "torch", "cupy") if i in impls), None)
            points = [(int(r["bytes"]), float(r["time_us"])) for r in rows if r["impl"] == impl]
        except FileNotFoundError:
            raise PlanInputError(f"calibration file {path!r} does not exist: make one with "
                                 f"python bench/allreduce_bw.py --json FILE") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlanInputError(f"calibration file {path!r} is not bench/allreduce_bw.py JSON "
                                 f"({type(e).__name__}: {e})") from None
        if world < 2 or len(points) < 2 or any(t <= 0 for _, t in points):
            raise PlanInputError(f"calibration file {path!r} needs world size >= 2 and >= 2 "
                                 f"positive in-place times; it has world {world}, "
                                 f"{len(points)} rows")
        if world in measurements:
            raise PlanInputError(f"two calibration files at world size {world}: give one per "
                                 f"world size")
        measurements[world] = points
        metas[world] = dict(data["meta"], impl=impl, path=path)
    return measurements, metas


def build_network(network_names, calibration_paths):
    """(Network, inputs, calibration metas) from --network and --calibrate."""
    chosen = {"intra": None, "inter": None}
    for name in network_names:
        link = preset_link(name)
        kind = PRESETS[name]["kind"]
        if chosen[kind] is not None:
            raise PlanInputError(f"two {kind}-node presets in --network ({chosen[kind].name}, "
                                 f"{name}): give one")
        chosen[kind] = link
    intra, inter = chosen["intra"], chosen["inter"]
    inputs, metas = [], {}
    if calibration_paths:
        if intra is not None:
            raise PlanInputError(f"--calibrate measures the intra-node link, and --network also "
                                 f"names {intra.name!r}: drop one")
        measurements, metas = read_calibration(calibration_paths)
        sources = ", ".join(f"{m['path']} (world {w}, {m['impl']}, {m.get('hostname', '?')}, "
                            f"{m.get('date', '?')})" for w, m in sorted(metas.items()))
        network, notes = calibrated_network(measurements, inter=inter, source=sources)
        inputs.append(_input("intra-node link", network.intra.describe(), "measured", sources))
        for note in notes:
            inputs.append(_input("collective fixed cost", note,
                                 "measured" if "fitted" in note else "assumed", sources))
        if inter is None:
            inputs.append(_input("inter-node link", "the calibrated link again", "assumed",
                                 "no inter-node preset given"))
    else:
        how = "preset"
        if intra is None:
            intra, how = preset_link(DEFAULT_INTRA), "assumed"
        inputs.append(_input("intra-node link", intra.describe(), how, intra.source))
        inputs.append(_input("launch per collective", f"{NCCL_LAUNCH_US} us", "preset",
                             "NCCL base latency, ring/Simple (src/graph/tuning.cc)"))
        network = Network(intra, inter or preset_link(DEFAULT_INTER), NCCL_LAUNCH_US)
    if inter is not None:
        inputs.append(_input("inter-node link", inter.describe(), "preset", inter.source))
    elif not calibration_paths:
        inputs.append(_input("inter-node link", network.inter.describe(), "assumed",
                             network.inter.source))
    return network, inputs, metas


def _input(what, value, source, detail):
    return {"input": what, "value": value, "source": source, "detail": detail}


def parse_worlds(text):
    worlds = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            world = int(part)
        except ValueError:
            raise PlanInputError(f"--world takes a comma list of integers, got {part!r} in "
                                 f"{text!r}") from None
        if world < 2:
            raise PlanInputError(f"--world {world}: a world size must be >= 2 (data "
                                 f"parallelism needs two ranks)")
        worlds.append(world)
    return sorted(set(worlds))


def ranks_per_node(world, gpus_per_node):
    """GPUs per node at this world size: --gpus-per-node (default 8), or the whole world when
    it is smaller (one node). Must divide the world size."""
    per_node = min(gpus_per_node or DEFAULT_GPUS_PER_NODE, world)
    try:
        check_topology(world, per_node)
    except ValueError as e:
        raise PlanInputError(f"--gpus-per-node {gpus_per_node or DEFAULT_GPUS_PER_NODE}: {e}") \
            from None
    return per_node


# -- the plan -------------------------------------------------------------------------------------
class Planner:
    """Predicted steps of a recorded profile on a network: `predict(candidate, world, per_node)`.
    Holds what every prediction shares (gradients, ready order, compute times after scaling and,
    for the contended reading, without the contention of the recorded run) and the list of
    inputs with their provenance."""

    def __init__(self, profile, network, inputs=(), overlap="auto", compute_scale=1.0,
                 profile_path=None, calibration_metas=None):
        if not compute_scale > 0 or math.isinf(compute_scale):
            raise PlanInputError(f"--compute-scale must be a positive number, got "
                                 f"{compute_scale!r}")
        timing = profile["timing"]
        if overlap == "auto":
            if timing.get("backward_no_comm_us"):
                overlap, overlap_source = "measured", "auto: the profile has a backward " \
                    "measured without communication"
            else:
                overlap = "contended" if profile["device"] == "cpu" else "free"
                overlap_source = f"auto: profile recorded on {profile['device']}"
        else:
            overlap_source = "given"
        if overlap == "measured" and not timing.get("backward_no_comm_us"):
            raise PlanInputError("--overlap measured needs a profile with timing."
                                 "backward_no_comm_us (a backward timed without communication, "
                                 "docs/PLANNING.md); this one has none")
        self.profile, self.network, self.overlap = profile, network, overlap
        self.inputs = list(inputs)
        if overlap != "measured":  # a measured one is listed with its numbers below
            self.inputs.append(_input("overlap", overlap, "assumed", overlap_source))
        params = profile["params"]
        self.gradients = Gradients([p["bytes"] for p in params], [p["group"] for p in params])
        self.order = [int(i) for i in profile["ready_order"]]
        self.incumbent = _limits(profile)
        compute = step_compute(profile)
        machine = profile.get("machine", {})
        self.inputs.append(_input(
            "compute (forward, gradient-ready times, backward, copy back, rest)",
            f"step {profile['timing'].get('step_us', 0) / 1e3:.2f} ms at world "
            f"{profile['world_size']}", "measured",
            f"profile {profile_path or ''} ({profile.get('created', '?')}, "
            f"{machine.get('hostname', '?')}, {profile['device']})"))
        # The recorded run is reconstructed first, on its own machine and link (unscaled);
        # --compute-scale moves the result to the target machine at the end.
        recorded, how = _recorded_collective(profile, network, calibration_metas or {})
        layout = tuple(tuple(b) for b in profile.get("buckets") or self.layout(self.incumbent))
        # Progress and the wait share belong to the recorded machine and its transport: they
        # apply when predicting that machine's link (a calibration measured on it), not presets.
        self.on_recorded_link = how.startswith("calibration")
        self.progress = self._measured_progress(compute, layout, recorded, how, timing)
        compute = self._without_recorded_contention(compute, layout, recorded, how, timing)
        # The recorded copy back was that of the recorded layout's late buckets: per layout it
        # scales with the bytes of its own (the rest is unpacked while backward goes on). The
        # profile says which they were (timing.late_bytes); older ones: the simulated ones.
        compute.finalize_bytes = timing.get("late_bytes")
        if compute.finalize_bytes is None:
            compute.finalize_bytes = CostModel(
                recorded, compute.copy_bytes_per_us, self.progress).simulate(
                layout, self.gradients.sizes, compute.ready_us,
                compute.backward_end_us).late_bytes
        self.wait_share = self._measured_wait_share(compute, layout, recorded, how, timing)
        residual_us = self._unmodelled_time(compute, layout, recorded, how, timing,
                                            compute_scale)
        self.residual_us = residual_us * compute_scale
        if compute_scale != 1.0:
            compute = compute.scaled(compute_scale)
            self.inputs.append(_input("compute scale", f"x {compute_scale:g}", "assumed",
                                      "--compute-scale"))
        self.compute = compute

    def _measured_progress(self, compute, layout, recorded, how, timing):
        """The transport's speed during backward (CostModel's `progress`), from the recorded
        step: the value at which the recorded layout's simulated communication after backward
        equals the waits measured after it (timing.exposed_wait_us), within [0, 1]. Less
        progress leaves more after backward, so it is found by bisection. Profiles without
        timing.late_bytes (written before it was measured), --overlap free, and predictions
        for another link than a calibration of the recorded host keep 1."""
        if (self.overlap == "free" or timing.get("late_bytes") is None
                or timing.get("exposed_wait_us") is None):
            return 1.0  # free overlap: the transport runs beside backward at full speed
        if not self.on_recorded_link:
            self.inputs.append(_input(
                "transport progress during backward", "1.00 (full speed)", "assumed",
                "measured only when --calibrate describes the host the profile was recorded "
                "on; predicting another network"))
            return 1.0
        measured_us = float(timing["exposed_wait_us"])

        def exposed(progress):
            return CostModel(recorded, compute.copy_bytes_per_us, progress).simulate(
                layout, self.gradients.sizes, compute.ready_us, compute.backward_end_us).exposed_us

        low, high = 0.0, 1.0
        if measured_us >= exposed(low):
            progress = low
        elif measured_us <= exposed(high):
            progress = high
        else:
            for _ in range(40):
                mid = (low + high) / 2
                low, high = (mid, high) if exposed(mid) > measured_us else (low, mid)
            progress = (low + high) / 2
        self.inputs.append(_input(
            "transport progress during backward", f"{progress:.2f} of its speed after backward",
            "measured", f"waits after backward {measured_us / 1e3:.2f} ms in the recorded step; "
            f"simulated communication after backward {exposed(0.0) / 1e3:.2f} ms at no "
            f"progress, {exposed(1.0) / 1e3:.2f} ms at full speed ({how})"))
        return progress

    def _measured_wait_share(self, compute, layout, recorded, how, timing):
        """How much longer a bucket waits after backward than its collective takes, per unit
        of the previous bucket's copy back (costmodel.predict_step's `wait_share`), from the
        recorded step's buckets after the first late one: sum over them of (wait - collective)
        / sum of the copy backs before their waits. The ranks copy back in parallel and a
        collective needs every rank, so what one rank's copy back takes longer than another's
        is waited for. 0 without the per-bucket timing (older profiles), or when predicting
        another link than a calibration of the recorded host."""
        waits, copy_backs = timing.get("bucket_waits_us"), timing.get("bucket_copy_backs_us")
        if not waits or not copy_backs or not self.on_recorded_link:
            return 0.0
        if len(waits) != len(layout) or len(copy_backs) != len(layout):
            return 0.0  # recorded with another layout than the profile's
        sizes = self.gradients.sizes
        excess, copied = 0.0, 0.0
        for k in range(1, len(layout)):
            if copy_backs[k - 1] is None:
                continue  # bucket k - 1 was unpacked during backward, or k was
            nbytes = sum(sizes[i] for i in layout[k])
            excess += max(0.0, waits[k] - recorded(nbytes))
            copied += copy_backs[k - 1]
        if copied <= 0:
            return 0.0
        # At most the whole copy back (one rank copying back while another waits); more is
        # skew the step had anyway (the end of backward on the slowest rank), not this.
        share = min(1.0, excess / copied)
        self.inputs.append(_input(
            "wait for the ranks' copy backs", f"{share:.2f} of the previous bucket's copy back",
            "measured", f"buckets after the first one copied back after backward in the "
            f"recorded step: waits beyond their collectives {excess / 1e3:.2f} ms over copy "
            f"backs {copied / 1e3:.2f} ms ({how})"))
        return share

    def _without_recorded_contention(self, compute, layout, recorded, how, timing):
        """Sets self.overlap_cost, what overlapped communication costs backward (0: free .. 1:
        its whole duration), and returns the compute without what the recorded backward paid
        for its own overlap (simulated with the link the profile was recorded on)."""
        overlapped_us = CostModel(recorded, compute.copy_bytes_per_us, self.progress).simulate(
            layout, self.gradients.sizes, compute.ready_us, compute.backward_end_us).overlapped_us
        if self.overlap == "measured":
            # The cost that turns the backward measured without communication into the
            # recorded one: (recorded - without) / overlapped, within [0, 1].
            pure_us = float(timing["backward_no_comm_us"])
            slowdown_us = compute.backward_end_us - pure_us
            self.overlap_cost = (min(1.0, max(0.0, slowdown_us / overlapped_us))
                                 if overlapped_us > 0 else 1.0)
            self.inputs.append(_input(
                "overlap cost", f"{self.overlap_cost:.2f} of overlapped communication",
                "measured", f"backward {compute.backward_end_us / 1e3:.2f} ms with "
                f"communication, {pure_us / 1e3:.2f} ms without; "
                f"{overlapped_us / 1e3:.2f} ms overlapped in the recorded layout ({how})"))
            return compute.without_contention(self.overlap_cost * overlapped_us)
        self.overlap_cost = overlap_cost(self.overlap)
        if self.overlap_cost == 0:
            return compute
        self.inputs.append(_input(
            "backward without contention", f"recorded backward minus "
            f"{self.overlap_cost * overlapped_us / 1e3:.2f} ms of overlapped communication",
            "assumed", how))
        return compute.without_contention(self.overlap_cost * overlapped_us)

    def _unmodelled_time(self, compute, layout, recorded, how, timing, compute_scale):
        """The anchor: what the model misses in the recorded layout's measured step (rank
        skew, waits and gaps it does not see), added to every prediction (scaled as compute),
        so that the model answers how layouts *differ*. 0 without a measured step."""
        measured_step_us = float(timing.get("step_us") or 0.0)
        if measured_step_us <= 0:
            return 0.0
        modelled = predict_step(compute, layout, self.gradients.sizes, recorded,
                                self.overlap_cost, self.progress, self.wait_share)
        residual_us = measured_step_us - modelled.step_us
        self.inputs.append(_input(
            "unmodelled time per step", f"{residual_us / 1e3:+.2f} ms"
            + (f" (x {compute_scale:g})" if compute_scale != 1.0 else ""), "measured",
            f"the profile's step {measured_step_us / 1e3:.2f} ms minus the model's "
            f"{modelled.step_us / 1e3:.2f} ms for the recorded layout ({how}); added to every "
            f"prediction"))
        return residual_us

    def layout(self, candidate):
        return self.gradients.layout(self.order, candidate)

    def predict(self, candidate, world, per_node):
        """costmodel.StepPrediction of a (first, cap, last) candidate."""
        return self.predict_layout(self.layout(candidate), world, per_node)

    def predict_layout(self, layout, world, per_node):
        """costmodel.StepPrediction of a layout (parameter indices per bucket)."""
        p = predict_step(self.compute, layout, self.gradients.sizes,
                         self.network.collective(world, per_node), self.overlap_cost,
                         self.progress, self.wait_share)
        return p._replace(step_us=p.step_us + self.residual_us)

    def predict_sharded_layout(self, layout, world, per_node):
        """The same layout in sharded mode (ShardedOptimizer: reduce-scatter + all-gather)."""
        p = predict_sharded_step(self.compute, layout, self.gradients.sizes,
                                 self.network.ring_pass(world, per_node), self.overlap_cost,
                                 self.progress)
        return p._replace(step_us=p.step_us + self.residual_us)


def make_plan(profile, worlds, network, inputs, gpus_per_node=None, overlap="auto",
              compute_scale=1.0, top=3, profile_path=None, calibration_metas=None):
    """The plan as a dict (the --json schema, docs/PLANNING.md)."""
    planner = Planner(profile, network, inputs, overlap, compute_scale, profile_path,
                      calibration_metas)
    gradients, incumbent = planner.gradients, planner.incumbent
    grid = candidate_grid(gradients.group_bytes, incumbent, extra=[DDP_DEFAULT])
    layouts, layout_of = {}, {}
    for candidate in [DDP_DEFAULT, incumbent] + grid:  # one representative per layout
        key = planner.layout(candidate)
        layouts.setdefault(key, candidate)
        layout_of[candidate] = key

    entries = []
    for world in worlds:
        per_node = ranks_per_node(world, gpus_per_node)
        predicted = {key: planner.predict_layout(key, world, per_node) for key in layouts}
        ranking = sorted(layouts, key=lambda k: (predicted[k].step_us, len(k), layouts[k]))

        def row(candidate, key=None):
            key = key or layout_of[candidate]
            p = predicted[key]
            return {**limits_json(candidate), "buckets": p.buckets,
                    "step_ms": p.step_us / 1e3, "exposed_comm_ms": p.exposed_us / 1e3,
                    "comm_ms": p.comm_us / 1e3}

        ddp, mine = row(DDP_DEFAULT), row(incumbent)
        best = row(layouts[ranking[0]], ranking[0])
        shard = planner.predict_sharded_layout(layout_of[incumbent], world, per_node)
        sharded = {**limits_json(incumbent), "buckets": shard.buckets,
                   "step_ms": shard.step_us / 1e3, "exposed_comm_ms": shard.exposed_us / 1e3,
                   "comm_ms": shard.comm_us / 1e3}
        sample_us, algorithm = network.allreduce(25 * MiB, world, per_node)
        entries.append({
            "world_size": world, "gpus_per_node": per_node, "nodes": world // per_node,
            "allreduce_25MiB": {"us": sample_us, "algorithm": algorithm},
            "ddp_default": ddp, "profile_limits": mine, "best": best,
            "sharded_profile_limits": sharded,
            "best_layouts": [row(layouts[k], k) for k in ranking[:top]],
            "gain_vs_ddp_ms": ddp["step_ms"] - best["step_ms"],
            "gain_vs_ddp_pct": 100 * (ddp["step_ms"] - best["step_ms"]) / ddp["step_ms"],
            "gain_vs_profile_ms": mine["step_ms"] - best["step_ms"],
            "grid": [dict(row(c), world_size=world) for c in grid],
        })
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "profile": {"path": profile_path, "created": profile.get("created"),
                    "world_size": profile["world_size"], "device": profile["device"],
                    "transport": profile.get("transport"), "machine": profile.get("machine"),
                    "software": profile.get("software"), "parameters": len(gradients.sizes),
                    "gradient_bytes": sum(gradients.sizes), "limits": limits_json(incumbent)},
        "network": {"intra": network.intra.to_json(), "inter": network.inter.to_json(),
                    "launch_us": network.launch_us},
        "overlap": planner.overlap, "overlap_cost": planner.overlap_cost,
        "compute_scale": compute_scale,
        "layouts_considered": len(layouts), "inputs": planner.inputs, "worlds": entries,
        "note": "predictions of costmodel.py, not measurements; see docs/PLANNING.md",
    }


def _limits(profile):
    return candidate_from_json(profile["limits"])


def _recorded_collective(profile, network, metas):
    """The collective cost of the run the profile was recorded in: the calibration when it was
    measured on the same host at the same world size, else the profile's own probe."""
    world = profile["world_size"]
    host = profile.get("machine", {}).get("hostname")
    meta = metas.get(world)
    if meta and host and meta.get("hostname") == host:
        return network.collective(world, world), f"calibration at world {world} on {host}"
    probe = profile["probe"]
    return (ProbedCollective(probe["latency_us"], probe["bandwidth_GBps"] * 1e3),
            f"the profile's transport probe ({probe['latency_us']:.0f} us, "
            f"{probe['bandwidth_GBps']:.2f} GB/s)")


def _plan_entry(hint, world):
    """The entry of a plan (dict or file path) for `world` (else the nearest world size by
    ratio: 256 takes 512's before 8's); None when `hint` is not a plan but a list."""
    if isinstance(hint, (str, os.PathLike)):
        try:
            with open(hint) as f:
                hint = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"planner_hint {str(hint)!r}: cannot read a plan from it ({e})") \
                from None
    if not isinstance(hint, dict):
        return None
    if hint.get("format") != PLAN_FORMAT or not hint.get("worlds"):
        raise ValueError(f"planner_hint is not a plan of python -m fused_reducer.plan "
                         f"--json (format {hint.get('format')!r})")
    return min(hint["worlds"], key=lambda e: (abs(math.log(e["world_size"] / world)),
                                              e["world_size"]))


def hinted_layouts(hint, world):
    """(first, cap, last) candidates from a planner hint: a plan dict, a plan file path, or a
    list of triples. From a plan, the best layouts of the entry for `world` (else the nearest
    world size by ratio: 256 takes 512's before 8's)."""
    entry = _plan_entry(hint, world)
    if entry is not None:
        hint = [candidate_from_json(r) for r in entry["best_layouts"]]
    return checked_layouts("planner_hint", hint)


def checked_layouts(name, layouts):
    """`layouts` (first, cap, last) or (limit, ..., last) in bytes as a list of int tuples,
    duplicates dropped; ValueError naming `name` and the layout otherwise."""
    try:
        candidates = [tuple(_layout_int(v) for v in c) for c in layouts]
    except (TypeError, ValueError, OverflowError):
        what = "a plan, a plan file or a list" if name == "planner_hint" else "a list"
        raise ValueError(f"{name} must be {what} of (first, cap, last) in bytes, got "
                         f"{layouts!r}") from None
    for c in candidates:
        if len(c) < 2 or min(c[:-1]) <= 0 or c[-1] < 0 or max(c) > MAX_BYTES:
            raise ValueError(f"{name} layout {c!r}: need (first > 0, cap > 0, last >= 0) "
                             f"bytes, or (limit > 0, ..., last >= 0), each at most 2**62")
    return list(dict.fromkeys(candidates))


def _layout_int(value):
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(value)
    return int(value)


def planned_steps(hint, world):
    """What a plan predicts for `world` (its entry, else the nearest world size's), for
    autotune(verify=True): {"world_size": the entry's, "rows": [(label, (first, cap, last),
    predicted step ms)]}: the best layouts, then DDP's default. A list of layouts has no
    predictions: ValueError."""
    entry = _plan_entry(hint, world)
    if entry is None:
        raise ValueError("autotune(verify=True) needs a plan (the --json output of python -m "
                         "fused_reducer.plan, or its path) as planner_hint: a list of layouts "
                         "holds no predictions to verify")
    rows = [(f"plan best {i + 1}", candidate_from_json(r), float(r["step_ms"]))
            for i, r in enumerate(entry["best_layouts"])]
    rows.append(("DDP default", candidate_from_json(entry["ddp_default"]),
                 float(entry["ddp_default"]["step_ms"])))
    return {"world_size": entry["world_size"], "rows": rows}


# -- output ---------------------------------------------------------------------------------------
def _size(nbytes):
    if nbytes == 0:
        return "off"
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return f"{nbytes / MiB:.2f}M"


def _triple(r):
    caps = r.get("bucket_caps_bytes") or [r["first_bucket_bytes"], r["bucket_cap_bytes"]]
    return "(" + ", ".join(_size(c) for c in caps) + f", {_size(r['last_bucket_bytes'])})"


def format_plan(plan):
    prof = plan["profile"]
    lines = [
        f"# fused_reducer.plan: PREDICTIONS of the cost model, not measurements",
        f"# profile {prof['path']}: {prof['parameters']} tensors, "
        f"{prof['gradient_bytes'] / 1e6:.1f} MB of gradients; recorded at world "
        f"{prof['world_size']} on {prof['device']} ({prof['transport']}), limits "
        f"{_triple(prof['limits'])}",
        f"# overlap {plan['overlap']} (cost {plan['overlap_cost']:.2f}), compute scale {plan['compute_scale']:g}, "
        f"{plan['layouts_considered']} distinct layouts considered",
        "#",
        "#  world  nodes  x GPUs  layout                                   buckets   step ms  "
        "exposed ms   comm ms",
    ]
    for e in plan["worlds"]:
        for label, r in (("DDP default", e["ddp_default"]), ("profile", e["profile_limits"]),
                         ("best", e["best"])):
            head = (f"  {e['world_size']:6d}  {e['nodes']:5d}  {e['gpus_per_node']:6d}"
                    if label == "DDP default" else " " * 25)
            lines.append(f"{head}  {label + ' ' + _triple(r):<40} {r['buckets']:7d} "
                         f"{r['step_ms']:9.2f} {r['exposed_comm_ms']:11.2f} {r['comm_ms']:9.2f}")
        r = e["sharded_profile_limits"]
        lines.append(f"{'':25}  {'sharded ' + _triple(r):<40} {r['buckets']:7d} "
                     f"{r['step_ms']:9.2f} {r['exposed_comm_ms']:11.2f} {r['comm_ms']:9.2f}")
        lines.append(f"{'':27}gain of best vs DDP default: {e['gain_vs_ddp_ms']:.2f} ms "
                     f"({e['gain_vs_ddp_pct']:.1f} %); vs profile: "
                     f"{e['gain_vs_profile_ms']:.2f} ms; 25 MiB all-reduce "
                     f"{e['allreduce_25MiB']['us'] / 1e3:.2f} ms ({e['allreduce_25MiB']['algorithm']})")
    lines.append("#")
    lines.append("# inputs:")
    for source in ("measured", "preset", "assumed"):
        for i in plan["inputs"]:
            if i["source"] == source:
                label = {"measured": "measured", "preset": "preset (published, not measured "
                         "here)", "assumed": "ASSUMED"}[source]
                lines.append(f"#   {label}: {i['input']}: {i['value']} [{i['detail']}]")
    return "\n".join(lines)


def render_plot(plan, path, heatmap_world):
    """(a) predicted step time vs world size for DDP's default, the profile's limits and the
    best layout; (b) heatmap of predicted step time over (first, cap) at one world size, with
    the best layout's last bucket."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    entries = plan["worlds"]
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(13, 5))
    worlds = [e["world_size"] for e in entries]
    for key, label, style in (("ddp_default", "DDP default (1M, 25M, off)", "o-"),
                              ("profile_limits", "profile's limits", "s--"),
                              ("best", "best of the grid", "^-")):
        ax.plot(worlds, [e[key]["step_ms"] for e in entries], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("world size (GPUs)")
    ax.set_ylabel("predicted step time (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("predicted step time vs world size (PREDICTION)", fontsize=10)

    entry = next(e for e in entries if e["world_size"] == heatmap_world)
    last = entry["best"]["last_bucket_bytes"]
    cells = [r for r in entry["grid"] if r["last_bucket_bytes"] == last]
    firsts = sorted({r["first_bucket_bytes"] for r in cells})
    caps = sorted({r["bucket_cap_bytes"] for r in cells})
    grid = np.full((len(firsts), len(caps)), np.nan)
    for r in cells:
        grid[firsts.index(r["first_bucket_bytes"]), caps.index(r["bucket_cap_bytes"])] = r["step_ms"]
    im = hx.imshow(grid, origin="lower", aspect="auto", cmap="viridis_r")
    fig.colorbar(im, ax=hx, label="predicted step (ms)")
    for i in range(len(firsts)):
        for j in range(len(caps)):
            if np.isfinite(grid[i, j]):
                r, g, b, _ = im.cmap(im.norm(grid[i, j]))
                ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                hx.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=7,
                        color=ink)
    hx.set_xticks(range(len(caps)), [_size(c) for c in caps])
    hx.set_yticks(range(len(firsts)), [_size(f) for f in firsts])
    hx.set_xlabel("bucket cap")
    hx.set_ylabel("first bucket")
    hx.set_title(f"world {heatmap_world}: step over (first, cap), last {_size(last)} "
                 f"(PREDICTION)", fontsize=10)
    prof = plan["profile"]
    fig.suptitle(f"fused_reducer.plan - profile {os.path.basename(prof['path'] or '')} "
                 f"({prof['gradient_bytes'] / 1e6:.0f} MB gradients, recorded on "
                 f"{prof['device']}), overlap {plan['overlap']}, compute x{plan['compute_scale']:g}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------------
def _overlap(text):
    if text in ("auto", "free", "contended", "measured"):
        return text
    try:
        return overlap_cost(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--overlap takes auto, free, contended, measured or a number in [0, 1]; got "
            f"{text!r}") from None


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m fused_reducer.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="profile JSON from model.export_profile(path)")
    parser.add_argument("--world", default=None,
                        help="comma list of world sizes to plan for (default: the profile's)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help=f"ranks per node (default {DEFAULT_GPUS_PER_NODE}; a smaller world "
                             f"is one node); must divide every world size")
    parser.add_argument("--network", default="",
                        help=f"comma list of presets, at most one intra-node and one "
                             f"inter-node: {', '.join(PRESETS)} (defaults {DEFAULT_INTRA}, "
                             f"{DEFAULT_INTER}; not measured here)")
    parser.add_argument("--calibrate", action="append", default=[], metavar="FILE",
                        help="bench/allreduce_bw.py --json output measured on one node; "
                             "repeat for several world sizes. Replaces the intra-node preset")
    parser.add_argument("--overlap", type=_overlap, default="auto",
                        help="what communication overlapping backward costs it: free (nothing: "
                             "GPU), contended (its duration: CPU ranks sharing cores), a "
                             "fraction 0..1, or measured (from the profile's backward without "
                             "communication); auto: measured when the profile has it, else "
                             "contended for a CPU profile and free otherwise")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="multiply the profile's compute times (0.25: the target machine "
                             "computes 4x as fast); default 1")
    parser.add_argument("--top", type=int, default=3, help="best layouts listed per world size "
                                                           "(the autotuner's planner_hint)")
    parser.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="step time vs world size, and a (first, cap) heatmap")
    parser.add_argument("--heatmap-world", type=int, default=None,
                        help="world size of the heatmap (default the largest)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        plan = run(args)
    except (PlanInputError, ProfileError) as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    for path in (args.json, args.plot):
        if path:
            print(f"# wrote {path}")
    return 0


def run(args):
    """Check every input, plan, then write the outputs (nothing is written on bad input)."""
    profile = load_profile(args.profile)
    worlds = parse_worlds(args.world) if args.world else parse_worlds(str(profile["world_size"]))
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise PlanInputError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    for world in worlds:
        ranks_per_node(world, args.gpus_per_node)
    if args.top < 1:
        raise PlanInputError(f"--top must be >= 1, got {args.top}")
    heatmap_world = args.heatmap_world or worlds[-1]
    if args.plot and heatmap_world not in worlds:
        raise PlanInputError(f"--heatmap-world {heatmap_world} is not one of --world "
                             f"{','.join(map(str, worlds))}")
    names = [n.strip() for n in args.network.split(",") if n.strip()]
    network, inputs, metas = build_network(names, args.calibrate)
    plan = make_plan(profile, worlds, network, inputs, args.gpus_per_node, args.overlap,
                     args.compute_scale, args.top, args.profile, metas)
    # Outputs go to temporary names first, so that a failure leaves no partial file behind.
    pending = []
    try:
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise PlanInputError("--plot needs matplotlib (pip install matplotlib)") from None
            tmp = _tmp_name(args.plot)
            render_plot(plan, tmp, heatmap_world)
            pending.append((tmp, args.plot))
        if args.json:
            tmp = _tmp_name(args.json)
            with open(tmp, "w") as f:
                json.dump(plan, f, indent=1)
                f.write("\n")
            pending.append((tmp, args.json))
        for tmp, path in pending:
            os.replace(tmp, path)
        pending = []
    finally:
        for tmp, _ in pending:
            if os.path.exists(tmp):
                os.remove(tmp)
    return plan


def _tmp_name(path):
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PlanInputError(f"cannot write {path!r}: directory {parent!r} does not exist")
    root, ext = os.path.splitext(path)
    return f"{root}.tmp{os.getpid()}{ext}"  # keeps the extension: matplotlib picks the format


if __name__ == "__main__":
    sys.exit(main())
