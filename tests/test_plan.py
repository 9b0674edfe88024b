"""The what-if planner (python -m fused_reducer.plan), its cost model and the profile it reads.

* Cost model: ring and tree all-reduce costs against hand-computed figures (one node, several
  nodes, the inter-node bottleneck, the algorithm NCCL would pick), the backward timeline, a
  calibration that reproduces its own measurements and recovers a known launch/hop split.
* One model: the autotuner's CostModel is costmodel.CostModel, neither autotune.py nor plan.py
  holds cost logic of its own, and a plan runs through CostModel.simulate.
* Profile round trip (2 gloo ranks): export_profile writes a versioned profile that
  load_profile accepts and the planner plans from; autotune(planner_hint=...) measures the
  hinted layout right after the incumbent, and only those.
* CLI: text, --json schema, --plot PNG, --compute-scale; bad inputs exit 2, name the value and
  write nothing.
"""
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import pytest

from dist_utils import per_rank, run_checks, train_squares

MiB = 1 << 20


# -- cost model: hand-computed figures -----------------------------------------------------------

def network(intra_hop=2.0, intra_bw=1e5, inter_hop=10.0, inter_bw=5e4, per_node=8, launch=5.0):
    from fused_reducer.tuning.costmodel import Link, Network
    return Network(Link("intra", intra_hop, bytes_per_us=intra_bw),
                   Link("inter", inter_hop, bytes_per_us=inter_bw, per_node=per_node), launch)


def test_ring_on_one_node_is_2n_minus_2_hops_and_2n_minus_2_over_n_of_the_bytes():
    net = network()
    # 8 ranks, 1 node, 1 MB: 5 + 14 hops * 2 us + 2*7/8 * 1e6 B / 1e5 B/us = 50.5 us
    assert net.ring_us(1e6, 8, 8) == pytest.approx(50.5)
    # tree on one node: 5 + 2 * (7 * 2) + 2 * 1e6 / 1e5 = 53 us: the ring is taken
    assert net.tree_us(1e6, 8, 8) == pytest.approx(53.0)
    assert net.allreduce(1e6, 8, 8) == (pytest.approx(50.5), "ring")


def test_across_nodes_ring_pays_inter_hops_and_tree_log2_nodes_latency_terms():
    net = network()
    # 16 ranks on 2 nodes: 30 steps, 2 of them between nodes; bus = min(1e5, 8 * 5e4) = 1e5
    ring = 5 + 28 * 2 + 2 * 10 + 2 * 15 / 16 * 1e6 / 1e5
    tree = 5 + 2 * (7 * 2 + 1 * 10) + 2 * 1e6 / 1e5
    assert net.ring_us(1e6, 16, 8) == pytest.approx(ring)  # 99.75
    assert net.tree_us(1e6, 16, 8) == pytest.approx(tree)  # 73
    assert net.allreduce(1e6, 16, 8) == (pytest.approx(73.0), "tree")
    # 512 ranks on 64 nodes, 4 KiB: ring 1022 steps (126 between nodes), tree 2*(7 + 6) terms
    assert net.ring_us(4096, 512, 8) == pytest.approx(
        5 + 896 * 2 + 126 * 10 + 2 * 511 / 512 * 4096 / 1e5)
    assert net.tree_us(4096, 512, 8) == pytest.approx(5 + 2 * (7 * 2 + 6 * 10) + 2 * 4096 / 1e5)


@pytest.mark.parametrize("nodes", [3, 5, 6, 7])
def test_tree_latency_for_a_node_count_not_a_power_of_two_is_floor_log2_inter_hops(nodes):
    """docs/PLANNING.md and costmodel.py: tree = launch + 2 x ((G-1) intra hops
    + floor(log2 N) inter hops) + 2 x S / busbw. Slip: ceil or round of log2 N."""
    from fused_reducer.tuning.costmodel import Link, Network
    per_node, launch, intra_hop, inter_hop = 8, 5.0, 2.0, 10.0
    net = Network(Link("intra", intra_hop, bytes_per_us=1e5),
                  Link("inter", inter_hop, bytes_per_us=5e4, per_node=per_node), launch)
    floor_log2 = {3: 1, 5: 2, 6: 2, 7: 2}[nodes]  # by hand
    bus = min(1e5, per_node * 5e4)
    expected = launch + 2 * ((per_node - 1) * intra_hop + floor_log2 * inter_hop) + 2 * 4096 / bus
    world = nodes * per_node
    assert net.tree_us(4096, world, per_node) == pytest.approx(expected)
    # at 4 KiB the tree wins over the ring (2(n-1) hops), so the all-reduce costs this too
    assert net.allreduce(4096, world, per_node) == (pytest.approx(expected), "tree")


def test_the_slower_of_intra_link_and_node_network_limits_the_bus_bandwidth():
    net = network(inter_bw=1e4, per_node=2)  # 2 NICs of 1e4 B/us: 2e4 < 1e5
    assert net.bus_bytes_per_us(1e6, 16, 8) == pytest.approx(2e4)
    assert net.bus_bytes_per_us(1e6, 8, 8) == pytest.approx(1e5)  # one node: no network
    one_gpu_per_node = network(per_node=1)
    assert one_gpu_per_node.tree_us(0, 64, 1) == pytest.approx(5 + 2 * 6 * 10)


def test_topology_is_checked():
    from fused_reducer.tuning.costmodel import check_topology
    with pytest.raises(ValueError, match="got 1"):
        check_topology(1, 1)
    with pytest.raises(ValueError, match="3 GPUs per node do not divide world size 8"):
        check_topology(8, 3)


def test_timeline_launches_in_order_one_collective_at_a_time():
    from fused_reducer.tuning.costmodel import CostModel
    cost = CostModel(lambda n: 10 + n / 100, copy_bytes_per_us=1e9)  # copies ~free
    sizes = [1000, 1000, 2000]
    ready = [5.0, 50.0, 20.0]
    # bucket (0, 2) ready at 20, takes 10 + 30 = 40 -> [20, 60]; bucket (1,) ready at 50, starts
    # when the transport is free at 60, takes 20 -> 80; backward ends at 70.
    t = cost.simulate(((0, 2), (1,)), sizes, ready, 70.0)
    assert t.free_us == pytest.approx(80.0, abs=1e-3)
    assert t.exposed_us == pytest.approx(10.0, abs=1e-3)
    assert t.overlapped_us == pytest.approx(40 + 10, abs=1e-3)
    assert t.contended_us == pytest.approx(70 + 50 + 10, abs=1e-3)
    assert t.comm_us == pytest.approx(60.0)
    assert t.late_bytes == 1000  # only bucket (1,) is still reducing when backward ends
    # an overlap cost between free (0) and contended (1) charges that share of the overlap
    assert (t.end_us(0.0), t.end_us(1.0)) == (t.free_us, t.contended_us)
    assert t.end_us(0.5) == pytest.approx(80 + 0.5 * 50)
    assert cost.predict_us(((0, 2), (1,)), sizes, ready, 70.0) == (t.free_us, t.contended_us)


def test_a_transport_without_progress_during_backward_runs_everything_after_it():
    """CostModel's progress: the transport's speed while backward computes, as a share of its
    speed after. The timeline of test_timeline_launches_in_order_one_collective_at_a_time at
    progress 0 (CPU ranks whose transport threads get no core until backward ends) and 0.5."""
    from fused_reducer.tuning.costmodel import CostModel
    sizes, ready = [1000, 1000, 2000], [5.0, 50.0, 20.0]
    stalled = CostModel(lambda n: 10 + n / 100, 1e9, progress=0.0).simulate(
        ((0, 2), (1,)), sizes, ready, 70.0)
    # both collectives (40 and 20 us) run after backward ends at 70: nothing overlapped
    assert stalled.free_us == pytest.approx(70 + 40 + 20)
    assert stalled.overlapped_us == 0.0 and stalled.late_bytes == 4000
    half = CostModel(lambda n: 10 + n / 100, 1e9, progress=0.5).simulate(
        ((0, 2), (1,)), sizes, ready, 70.0)
    # bucket (0, 2) from 20: 50 us of wall at half speed = 25 us of its 40 by 70; 15 left -> 85;
    # bucket (1,) 85 -> 105
    assert half.free_us == pytest.approx(105.0)
    assert half.overlapped_us == pytest.approx(25.0) and half.late_bytes == 4000
    with pytest.raises(ValueError, match="progress"):
        CostModel(lambda n: 1.0, 1e9, progress=1.5)
    # a free collective (a calibration whose fixed costs fit to 0, a tiny bucket) at no progress
    assert CostModel(lambda n: 0.0, 1e9, progress=0.0).simulate(
        ((0,),), [16], [5.0], 70.0).free_us == pytest.approx(70.0)


def test_progress_and_copy_back_are_measured_from_the_recorded_step():
    """A profile with timing.late_bytes (the bytes unpacked after backward, measured): the
    planner finds the progress at which the recorded layout's simulated communication after
    backward equals the measured waits, and scales the copy back by the measured late bytes."""
    from fused_reducer.tuning.plan import Planner

    # a slow link, calibrated on the host the profile was recorded on ("test")
    net = network(intra_bw=2e3)
    here = {2: {"hostname": "test"}}
    profile = synthetic_profile(device="cpu", world=2)
    free_exposed = Planner(profile, net, overlap="contended", calibration_metas=here)
    assert free_exposed.progress == 1.0  # no late_bytes: an older profile keeps full speed
    layout = free_exposed.layout(free_exposed.incumbent)
    for waits_us, expected in ((1e9, 0.0), (0.0, 1.0)):
        p = json.loads(json.dumps(profile))
        p["timing"].update(exposed_wait_us=waits_us, late_bytes=sum(
            q["bytes"] for q in p["params"]))
        assert Planner(p, net, overlap="contended", calibration_metas=here).progress == expected
        # progress is the recorded host's: predicting another link (no calibration of that
        # host) keeps full speed
        assert Planner(p, net, overlap="contended").progress == 1.0
    # in between: the fitted progress reproduces the measured waits
    from fused_reducer.tuning.costmodel import CostModel
    recorded = net.collective(2, 2)
    compute = Planner(profile, net, overlap="free").compute

    def exposed(progress):
        return CostModel(recorded, compute.copy_bytes_per_us, progress).simulate(
            layout, free_exposed.gradients.sizes, compute.ready_us,
            compute.backward_end_us).exposed_us
    assert exposed(0.0) > exposed(1.0)
    target = (exposed(0.0) + exposed(1.0)) / 2
    p = json.loads(json.dumps(profile))
    p["timing"].update(exposed_wait_us=target, late_bytes=8 * MiB)
    planner = Planner(p, net, overlap="contended", calibration_metas=here)
    assert 0.0 < planner.progress < 1.0
    assert exposed(planner.progress) == pytest.approx(target, rel=1e-6)
    assert any(i["input"] == "transport progress during backward" and i["source"] == "measured"
               for i in planner.inputs)
    assert planner.compute.finalize_bytes == 8 * MiB  # measured, not simulated
    # --overlap free: the transport runs beside backward, whatever the recorded waits
    assert Planner(p, net, overlap="free", calibration_metas=here).progress == 1.0


def test_buckets_after_the_first_late_one_wait_for_the_ranks_copy_backs():
    """Planner.wait_share: from the recorded step's buckets copied back after backward, how much
    longer each after the first waited than its collective, per unit of the copy back before
    it; predict_step charges that share of every late bucket's copy back but the last."""
    from fused_reducer.tuning.costmodel import StepCompute, predict_step
    from fused_reducer.tuning.plan import Planner

    net = network(intra_bw=2e3)
    here = {2: {"hostname": "test"}}
    profile = synthetic_profile(device="cpu", world=2)
    planner = Planner(profile, net, overlap="contended", calibration_metas=here)
    layout = planner.layout(planner.incumbent)
    sizes = planner.gradients.sizes
    collective = net.collective(2, 2)
    n = len(layout)
    assert n >= 3
    # every bucket late; each after the first waits its collective + 0.25 x the copy back before
    copy_backs = [1000.0 * (k + 1) for k in range(n - 1)] + [None]
    waits = [5000.0] + [collective(sum(sizes[i] for i in layout[k])) + 0.25 * copy_backs[k - 1]
                        for k in range(1, n)]
    p = json.loads(json.dumps(profile))
    p["timing"].update(bucket_waits_us=waits, bucket_copy_backs_us=copy_backs)
    measured = Planner(p, net, overlap="contended", calibration_metas=here)
    assert measured.wait_share == pytest.approx(0.25)
    assert any(i["input"] == "wait for the ranks' copy backs" for i in measured.inputs)
    assert Planner(p, net, overlap="contended").wait_share == 0.0  # another link: not measured
    # at most the whole copy back: more is skew the step had anyway
    skewed = json.loads(json.dumps(p))
    skewed["timing"]["bucket_waits_us"] = [w + 1e6 for w in waits]
    assert Planner(skewed, net, overlap="contended", calibration_metas=here).wait_share == 1.0
    assert planner.wait_share == 0.0  # an older profile without per-bucket timing
    # predict_step: two late buckets of 1000 and 3000 bytes, copy back 1 us per byte recorded
    compute = StepCompute(100.0, [5.0, 50.0, 20.0], 70.0, 4000.0, 3.0, 1e9, finalize_bytes=4000)
    slow = lambda n: 1e6  # noqa: E731 - every bucket ends after backward
    base = predict_step(compute, ((1,), (0, 2)), [1000, 1000, 2000], slow).step_us
    shared = predict_step(compute, ((1,), (0, 2)), [1000, 1000, 2000], slow,
                          wait_share=0.5).step_us
    assert shared - base == pytest.approx(0.5 * 1000)  # half of the first bucket's copy back
    one = ((0, 1, 2),)
    assert predict_step(compute, one, [1000, 1000, 2000], slow, wait_share=0.5).step_us == \
        pytest.approx(predict_step(compute, one, [1000, 1000, 2000], slow).step_us)


def test_step_adds_forward_copy_back_and_rest():
    from fused_reducer.tuning.costmodel import StepCompute, predict_step
    compute = StepCompute(100.0, [5.0, 50.0, 20.0], 70.0, 7.0, 3.0, 1e9)
    free = predict_step(compute, ((0, 2), (1,)), [1000, 1000, 2000], lambda n: 10 + n / 100)
    assert free.step_us == pytest.approx(100 + 80 + 7 + 3, abs=1e-3)
    assert free.buckets == 2
    half = predict_step(compute.scaled(0.5), ((0, 2), (1,)), [1000, 1000, 2000],
                        lambda n: 10 + n / 100)
    assert half.step_us < free.step_us
    # the copy back scales with the late buckets' bytes when the recorded ones are known:
    # bucket (1,) (1000 bytes) ends after backward; the recorded 7 us copied back 500 bytes
    late = StepCompute(100.0, [5.0, 50.0, 20.0], 70.0, 7.0, 3.0, 1e9, finalize_bytes=500)
    assert predict_step(late, ((0, 2), (1,)), [1000, 1000, 2000],
                        lambda n: 10 + n / 100).step_us == pytest.approx(100 + 80 + 14 + 3)
    with pytest.raises(ValueError, match="'sideways'"):
        predict_step(compute, ((0,),), [1, 1, 1], lambda n: 1.0, overlap="sideways")


def test_sharded_mode_is_a_ring_pass_in_backward_plus_an_exposed_all_gather():
    """ShardedOptimizer: reduce-scatter and all-gather are each half of the ring all-reduce
    (world - 1 steps of 1/world); the all-gather runs after the step, exposed."""
    from fused_reducer.tuning.costmodel import StepCompute, predict_sharded_step
    net = network()
    # 8 ranks, 1 node, 1 MB: 5 + 7 hops * 2 us + 7/8 * 1e6 / 1e5 = 27.75 us
    assert net.ring_pass_us(1e6, 8, 8) == pytest.approx(27.75)
    assert net.ring_pass_us(1e6, 8, 8) < net.ring_us(1e6, 8, 8) / 2 + 5
    assert net.ring_pass(16, 8)(1e6) == pytest.approx(5 + 14 * 2 + 1 * 10 + 15 / 16 * 1e6 / 1e5)
    compute = StepCompute(100.0, [5.0, 50.0, 20.0], 70.0, 7.0, 3.0, 1e9)
    # the reduce-scatters end at 80 as in test_step_adds_forward_copy_back_and_rest's timeline;
    # no copy back; the all-gathers (40 + 20 us) follow the step
    p = predict_sharded_step(compute, ((0, 2), (1,)), [1000, 1000, 2000], lambda n: 10 + n / 100)
    assert p.step_us == pytest.approx(100 + 80 + 3 + 60, abs=1e-3)
    assert p.exposed_us == pytest.approx(10 + 60, abs=1e-3)
    assert p.comm_us == pytest.approx(60 + 60)


def test_calibration_reproduces_its_measurements_and_fits_launch_and_hop_across_worlds():
    from fused_reducer.tuning.costmodel import calibrated_network
    launch, hop, bw = 20.0, 30.0, 1000.0

    def measured(n, s):
        return launch + 2 * (n - 1) * hop + 2 * (n - 1) / n * s / bw

    sizes = [4096, 65536, 1 << 20, 16 << 20]
    net, notes = calibrated_network({n: [(s, measured(n, s)) for s in sizes] for n in (2, 3)})
    assert net.launch_us == pytest.approx(launch, rel=1e-6)
    assert net.intra.hop_us == pytest.approx(hop, rel=1e-6)
    assert "fitted" in notes[0]
    for s in sizes + [300000]:
        for n in (2, 3, 4):  # 4 was not measured: launch + hops + bandwidth extrapolate
            assert net.allreduce(s, n, n)[0] == pytest.approx(measured(n, s), rel=1e-6)
    # One world size, noisy bandwidth: still exact at the measured points.
    points = [(4096, 300.0), (1 << 20, 2500.0), (8 << 20, 17000.0)]
    one, notes = calibrated_network({2: points})
    assert "assumed" in notes[0]
    for s, t in points:
        assert one.allreduce(s, 2, 2)[0] == pytest.approx(t, rel=1e-9)
    between = [one.allreduce(s, 2, 2)[0] for s in (1 << 21, 1 << 22, 1 << 23)]
    assert 2500 < between[0] < between[1] < between[2] == pytest.approx(17000)


# -- one model ------------------------------------------------------------------------------------

def test_planner_and_autotuner_share_one_cost_model(monkeypatch, tmp_path):
    from fused_reducer.tuning import autotune, costmodel, plan
    assert autotune.CostModel is costmodel.CostModel
    assert autotune.candidate_grid is costmodel.candidate_grid
    for module in (autotune, plan):
        source = inspect.getsource(module)
        assert "class CostModel" not in source and "def simulate" not in source
        assert "def predict_us" not in source and "def ring_us" not in source
    calls = []
    original = costmodel.CostModel.simulate

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(costmodel.CostModel, "simulate", counting)
    path = write_profile(tmp_path / "p.json")
    assert plan.main([str(path), "--world", "8", "--network", "ib400"]) == 0
    assert calls


# -- a synthetic profile --------------------------------------------------------------------------

def synthetic_profile(n=24, device="cuda", world=8):
    """24 parameters of 4 MiB (a 96 MiB model), ready every 400 us in reverse order."""
    params = [{"name": f"p{i}", "bytes": 4 * MiB, "group": 0, "ready_us": 400.0 * (n - 1 - i)}
              for i in range(n)]
    return {
        "format": "fused_reducer.profile", "version": 1, "created": "2026-12-02T00:00:00+00:00",
        "world_size": world, "ranks_per_node": 8, "device": device, "transport": "nccl",
        "machine": {"hostname": "test"}, "software": {"torch": "x", "nccl": "y"},
        "limits": {"first_bucket_bytes": MiB, "bucket_cap_bytes": 25 * MiB,
                   "last_bucket_bytes": 0},
        "groups": ["torch.float32 cuda:0"], "params": params,
        "ready_order": list(range(n - 1, -1, -1)), "buckets": None, "steps_recorded": 10,
        "timing": {"forward_us": 3000.0, "backward_end_us": 400.0 * n, "finalize_us": 200.0,
                   "other_us": 1000.0, "step_us": 14000.0, "exposed_wait_us": 500.0,
                   "copy_GBps": 500.0},
        "probe": {"latency_us": 30.0, "bandwidth_GBps": 100.0},
    }


def write_profile(path, **changes):
    data = synthetic_profile()
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


# -- CLI ------------------------------------------------------------------------------------------

ROW_KEYS = {"first_bucket_bytes", "bucket_cap_bytes", "last_bucket_bytes", "buckets", "step_ms",
            "exposed_comm_ms", "comm_ms"}


def test_cli_json_schema_plot_and_text(tmp_path, capsys):
    from fused_reducer.tuning import plan
    profile = write_profile(tmp_path / "p.json")
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = plan.main([str(profile), "--world", "8,64,512", "--gpus-per-node", "8", "--network",
                      "ib400", "--json", str(out), "--plot", str(png)])
    assert code == 0
    text = capsys.readouterr().out
    assert "PREDICTIONS" in text and "DDP default (1M, 25M, off)" in text and "sharded (" in text
    assert "measured:" in text and "ASSUMED" in text and "not measured here" in text
    data = json.loads(out.read_text())
    assert data["format"] == "fused_reducer.plan" and data["version"] == 1
    assert {"profile", "network", "overlap", "compute_scale", "inputs", "worlds"} <= set(data)
    assert data["overlap"] == "free"  # a GPU profile
    assert {i["source"] for i in data["inputs"]} <= {"measured", "preset", "assumed"}
    assert data["network"]["inter"]["name"] == "ib400"
    assert data["network"]["inter"]["measured"] is False
    assert [e["world_size"] for e in data["worlds"]] == [8, 64, 512]
    for e in data["worlds"]:
        assert e["nodes"] * e["gpus_per_node"] == e["world_size"]
        for key in ("ddp_default", "profile_limits", "best"):
            assert ROW_KEYS <= set(e[key])
        assert e["ddp_default"]["first_bucket_bytes"] == MiB
        assert e["ddp_default"]["bucket_cap_bytes"] == 25 * MiB
        assert e["best"]["step_ms"] <= e["ddp_default"]["step_ms"]
        assert e["best"] == e["best_layouts"][0]
        sharded, mine = e["sharded_profile_limits"], e["profile_limits"]
        assert ROW_KEYS <= set(sharded) and sharded["buckets"] == mine["buckets"]
        # a reduce-scatter and an all-gather are the two halves of a ring all-reduce: never less
        # communication in all; on one node (ring everywhere) the same plus a launch per bucket
        assert sharded["comm_ms"] >= 0.99 * mine["comm_ms"]
        if e["nodes"] == 1:
            launches_ms = sharded["buckets"] * data["network"]["launch_us"] / 1e3
            assert sharded["comm_ms"] <= mine["comm_ms"] + launches_ms + 1e-6
        assert e["gain_vs_ddp_ms"] == pytest.approx(
            e["ddp_default"]["step_ms"] - e["best"]["step_ms"])
        assert all(ROW_KEYS <= set(r) for r in e["grid"])
    # more ranks: the same layout cannot get faster
    steps = [e["ddp_default"]["step_ms"] for e in data["worlds"]]
    assert steps == sorted(steps)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_profile_recorded_with_a_list_of_limits_is_predicted_with_that_list(tmp_path):
    """bucket_caps_bytes (DDP's bucket_cap_mb_list) through the planner: the profile's list is
    the "profile" row, laid out by the reducer's own assignment with every entry."""
    from fused_reducer.tuning import plan
    from fused_reducer.tuning.costmodel import Gradients
    caps = [4 * MiB, 12 * MiB, 24 * MiB]
    limits = {"first_bucket_bytes": caps[0], "bucket_cap_bytes": caps[-1],
              "last_bucket_bytes": 0, "bucket_caps_bytes": caps}
    profile = write_profile(tmp_path / "p.json", limits=limits)
    out = tmp_path / "plan.json"
    assert plan.main([str(profile), "--world", "8,64", "--network", "ib400",
                      "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    gradients = Gradients([4 * MiB] * 24, [0] * 24)
    layout = gradients.layout(list(range(23, -1, -1)), tuple(caps) + (0,))
    assert [len(b) for b in layout] == [1, 3, 6, 6, 6, 2]  # 4, 12, 24, 24, 24 MiB, rest
    for e in data["worlds"]:
        mine = e["profile_limits"]
        assert mine["bucket_caps_bytes"] == caps and mine["buckets"] == len(layout)
        assert mine["first_bucket_bytes"] == caps[0] and mine["bucket_cap_bytes"] == caps[-1]
    assert data["profile"]["limits"]["bucket_caps_bytes"] == caps


def test_compute_scale_and_overlap_change_the_prediction(tmp_path):
    from fused_reducer.tuning import plan
    profile = write_profile(tmp_path / "p.json")

    def run(*extra):
        out = tmp_path / "o.json"
        assert plan.main([str(profile), "--world", "64", "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())

    def step(data):
        return data["worlds"][0]["ddp_default"]["step_ms"]

    base = run()
    assert step(run("--compute-scale", "0.5")) < step(base)
    contended = run("--overlap", "contended")
    assert contended["overlap"] == "contended" and step(contended) != step(base)
    assert contended["overlap_cost"] == 1.0 and base["overlap_cost"] == 0.0
    half = run("--overlap", "0.5")
    assert half["overlap_cost"] == 0.5 and step(half) != step(contended)
    # the recorded backward is taken to include its own overlapped communication
    assert any(i["input"] == "backward without contention" for i in contended["inputs"])


def test_overlap_cost_is_measured_from_a_backward_without_communication():
    """A profile with timing.backward_no_comm_us: the overlap cost is the recorded backward's
    slowdown over the communication it overlapped, (recorded - without) / overlapped, within
    [0, 1]; it predicts exactly what the same number given as --overlap predicts."""
    from fused_reducer.tuning.costmodel import CostModel, ProbedCollective
    from fused_reducer.tuning.plan import Planner, PlanInputError

    net = network()
    profile = synthetic_profile(device="cpu", world=2)
    base = Planner(profile, net, overlap="free")
    layout = base.layout(base.incumbent)
    probe = profile["probe"]
    overlapped = CostModel(ProbedCollective(probe["latency_us"], probe["bandwidth_GBps"] * 1e3),
                           base.compute.copy_bytes_per_us).simulate(
        layout, base.gradients.sizes, base.compute.ready_us,
        base.compute.backward_end_us).overlapped_us
    assert overlapped > 0
    backward = profile["timing"]["backward_end_us"]

    def with_no_comm(us):
        p = json.loads(json.dumps(profile))
        p["timing"]["backward_no_comm_us"] = us
        return p

    measured = Planner(with_no_comm(backward - 0.3 * overlapped), net)
    assert measured.overlap == "measured"
    assert measured.overlap_cost == pytest.approx(0.3)
    assert any(i["input"] == "overlap cost" and i["source"] == "measured"
               for i in measured.inputs)
    given = Planner(profile, net, overlap=0.3)
    for candidate in [(MiB, 25 * MiB, 0), (256 * 1024, MiB, 0), (64 * MiB, 64 * MiB, 0)]:
        assert measured.predict(candidate, 2, 2).step_us == pytest.approx(
            given.predict(candidate, 2, 2).step_us)
    # clamped: a backward as fast with communication as without costs nothing; a slowdown
    # larger than all the overlapped communication costs all of it
    assert Planner(with_no_comm(backward * 1.1), net).overlap_cost == 0.0
    assert Planner(with_no_comm(backward - 2 * overlapped), net).overlap_cost == 1.0
    # without the measurement: auto falls back to contended on CPU; 'measured' is refused
    assert Planner(profile, net).overlap == "contended"
    assert Planner(profile, net).overlap_cost == 1.0
    with pytest.raises(PlanInputError, match="backward_no_comm_us"):
        Planner(profile, net, overlap="measured")


def test_predictions_are_anchored_on_the_measured_step_of_the_recorded_layout():
    """What the model misses in the recorded step (measured step - modelled step of the
    recorded layout) is added to every prediction, scaled as compute: a profile that measured
    a step 5 ms longer predicts every layout 5 ms (x compute scale) slower, in the same order."""
    from fused_reducer.tuning.plan import Planner

    net = network()
    profile = synthetic_profile(world=8)
    slower = json.loads(json.dumps(profile))
    slower["timing"]["step_us"] += 5000.0
    candidates = [(MiB, 25 * MiB, 0), (256 * 1024, MiB, 0), (64 * MiB, 64 * MiB, 0)]
    # the residual is found on the recorded run's own machine and link, then scaled as compute
    # (not the scaled compute against the unscaled recorded communication)
    slow_link = json.loads(json.dumps(profile))
    slow_link["probe"] = {"latency_us": 500.0, "bandwidth_GBps": 0.5}
    assert Planner(slow_link, net, compute_scale=0.01).residual_us == pytest.approx(
        0.01 * Planner(slow_link, net).residual_us)
    for scale in (1.0, 0.5):
        base, late = Planner(profile, net, compute_scale=scale), Planner(slower, net,
                                                                          compute_scale=scale)
        assert late.residual_us - base.residual_us == pytest.approx(5000.0 * scale)
        for world in (8, 64):
            a = [base.predict(c, world, 8).step_us for c in candidates]
            b = [late.predict(c, world, 8).step_us for c in candidates]
            assert [y - x for x, y in zip(a, b)] == pytest.approx([5000.0 * scale] * 3)
        assert any(i["input"] == "unmodelled time per step" and i["source"] == "measured"
                   for i in late.inputs)


def test_hinted_layouts_from_a_plan_pick_the_nearest_world(tmp_path):
    from fused_reducer.tuning import plan
    profile = write_profile(tmp_path / "p.json")
    out = tmp_path / "plan.json"
    assert plan.main([str(profile), "--world", "8,512", "--json", str(out), "--top", "2"]) == 0
    data = json.loads(out.read_text())
    expected = [(r["first_bucket_bytes"], r["bucket_cap_bytes"], r["last_bucket_bytes"])
                for r in data["worlds"][1]["best_layouts"]]
    assert plan.hinted_layouts(str(out), 256) == expected
    assert plan.hinted_layouts(data, 512) == expected
    assert plan.hinted_layouts([[MiB, 4 * MiB, 0]], 2) == [(MiB, 4 * MiB, 0)]
    with pytest.raises(ValueError, match="planner_hint layout"):
        plan.hinted_layouts([(0, MiB, 0)], 2)


def bad_profile_cases(tmp_path):
    missing = tmp_path / "nope.json"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    other = write_profile(tmp_path / "v2.json", version=2)
    alien = tmp_path / "alien.json"
    alien.write_text(json.dumps({"format": "something else"}))
    no_params = write_profile(tmp_path / "noparams.json", params="x")
    good = write_profile(tmp_path / "good.json")
    return [
        ([str(missing)], "nope.json"),
        ([str(broken)], "broken.json"),
        ([str(other)], "version 2"),
        ([str(alien)], "'something else'"),
        ([str(no_params)], "'params'"),
        ([str(good), "--network", "ib300"], "'ib300'"),
        ([str(good), "--world", "1"], "--world 1"),
        ([str(good), "--world", "8,x"], "'x'"),
        ([str(good), "--world", "24", "--gpus-per-node", "16"], "do not divide world size 24"),
        ([str(good), "--world", "8", "--gpus-per-node", "0"], "got 0"),
        ([str(good), "--compute-scale", "-1"], "-1"),
        ([str(good), "--calibrate", str(tmp_path / "bw.json")], "bw.json"),
        ([str(good), "--network", "ib400,roce200"], "ib400, roce200"),
        ([str(good), "--overlap", "measured"], "backward_no_comm_us"),
    ]


def test_bad_inputs_exit_2_naming_the_value_and_write_nothing(tmp_path, capsys):
    from fused_reducer.tuning import plan
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    for argv, named in bad_profile_cases(tmp_path):
        code = plan.main(argv + ["--json", str(out), "--plot", str(png)])
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert named in err, (argv, err)
        assert not out.exists() and not png.exists(), argv
        assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def _set(*path_and_value):
    """An edit of a profile dict: the value at a key path (a trailing None deletes the key)."""
    *path, key, value = path_and_value

    def edit(data):
        for k in path:
            data = data[k]
        if value is None:
            del data[key]
        else:
            data[key] = value
    return edit


@pytest.mark.parametrize("edit, named", [
    (_set("buckets", [[0, 1, 99]]), "'buckets[0][2]' is 99, not an index into params"),
    (_set("buckets", [list(range(23))]), "not a layout of every parameter (params[23] is in none)"),
    (_set("buckets", [[0, 1], [1]]), "'buckets[1][0]' is 1"),
    (_set("params", 0, "ready_us", "abc"), "'params[0].ready_us' is 'abc', not a finite number"),
    (_set("params", 0, "ready_us", -1.0), "'params[0].ready_us' is -1.0"),
    (_set("params", 0, "bytes", 1.5), "'params[0].bytes' is 1.5"),
    (_set("params", 0, "bytes", -1), "'params[0].bytes' is -1"),
    (_set("params", 0, "group", 5), "'params[0].group' is 5, not an index into groups"),
    (_set("params", 1, 7), "'params[1]' is 7, not an object"),
    (_set("params", []), "'params' is [], not a non-empty list"),
    (_set("groups", None), "'groups' is missing"),
    (_set("ready_order", [0] * 24), "a permutation of the 24 parameters"),
    (_set("ready_order", 3, True), "'ready_order[3]' is True"),
    (_set("limits", "first_bucket_bytes", 0), "'limits.first_bucket_bytes' is 0"),
    (_set("limits", "bucket_caps_bytes", [0, 25 * MiB]), "'limits.bucket_caps_bytes[0]' is 0"),
    (_set("limits", "last_bucket_bytes", -1), "'limits.last_bucket_bytes' is -1"),
    (_set("limits", "bucket_cap_bytes", None), "'limits.bucket_cap_bytes' is missing"),
    (_set("machine", "vm"), "'machine' is 'vm', not an object"),
    (_set("timing", "late_bytes", "x"), "'timing.late_bytes' is 'x'"),
    (_set("timing", "step_us", math.nan), "'timing.step_us' is nan, not a finite number"),
    (_set("timing", "step_us", None), "'timing.step_us' is missing"),
    (_set("timing", "forward_us", math.inf), "'timing.forward_us' is inf"),
    (_set("timing", "exposed_wait_us", -5), "'timing.exposed_wait_us' is -5"),
    (_set("timing", "copy_GBps", 0), "'timing.copy_GBps' is 0, not a finite number > 0"),
    (_set("timing", "bucket_waits_us", [1.0, None]), "'timing.bucket_waits_us[1]' is None"),
    (_set("timing", "backward_no_comm_us", "fast"), "'timing.backward_no_comm_us' is 'fast'"),
    (_set("probe", "bandwidth_GBps", -1), "'probe.bandwidth_GBps' is -1"),
    (_set("world_size", True), "'world_size' is True, not a positive int"),
    (_set("world_size", 0), "'world_size' is 0"),
    (_set("world_size", 10 ** 30), "'world_size' is 1000000000000000000000000000000"),
    (_set("device", 3), "'device' is 3"),
], ids=lambda v: None if callable(v) else v.split(" is")[0].strip("'"))
def test_a_malformed_profile_exits_2_naming_the_field_and_writes_nothing(edit, named, tmp_path,
                                                                         capsys):
    """Valid JSON of the right format and version, one field wrong: load_profile checks every
    field the planner reads (type, finite, range, indices), so the CLI answers plan: error:
    naming the file and the field, exit 2, and no traceback, no NaN plan."""
    from fused_reducer.tuning import plan
    data = synthetic_profile()
    data["buckets"] = [list(range(23, 11, -1)), list(range(11, -1, -1))]
    path, out = tmp_path / "p.json", tmp_path / "out.json"
    path.write_text(json.dumps(data))
    assert plan.main([str(path), "--world", "8", "--json", str(out)]) == 0  # valid as written
    out.unlink()
    capsys.readouterr()
    edit(data)
    path.write_text(json.dumps(data))
    assert plan.main([str(path), "--world", "8", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plan: error: profile {str(path)!r} is malformed: "), err
    assert named in err, err
    assert "Traceback" not in err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_python_dash_m_runs_and_exits_2_on_bad_input(tmp_path):
    profile = write_profile(tmp_path / "p.json")
    run = lambda *a: subprocess.run([sys.executable, "-m", "fused_reducer.plan", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    bad = run(str(profile), "--network", "nope")
    assert bad.returncode == 2 and "'nope'" in bad.stderr
    good = run(str(profile), "--world", "8,64", "--network", "ib400")
    assert good.returncode == 0, good.stderr
    assert "best" in good.stdout


# -- recorded profile, planner hint (2 gloo ranks) -------------------------------------------------

def make_model():
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])


def train(model, steps, rank):
    train_squares(model, steps, rank, width=128)


def check_profile_round_trip(rank, world_size):
    import fused_reducer
    model = fused_reducer.FusedReducer(make_model(), first_bucket_mb=0.0625, bucket_cap_mb=0.125)
    early = None
    try:
        model.export_profile(os.path.join(tempfile.gettempdir(), "never_{rank}.json"))
    except RuntimeError as e:
        early = str(e)
    train(model, 4, rank)
    folder = tempfile.mkdtemp(prefix="fr_profile_")
    path = model.export_profile(os.path.join(folder, "profile_{rank}.json"))
    with open(path) as f:
        data = json.load(f)
    # Every agreement export_profile makes is staged on the model's control device (the GPU
    # for an NCCL group, which has no CPU backend): a stand-in device is recorded, the sums
    # run on the CPU.
    import torch
    from fused_reducer.tuning import autotune
    from fused_reducer.transports import transport
    seen, real = set(), transport.control_allreduce

    def recording(values, op, group, device):
        seen.add(str(device))
        return real(values, op, group, "cpu")

    saved = model.attachment.control_device
    transport.control_allreduce = autotune.control_allreduce = recording
    model.attachment.control_device = torch.device("cuda", 5)
    try:
        model.export_profile(os.path.join(folder, "again_{rank}.json"))
    finally:
        transport.control_allreduce = autotune.control_allreduce = real
        model.attachment.control_device = saved
    return {"early": early, "profile": data, "path": path, "control_devices": sorted(seen),
            "backward_per_step": [(s["step"], s["backward_end_us"])
                                  for s in model.step_history()],
            "bytes": sum(p.numel() * p.element_size() for p in model.module.parameters()),
            "buckets": len(model.bucket_sizes())}


def check_profile_with_ignored_parameters(rank, world_size):
    """DDP's ignore list: the profile holds the reducer's parameters only, names and sizes
    paired as the reducer has them, and plans."""
    import fused_reducer
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch
    from torch import nn
    torch.manual_seed(0)  # layers of different sizes: a shifted name/size pairing shows
    net = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 32), nn.Linear(32, 128))
    ignored = ["0.weight", "0.bias"]
    DDP._set_params_and_buffers_to_ignore_for_model(net, ignored)
    model = fused_reducer.FusedReducer(net)
    train(model, 3, rank)
    folder = tempfile.mkdtemp(prefix="fr_ignored_")
    path = model.export_profile(os.path.join(folder, "profile_{rank}.json"))
    with open(path) as f:
        data = json.load(f)
    reduced = {name: p.numel() * p.element_size() for name, p in model.module.named_parameters()
               if name not in ignored}
    out = {"params": {q["name"]: q["bytes"] for q in data["params"]}, "reduced": reduced,
           "bucket_bytes": sum(model.bucket_sizes()), "path": path}
    model.close()
    return out


def check_planner_hint(rank, world_size):
    import fused_reducer
    model = fused_reducer.FusedReducer(make_model())
    hint = (16 * 1024, 64 * 1024, 0)  # many small buckets: not the incumbent's layout
    model.autotune(planner_hint=[hint], round_steps=(1,))
    for _ in range(12):
        train(model, 1, rank)
        if model.autotune_report()["done"]:
            break
    report = model.autotune_report()
    return {"trials": [(t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"])
                       for t in report["trials"]], "done": report["done"], "hint": list(hint)}


def check_verify(rank, world_size):
    """autotune(verify=True) on a plan made from this run's own profile, then on the same plan
    with its first prediction made 5 times too slow: predicted vs measured per layout."""
    import contextlib
    import io
    import torch.distributed as dist
    import fused_reducer
    from fused_reducer.tuning import plan
    box = [tempfile.mkdtemp(prefix="fr_verify_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    recorded = fused_reducer.FusedReducer(make_model())
    train(recorded, 4, rank)
    profile = recorded.export_profile(os.path.join(folder, "profile.json"))
    recorded.close()
    real, doctored = os.path.join(folder, "plan.json"), os.path.join(folder, "doctored.json")
    if rank == 0:
        assert plan.main([profile, "--world", "2", "--top", "2", "--json", real]) == 0
        with open(real) as f:
            data = json.load(f)
        data["worlds"][0]["best_layouts"][0]["step_ms"] *= 5
        with open(doctored, "w") as f:
            json.dump(data, f)
    dist.barrier()
    out = {}
    for name, path in (("real", real), ("doctored", doctored)):
        model = fused_reducer.FusedReducer(make_model())
        model.autotune(planner_hint=path, verify=True, round_steps=(2, 2))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            for _ in range(60):
                train(model, 1, rank)
                if model.autotune_report()["done"]:
                    break
        with open(path) as f:
            entry = json.load(f)["worlds"][0]
        out[name] = {"report": model.autotune_report(), "printed": printed.getvalue(),
                     "planned": [r["step_ms"] for r in entry["best_layouts"]]
                     + [entry["ddp_default"]["step_ms"]]}
        model.close()
    return out


@pytest.fixture(scope="module")
def outcomes():
    return run_checks([check_profile_round_trip, check_planner_hint, check_verify,
                       check_profile_with_ignored_parameters], world_size=2, timeout=300)


def test_profile_round_trip(outcomes, tmp_path):
    from fused_reducer.tuning import plan
    from fused_reducer.tuning.profile import load_profile
    results = per_rank(outcomes, "check_profile_round_trip")
    for r in results:
        assert "at least 2 completed" in r["early"]
        p = r["profile"]
        assert p["format"] == "fused_reducer.profile" and p["version"] == 1
        assert p["world_size"] == 2 and p["device"] == "cpu"
        assert sum(q["bytes"] for q in p["params"]) == r["bytes"]
        assert p["limits"] == {"first_bucket_bytes": MiB // 16, "bucket_cap_bytes": MiB // 8,
                               "last_bucket_bytes": 0, "bucket_caps_bytes": [MiB // 16, MiB // 8]}
        assert len(p["buckets"]) == r["buckets"]
        order = p["ready_order"]
        assert sorted(order) == list(range(len(p["params"])))
        ready = [p["params"][i]["ready_us"] for i in order]
        assert ready == sorted(ready) and ready[0] == pytest.approx(0.0, abs=1e-6)
        t = p["timing"]
        assert t["forward_us"] > 0 and t["backward_end_us"] >= ready[-1]
        assert p["probe"]["latency_us"] > 0 and p["probe"]["bandwidth_GBps"] > 0
        assert p["software"]["torch"] and "hostname" in p["machine"]
    assert [r["control_devices"] for r in results] == [["cuda:5"], ["cuda:5"]]
    # backward: per step the slower rank, median over the steps (both ranks' telemetry)
    steps = [dict(r["backward_per_step"]) for r in results]
    assert steps[0].keys() == steps[1].keys() and len(steps[0]) == 4
    assert results[0]["profile"]["timing"]["backward_end_us"] == pytest.approx(
        statistics.median(max(steps[0][k], steps[1][k]) for k in steps[0]))
    # the slowest rank's phases are shared; the probe too
    phases = [{k: v for k, v in r["profile"]["timing"].items() if k != "copy_GBps"}
              for r in results]
    assert phases[0] == phases[1]
    assert results[0]["profile"]["probe"] == results[1]["profile"]["probe"]
    loaded = load_profile(results[0]["path"])
    assert loaded == results[0]["profile"]
    out = tmp_path / "plan.json"
    assert plan.main([results[0]["path"], "--world", "2,16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["overlap"] == "contended"  # a CPU profile
    assert all(math.isfinite(e["best"]["step_ms"]) for e in data["worlds"])


def test_a_profile_with_ignored_parameters_holds_the_reduced_ones_and_plans(outcomes, tmp_path):
    from fused_reducer.tuning import plan
    for r in per_rank(outcomes, "check_profile_with_ignored_parameters"):
        assert r["params"] == r["reduced"], (r["params"], r["reduced"])
        assert sum(r["params"].values()) == r["bucket_bytes"]
        assert plan.main([r["path"], "--world", "2", "--json", str(tmp_path / "p.json")]) == 0


def test_autotune_measures_the_planner_hint_first_and_fewer_candidates(outcomes):
    for r in per_rank(outcomes, "check_planner_hint"):
        assert r["done"]
        incumbent = (MiB, 25 * MiB, 0)
        assert r["trials"] == [incumbent, tuple(r["hint"])]


def test_autotune_verify_measures_the_plans_layouts_and_flags_predictions_off_by_10_percent(
        outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_verify")):
        for name in ("real", "doctored"):
            report = r[name]["report"]
            assert report["done"], report
            verification = report["verification"]
            rows = verification["rows"]
            planned = r[name]["planned"]
            expected = [f"plan best {i + 1}" for i in range(len(planned) - 1)] + ["DDP default"]
            assert sorted(row["label"] for row in rows) == sorted(expected), rows
            assert sorted(row["predicted_ms"] for row in rows) == sorted(r[name]["planned"])
            trials = {(t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"]): t
                      for t in report["trials"]}
            for t in report["trials"]:  # interleaved, no halving: every layout every round
                assert len(t["samples_ms"]) == 2 + 2, t
            for row in rows:
                trial = trials[(row["first_bucket_bytes"], row["bucket_cap_bytes"],
                                row["last_bucket_bytes"])]
                assert row["measured_ms"] == trial["step_ms"] == statistics.median(
                    trial["samples_ms"])
                error = abs(row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
                assert row["wrong"] == (error > 0.10), row  # recomputed here
            assert verification["wrong"] == [row["label"] for row in rows if row["wrong"]]
            choice = report["choice"]
            measured = {k: t["step_ms"] for k, t in trials.items()}
            chosen = (choice["first_bucket_bytes"], choice["bucket_cap_bytes"],
                      choice["last_bucket_bytes"])
            assert chosen in measured
            incumbent = (MiB, 25 * MiB, 0)  # the model's limits: DDP's default
            assert report["trials"][0]["incumbent"] and chosen in (
                min(measured, key=measured.get), incumbent), (chosen, measured)
            if rank == 0:
                assert "autotune verify" in r[name]["printed"], r[name]["printed"]
                for row in rows:
                    assert row["label"] in r[name]["printed"]
            else:
                assert r[name]["printed"] == ""  # rank 0 prints
        assert "plan best 1" in r["doctored"]["report"]["verification"]["wrong"]
        if rank == 0:
            assert "WRONG" in r["doctored"]["printed"]


# -- drift: the recorded validation runs, predicted again --------------------------------------

REFERENCES = sorted(
    os.path.join(os.path.dirname(__file__), "data", "plan_reference", name)
    for name in os.listdir(os.path.join(os.path.dirname(__file__), "data", "plan_reference"))
    if name.endswith(".json"))


@pytest.mark.parametrize("path", REFERENCES, ids=os.path.basename)
def test_predictions_of_the_recorded_validation_runs_do_not_drift(path, tmp_path):
    """docs/PLANNING.md section 4's runs (profiles, calibration and measured cells, written by
    `bench/plan_validate.py compare --reference`), predicted again with today's model: every
    cell as recorded (a change to the cost model must re-validate and rewrite these files),
    and still within the published error of the measurements."""
    from fused_reducer.tuning.plan import Planner, build_network

    with open(path) as f:
        ref = json.load(f)
    calibration = []
    for i, data in enumerate(ref["calibration"]):
        calibration.append(str(tmp_path / f"bw_{i}.json"))
        with open(calibration[-1], "w") as f:
            json.dump(data, f)
    network, inputs, metas = build_network([], calibration)
    world = ref["world_size"]
    errors = {}
    for model, profile in ref["profiles"].items():
        planner = Planner(profile, network, list(inputs), "auto", 1.0, None, metas)
        for cell in (c for c in ref["cells"] if c["model"] == model):
            candidate = (int(cell["first_mb"] * MiB), int(cell["cap_mb"] * MiB), 0)
            predicted_ms = planner.predict(candidate, world, world).step_us / 1e3
            assert predicted_ms == pytest.approx(cell["predicted_ms"], rel=1e-6), (model, cell)
            if not cell["recorded"]:  # the profile's own layout is the anchor, not a prediction
                errors.setdefault(model, []).append(
                    abs(predicted_ms - cell["measured_ms"]) / cell["measured_ms"])
    limit = 0.10 if world == 2 else 0.15
    for model, errs in errors.items():
        assert statistics.median(errs) <= limit, (model, statistics.median(errs))
