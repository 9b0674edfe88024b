"""The one performance model of FusedReducer: what a bucket layout costs per training step.

Used by the autotuner (autotune.py: its shortlist, from the transport it probes, probe.py) and
by the planner (plan.py: other world sizes and networks, from a recorded profile, profile.py);
both take the layout facts of the reducer's parameters from here (`ParamInfo`), so neither
imports the other. docs/PLANNING.md describes it for users. Three parts:

1. Collectives (`Network`, `ProbedCollective`): microseconds of one all-reduce of n bytes.
   `Network` follows NCCL's own cost model (src/graph/tuning.cc, ncclTopoTuneModel):
     ring  launch + (2(n-1) - 2(N-1)) intra hops + 2(N-1) inter hops
           + 2(n-1)/n * bytes / bus bandwidth
     tree  launch + 2 * ((G-1) intra hops + floor(log2 N) inter hops)
           + 2 * bytes / bus bandwidth        (NCCL: tree algorithm bandwidth = bus bw / 2)
   for n ranks on N nodes of G ranks each. The bus bandwidth is the intra-node link's on one
   node; across nodes the slower of the intra-node link and the node's network links together
   (NCCL spreads its rings' channels over the NICs). The faster algorithm is taken, as NCCL's
   tuner does. `ProbedCollective` is one line, latency + bytes / bandwidth, measured at the
   world size in use (the autotuner's probe).
2. The backward timeline (`CostModel.simulate`): buckets launch strictly in order, each when
   its last gradient is ready (plus the copy into the bucket), and the transport runs one
   collective at a time, at a measured share of its speed (`progress`) while backward computes.
3. The step (`predict_step`): forward + the timeline + copying the buckets whose collective
   ends after backward back into .grad + the rest of the step (optimizer, data), from a
   recorded profile (`StepCompute`).
"""
import bisect
import math
from collections import namedtuple

KiB = 1024
MiB = 1024 * 1024
# Sizes tried for the first bucket and the cap (values beyond the gradient bytes are all "one
# bucket" and collapse into one layout), and for the last bucket (0 = none).
SIZE_LADDER = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)
LAST_LADDER = (0, 256 * KiB, 1 * MiB, 4 * MiB)
DDP_DEFAULT = (1 * MiB, 25 * MiB, 0)  # DDP's first bucket and cap; no separate last bucket


# A candidate configuration is a tuple: the bucket limits in launch order (the last repeating),
# then the last bucket's size: (first, cap, last) in the common case, (c0, c1, ..., ck, last)
# for a list of limits (bucket_caps_bytes; DDP's bucket_cap_mb_list).
def candidate(caps, last):
    return tuple(int(c) for c in caps) + (int(last),)


def caps_of(candidate_):
    return list(candidate_[:-1])


def limits_json(candidate_):
    """A candidate as the reducer's setting names."""
    return {"first_bucket_bytes": candidate_[0], "bucket_cap_bytes": candidate_[-2],
            "last_bucket_bytes": candidate_[-1], "bucket_caps_bytes": caps_of(candidate_)}


def candidate_from_json(limits):
    """limits_json's inverse; dicts without bucket_caps_bytes (older files) are (first, cap)."""
    caps = limits.get("bucket_caps_bytes") or (limits["first_bucket_bytes"],
                                               limits["bucket_cap_bytes"])
    return candidate(caps, limits["last_bucket_bytes"])


def candidate_grid(group_bytes, incumbent, extra=()):
    """Every (first, cap, last) considered: ladder values up to the first one that holds the
    largest group whole, the values of the incumbent and of `extra` candidates, and no last
    bucket at least half the group."""
    total = max(group_bytes)
    ladder = []
    for size in SIZE_LADDER:
        ladder.append(size)
        if size >= total:
            break
    pinned = [tuple(incumbent)] + [tuple(c) for c in extra]
    firsts = sorted(set(ladder) | {c[0] for c in pinned})
    caps = sorted(set(ladder) | {c[-2] for c in pinned})
    lasts = sorted({v for v in LAST_LADDER if v == 0 or 2 * v <= total} | {c[-1] for c in pinned})
    return [(f, c, l) for f in firsts for c in caps for l in lasts]


class Gradients:
    """What bucketing needs about the gradients: bytes and (dtype, device) group per parameter."""

    def __init__(self, sizes, groups):
        self.sizes = [int(s) for s in sizes]
        self.groups = [int(g) for g in groups]
        totals = {}
        for size, group in zip(self.sizes, self.groups):
            totals[group] = totals.get(group, 0) + size
        self.group_bytes = list(totals.values())

    def layout(self, order, candidate_):
        """Parameter indices per bucket, in launch order: the reducer's own assignment."""
        from .. import _C
        return tuple(tuple(b) for b in _C.assign_buckets(self.sizes, self.groups, list(order),
                                                         caps_of(candidate_), candidate_[-1]))


class ParamInfo(Gradients):
    """Gradients of the reducer's parameters (same on every rank): bytes and group of each
    gradient in its bucket, i.e. in the reduce dtype for floating-point gradients when one is
    set (the C++ reducer's bucket_dtype rule; limits count those bytes). Used by the tuner and
    by the profile; `group_names` names each group ("<dtype> <device>")."""

    def __init__(self, params, reduce_dtype=None):
        def bucket_dtype(p):
            floating = reduce_dtype is not None and p.dtype.is_floating_point
            return reduce_dtype if floating else p.dtype
        keys = {}
        groups = [keys.setdefault((bucket_dtype(p), str(p.device)), len(keys)) for p in params]
        super().__init__([p.numel() * bucket_dtype(p).itemsize for p in params], groups)
        self.group_names = [f"{dtype} {device}" for dtype, device in keys]  # by group number


# -- collectives ----------------------------------------------------------------------------------
class Link:
    """One kind of connection between ranks: a latency per ring/tree hop and a bus bandwidth
    (nccl-tests' busbw, bytes per microsecond = MB/s). `per_node`: such links working in
    parallel out of one node (NICs), for the inter-node link. A calibrated link has a bandwidth
    per message size, for each world size it was measured at (`tables`); a preset one constant.
    """

    def __init__(self, name, hop_us, bytes_per_us=None, tables=None, per_node=1, measured=False,
                 source=""):
        if bytes_per_us is None and not tables:
            raise ValueError(f"link {name!r} needs a bandwidth or calibration tables")
        self.name = name
        self.hop_us = float(hop_us)
        self.constant = None if bytes_per_us is None else float(bytes_per_us)
        self.tables = {int(w): sorted(t) for w, t in (tables or {}).items()}
        self.per_node = int(per_node)
        self.measured = measured
        self.source = source

    def bytes_per_us(self, nbytes, ranks):
        """Bus bandwidth for a message of nbytes among `ranks` ranks. Calibrated: from the table
        of the nearest world size measured, with the transfer time (bytes / bandwidth)
        interpolated linearly between measured sizes (time grows with size, so this never
        overshoots), and the nearest measured bandwidth beyond the table's ends."""
        if self.constant is not None:
            return self.constant
        world = min(self.tables, key=lambda w: (abs(w - ranks), w))
        table = self.tables[world]
        i = bisect.bisect_left([s for s, _ in table], nbytes)
        if i == 0:
            return table[0][1]
        if i == len(table):
            return table[-1][1]
        (s0, b0), (s1, b1) = table[i - 1], table[i]
        t0, t1 = s0 / b0, s1 / b1
        t = t0 + (nbytes - s0) / (s1 - s0) * (t1 - t0)
        return nbytes / t if t > 0 else math.inf

    def describe(self):
        if self.constant is not None:
            bw = f"{self.constant / 1e3:.1f} GB/s busbw"
        else:
            bws = [b for t in self.tables.values() for _, b in t if math.isfinite(b)] or [0.0]
            bw = f"{min(bws) / 1e3:.2f}-{max(bws) / 1e3:.2f} GB/s busbw by size"
        per = f" x {self.per_node} per node" if self.per_node > 1 else ""
        return f"{self.name}: {self.hop_us:.1f} us/hop, {bw}{per}"

    def to_json(self):
        return {"name": self.name, "hop_latency_us": self.hop_us, "per_node": self.per_node,
                "bus_GBps": None if self.constant is None else self.constant / 1e3,
                "calibrated_worlds": sorted(self.tables), "measured": self.measured,
                "source": self.source}


class Network:
    """All-reduce cost of a cluster: `intra` connects the ranks of a node, `inter` the nodes;
    `launch_us` is paid once per collective (NCCL's base latency, a kernel launch)."""

    def __init__(self, intra, inter, launch_us):
        self.intra = intra
        self.inter = inter
        self.launch_us = float(launch_us)

    def bus_bytes_per_us(self, nbytes, world, per_node):
        intra = self.intra.bytes_per_us(nbytes, per_node)
        if world == per_node:
            return intra
        return min(intra, self.inter.per_node * self.inter.bytes_per_us(nbytes, world // per_node))

    def ring_us(self, nbytes, world, per_node):
        nodes = world // per_node
        steps, inter_steps = 2 * (world - 1), 2 * (nodes - 1)
        latency = (self.launch_us + (steps - inter_steps) * self.intra.hop_us
                   + inter_steps * self.inter.hop_us)
        return latency + 2 * (world - 1) / world * nbytes / self.bus_bytes_per_us(
            nbytes, world, per_node)

    def tree_us(self, nbytes, world, per_node):
        nodes = world // per_node
        latency = self.launch_us + 2 * ((per_node - 1) * self.intra.hop_us
                                        + int(math.log2(nodes)) * self.inter.hop_us)
        return latency + 2 * nbytes / self.bus_bytes_per_us(nbytes, world, per_node)

    def ring_pass_us(self, nbytes, world, per_node):
        """One ring reduce-scatter (or all-gather) of an `nbytes` buffer: half of ring_us's
        all-reduce, world - 1 steps each moving 1/world of it (NCCL runs both as rings)."""
        nodes = world // per_node
        steps, inter_steps = world - 1, nodes - 1
        latency = (self.launch_us + (steps - inter_steps) * self.intra.hop_us
                   + inter_steps * self.inter.hop_us)
        return latency + (world - 1) / world * nbytes / self.bus_bytes_per_us(
            nbytes, world, per_node)

    def allreduce(self, nbytes, world, per_node):
        """(microseconds, "ring" or "tree") of one all-reduce: the faster of the two."""
        check_topology(world, per_node)
        ring = self.ring_us(nbytes, world, per_node)
        tree = self.tree_us(nbytes, world, per_node)
        return (ring, "ring") if ring <= tree else (tree, "tree")

    def collective(self, world, per_node):
        """nbytes -> microseconds at this world size: what CostModel takes."""
        check_topology(world, per_node)
        return lambda nbytes: self.allreduce(nbytes, world, per_node)[0]

    def ring_pass(self, world, per_node):
        """nbytes -> microseconds of a reduce-scatter or all-gather (sharded mode)."""
        check_topology(world, per_node)
        return lambda nbytes: self.ring_pass_us(nbytes, world, per_node)


def check_topology(world, per_node):
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world size must be an integer >= 2 (data parallelism needs two "
                         f"ranks), got {world!r}")
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"ranks per node must be an integer >= 1, got {per_node!r}")
    if world % per_node:
        raise ValueError(f"{per_node} GPUs per node do not divide world size {world}: every "
                         f"node must hold the same number of ranks")


class ProbedCollective:
    """latency + bytes / bandwidth: one all-reduce at the world size the probe ran at."""

    def __init__(self, latency_us, bytes_per_us):
        self.latency_us = float(latency_us)
        self.bytes_per_us = float(bytes_per_us)

    def __call__(self, nbytes):
        return self.latency_us + nbytes / self.bytes_per_us


def calibrated_network(measurements, inter=None, source=""):
    """Network from all-reduce times measured on one node: measurements = {world: [(nbytes,
    time_us), ...]} (bench/allreduce_bw.py at one or more world sizes). Returns (network,
    notes): notes say which parts were fitted and which assumed.

    Per world size, a line time = fixed + bytes * slope fitted over all sizes (relative least
    squares) gives the fixed cost. With two or more world sizes, fixed = launch + 2(n-1) hops
    is fitted across them; with one, the fixed cost is assumed to split evenly over the launch
    and the 2(n-1) hops. Then, per measured size, the bus bandwidth that reproduces the measured
    time exactly at that world size: 2(n-1)/n * bytes / (time - fixed) (infinite when the time
    is not above the fixed cost: a tiny message). `inter`: the link
    between nodes (default: the calibrated link again, assumed)."""
    if not measurements:
        raise ValueError("no calibration measurements")
    fixed = {}
    for world, points in measurements.items():
        if world < 2 or len(points) < 2:
            raise ValueError(f"calibration at world size {world} needs >= 2 ranks and >= 2 "
                             f"message sizes, got {len(points)} sizes")
        fixed[world] = _fit_fixed_cost(points)
    notes = []
    if len(fixed) >= 2:
        hop_us, launch_us = _fit_line([2 * (w - 1) for w in fixed], list(fixed.values()))
        hop_us, launch_us = max(hop_us, 0.0), max(launch_us, 0.0)
        notes.append(f"launch {launch_us:.1f} us and {hop_us:.1f} us per hop fitted across "
                     f"world sizes {sorted(fixed)}")
    else:
        (world, f), = fixed.items()
        hop_us = launch_us = f / (2 * (world - 1) + 1)
        notes.append(f"one world size ({world}): its fixed cost {f:.1f} us assumed to split "
                     f"evenly into a launch and {2 * (world - 1)} hops ({hop_us:.1f} us each)")
    tables = {}
    for world, points in measurements.items():
        table = []
        for nbytes, time_us in sorted(points):
            rest = time_us - (launch_us + 2 * (world - 1) * hop_us)
            bus_bytes = 2 * (world - 1) / world * nbytes
            # Not above the fixed cost (a tiny message, noise): transfer time taken as 0.
            table.append((nbytes, bus_bytes / rest if rest > 0 else math.inf))
        tables[world] = table
    link = Link("calibrated", hop_us, tables=tables, measured=True, source=source)
    return Network(link, inter or link, launch_us), notes


def _fit_line(xs, ys, weights=None):
    """(slope, intercept) of weighted least squares."""
    weights = weights or [1.0] * len(xs)
    sw = sum(weights)
    mx = sum(w * x for w, x in zip(weights, xs)) / sw
    my = sum(w * y for w, y in zip(weights, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _fit_fixed_cost(points):
    """Intercept of time = fixed + bytes * slope, relative errors weighted equally (1 / t^2),
    so that the small messages, which carry the fixed cost, count."""
    xs = [float(n) for n, _ in points]
    ys = [float(t) for _, t in points]
    _, intercept = _fit_line(xs, ys, [1.0 / max(t, 1e-9) ** 2 for t in ys])
    return min(max(intercept, 0.0), min(ys))


# -- the backward timeline ------------------------------------------------------------------------
class Timeline(namedtuple("Timeline",
                          "free_us contended_us exposed_us overlapped_us comm_us late_bytes")):
    """late_bytes: bytes of the buckets whose collective ends after backward, which are copied
    back into .grad at its end (the others are unpacked while backward goes on)."""

    def end_us(self, overlap_cost):
        """End of the reduction when overlapped communication costs backward `overlap_cost`
        (0: free, 1: contended) of its duration."""
        return self.free_us + overlap_cost * self.overlapped_us


class CostModel:
    """Time from the first gradient until a step's gradients are reduced, for a layout, from
    the gradient-ready times, a collective cost (nbytes -> us) and the copy rate into buckets.

    Two readings of the same simulation bound what overlap is worth:
      free       communication running while backward computes costs backward nothing (a GPU
                 with NCCL on its own stream): end = max(end of backward, last bucket done);
      contended  it costs backward its full duration (CPU ranks whose transport threads share
                 the cores with backward): end = end of backward + communication overlapped
                 with it + what is left after it.
    Between them, an overlap cost c in [0, 1] (measured from a profile, see plan.Planner):
    end = end of backward + c x overlapped + what is left after it (`Timeline.end_us`).

    `progress` in [0, 1]: how fast the transport moves while backward computes, as a share of
    its speed after backward (measured from a profile, see plan.Planner). 1 where it has its
    own engine (NCCL on a GPU); near 0 where its threads wait for cores that backward holds
    (CPU ranks on a fully loaded host): a collective launched during backward then mostly
    runs after it. `overlapped` counts the transport's work done during backward.
    """

    def __init__(self, collective_us, copy_bytes_per_us, progress=1.0):
        if not 0.0 <= progress <= 1.0:
            raise ValueError(f"progress must be in [0, 1], got {progress!r}")
        self.collective_us = collective_us
        self.copy_bytes_per_us = copy_bytes_per_us
        self.progress = float(progress)

    @classmethod
    def from_probe(cls, latency_us, bytes_per_us, copy_bytes_per_us):
        return cls(ProbedCollective(latency_us, bytes_per_us), copy_bytes_per_us)

    def simulate(self, layout, sizes, ready_us, backward_end_us):
        """Timeline of one backward: buckets (parameter indices, launch order) launch in order
        when their last gradient is ready and the copy into the bucket is done; the transport
        runs one collective at a time. Microseconds from the first gradient."""
        launch = 0.0
        transport_free = 0.0
        overlapped = 0.0
        comm = 0.0
        late_bytes = 0
        for bucket in layout:
            times = [ready_us[i] for i in bucket if not math.isnan(ready_us[i])]
            ready = max(times) if times else backward_end_us
            nbytes = sum(sizes[i] for i in bucket)
            launch = max(launch, ready) + nbytes / self.copy_bytes_per_us
            start = max(transport_free, launch)
            duration = self.collective_us(nbytes)
            transport_free, during = self._run(start, duration, backward_end_us)
            comm += duration
            overlapped += during
            if transport_free > backward_end_us:
                late_bytes += nbytes
        exposed = max(0.0, transport_free - backward_end_us)
        return Timeline(backward_end_us + exposed, backward_end_us + overlapped + exposed,
                        exposed, overlapped, comm, late_bytes)

    def _run(self, start, duration, backward_end_us):
        """(end, work done during backward) of a collective of `duration` started at `start`:
        at `progress` of its speed until backward ends, at full speed after."""
        if start >= backward_end_us:
            return start + duration, 0.0
        window_work = (backward_end_us - start) * self.progress
        if self.progress > 0 and duration <= window_work:
            return start + duration / self.progress, duration
        return backward_end_us + duration - window_work, window_work

    def predict_us(self, layout, sizes, ready_us, backward_end_us):
        """(free, contended) end of the reduction, microseconds after the first gradient."""
        t = self.simulate(layout, sizes, ready_us, backward_end_us)
        return t.free_us, t.contended_us


# -- the step -------------------------------------------------------------------------------------
def step_periods(history):
    """(record, forward-to-forward period in us) for each recorded step followed by the next
    step (reducer.history() records; consecutive step numbers only: a no_sync step in between
    would count in the period)."""
    return [(a, b["origin_us"] + b["forward_us"] - a["origin_us"] - a["forward_us"])
            for a, b in zip(history, history[1:]) if b["step"] == a["step"] + 1]


class StepCompute:
    """The compute side of one training step, from a recorded profile (microseconds):
    forward_us: forward start -> first gradient ready; ready_us: per parameter, after the first
    gradient; backward_end_us; finalize_us: copying reduced buckets back into .grad after
    backward (waits excluded); other_us: gradients written back -> next forward (optimizer,
    zero_grad, data); copy_bytes_per_us: the copy into buckets. finalize_bytes: the bytes that
    finalize_us copied back (the recorded layout's late buckets), when known: a layout's copy
    back then takes finalize_us x its own late bytes / finalize_bytes."""

    def __init__(self, forward_us, ready_us, backward_end_us, finalize_us, other_us,
                 copy_bytes_per_us, finalize_bytes=None):
        self.forward_us = forward_us
        self.ready_us = list(ready_us)
        self.backward_end_us = backward_end_us
        self.finalize_us = finalize_us
        self.other_us = other_us
        self.copy_bytes_per_us = copy_bytes_per_us
        self.finalize_bytes = finalize_bytes

    def finalize_for(self, late_bytes):
        """Copy back after a backward whose late buckets hold `late_bytes`."""
        if not self.finalize_bytes:
            return self.finalize_us
        return self.finalize_us * late_bytes / self.finalize_bytes

    def scaled(self, factor):
        """The same step on a machine `factor` times as slow (0.5: twice as fast)."""
        return StepCompute(self.forward_us * factor, [t * factor for t in self.ready_us],
                           self.backward_end_us * factor, self.finalize_us * factor,
                           self.other_us * factor, self.copy_bytes_per_us / factor,
                           self.finalize_bytes)

    def without_contention(self, overlapped_us):
        """Backward as it would run without `overlapped_us` of communication stealing its cores
        (contended reading): every ready time shrinks in proportion."""
        pure = max(self.backward_end_us - overlapped_us, 0.5 * self.backward_end_us)
        factor = pure / self.backward_end_us if self.backward_end_us > 0 else 1.0
        return StepCompute(self.forward_us, [t * factor for t in self.ready_us], pure,
                           self.finalize_us, self.other_us, self.copy_bytes_per_us,
                           self.finalize_bytes)


StepPrediction = namedtuple("StepPrediction", "step_us exposed_us comm_us buckets")


OVERLAP_COSTS = {"free": 0.0, "contended": 1.0}


def overlap_cost(overlap):
    """0..1 from "free", "contended" or a number in [0, 1] (see CostModel)."""
    if overlap in OVERLAP_COSTS:
        return OVERLAP_COSTS[overlap]
    if isinstance(overlap, (int, float)) and not isinstance(overlap, bool) and 0 <= overlap <= 1:
        return float(overlap)
    raise ValueError(f"overlap must be 'free', 'contended' or a number in [0, 1], got "
                     f"{overlap!r}")


def predict_sharded_step(compute, layout, sizes, ring_pass_us, overlap="free", progress=1.0):
    """Predicted step of `layout` in sharded mode (ShardedOptimizer): each bucket is
    reduce-scattered as it completes (the same timeline, at a ring pass's cost), nothing is
    copied back into .grad, and after the optimizer step every bucket's parameters are
    all-gathered, exposed (it runs at the end of step()). The rest of the step (other_us,
    optimizer included) is kept whole: that each rank updates 1/world of the parameters is not
    modelled, so the prediction errs slow."""
    cost_of_overlap = overlap_cost(overlap)
    cost = CostModel(ring_pass_us, compute.copy_bytes_per_us, progress)
    t = cost.simulate(layout, sizes, compute.ready_us, compute.backward_end_us)
    gather = sum(ring_pass_us(sum(sizes[i] for i in bucket)) for bucket in layout)
    step = compute.forward_us + t.end_us(cost_of_overlap) + compute.other_us + gather
    return StepPrediction(step, t.exposed_us + gather, t.comm_us + gather, len(layout))


def predict_step(compute, layout, sizes, collective_us, overlap="free", progress=1.0,
                 wait_share=0.0):
    """Predicted step of `layout`: forward + reduction timeline (`overlap`: "free",
    "contended" or the cost in between; `progress`: the transport's speed during backward, see
    CostModel) + copy back + the rest of the step. `wait_share`: each bucket copied back after
    backward but the last makes the next one's wait longer by that share of its copy back (the
    ranks' copy backs do not end together; measured by plan.Planner)."""
    cost_of_overlap = overlap_cost(overlap)
    cost = CostModel(collective_us, compute.copy_bytes_per_us, progress)
    t = cost.simulate(layout, sizes, compute.ready_us, compute.backward_end_us)
    end = t.end_us(cost_of_overlap)
    copy_back = compute.finalize_for(t.late_bytes)
    if wait_share and t.late_bytes:  # the last bucket is late whenever any is
        last_bytes = sum(sizes[i] for i in layout[-1])
        copy_back += wait_share * compute.finalize_for(t.late_bytes - last_bytes)
    step = compute.forward_us + end + copy_back + compute.other_us
    return StepPrediction(step, t.exposed_us, t.comm_us, len(layout))
