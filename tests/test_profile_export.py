"""What model.export_profile() records across ranks (docs/PLANNING.md "the profile"), on 2 gloo
ranks that differ on purpose (rank 1's forward is 20 ms slower, rank 0's backward 15 ms), each
field against a reference the test computes itself: the parameter sizes by hand from the model
(the DDP ignore list left out), every rank's own telemetry (step_history(), stats(), gathered
here) combined as the docs promise (phases: the slowest rank's medians; backward: per step the
slowest rank, median over steps; per-bucket waits: the mean over ranks of each rank's medians),
and the DP group the FusedReducer was given (a one-rank group per rank: its world size, its
rank 0 writes). One spawn for the file."""
import json
import os
import statistics
import tempfile

import pytest

from dist_utils import results, run_checks, train_squares

IGNORED = ["1.bias"]


def build(rank, group=None):
    import time
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import fused_reducer
    torch.manual_seed(0)  # layers of different sizes: a shifted name/size/bucket pairing shows
    net = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 32), nn.Linear(32, 128),
                        nn.Linear(128, 8))
    DDP._set_params_and_buffers_to_ignore_for_model(net, IGNORED)
    if rank == 1:
        net[0].register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    if rank == 0:  # in backward, between the first bucket's gradients and the second's
        net[1].weight.register_hook(lambda grad: time.sleep(0.015))
    return fused_reducer.FusedReducer(net, process_group=group, first_bucket_mb=0.01,
                                      bucket_cap_mb=0.05)


def train(model, steps, rank):
    train_squares(model, steps, rank, width=64)


def check_profile_export(rank, world_size):
    import torch.distributed as dist
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    model = build(rank)
    train(model, 6, rank)
    history, stats = model.step_history(), model.stats()
    folder = tempfile.mkdtemp(prefix="fr_profile_export_")
    path = model.export_profile(os.path.join(folder, "profile_{rank}.json"))
    with open(path) as f:
        profile = json.load(f)
    plain = model.export_profile(os.path.join(folder, "plain.json"))  # rank 0 of the group only
    reduced = [(name, p.numel() * p.element_size())
               for name, p in model.module.named_parameters() if name not in IGNORED]
    model.close()
    # The same model on a DP group of its own rank per rank (one-rank groups).
    groups = [dist.new_group([r]) for r in range(world_size)]
    alone = build(rank, groups[rank])
    train(alone, 3, rank)
    own = tempfile.mkdtemp(prefix="fr_profile_group_")
    alone_path = alone.export_profile(os.path.join(own, "profile.json"))
    alone_profile = None
    if alone_path is not None:  # (the test says which rank wrote none)
        with open(alone_path) as f:
            alone_profile = json.load(f)
    alone.close()
    return {"profile": profile, "history": history, "stats": stats, "reduced": reduced,
            "plain": plain, "path": path, "alone_path": alone_path, "own": own,
            "alone_profile": alone_profile}


@pytest.fixture(scope="module")
def outcomes():
    return run_checks([check_profile_export], world_size=2, timeout=120)


def median_over_steps(history, value):
    return statistics.median(value(s) for s in history)


def late(step):
    """Per bucket: unpacked after backward (its collective completed at or after its end)."""
    return [b["complete_us"] is not None and b["complete_us"] >= step["backward_end_us"]
            for b in step["buckets"]]


def test_profile_params_and_buckets_are_the_reduced_parameters_with_their_measured_sizes(
        outcomes):
    for r in results(outcomes, check_profile_export):
        p, last = r["profile"], r["history"][-1]
        # Hand-computed from the model: names and bytes of the reduced parameters only.
        assert sorted((q["name"], q["bytes"]) for q in p["params"]) == sorted(r["reduced"])
        # Each bucket of the profile: the parameters this rank's telemetry counted in it, and
        # their bytes, bucket by bucket in launch order.
        assert len(p["buckets"]) == len(last["buckets"]) == r["stats"]["buckets"] >= 2
        for bucket, measured, detail in zip(p["buckets"], last["buckets"],
                                            r["stats"]["buckets_detail"]):
            assert len(bucket) == measured["params"] == detail["params"]
            assert sum(p["params"][i]["bytes"] for i in bucket) == measured["bytes"]
        assert sorted(i for b in p["buckets"] for i in b) == list(range(len(r["reduced"])))
        # The gradient-ready order: the last layer's first (each layer's parameters adjacent).
        layers = [p["params"][i]["name"].split(".")[0] for i in p["ready_order"]]
        assert [k for k, _ in zip(layers, layers[1:]) if _ != k] == ["3", "2", "1"], layers
        assert p["limits"]["first_bucket_bytes"] == last["first_bucket_bytes"]
        assert p["limits"]["bucket_cap_bytes"] == last["bucket_cap_bytes"]
        assert p["steps_recorded"] == len(r["history"])


def test_profile_phases_are_the_slowest_ranks_medians_on_every_rank(outcomes):
    ranks = results(outcomes, check_profile_export)
    histories = [r["history"] for r in ranks]
    forward = [median_over_steps(h, lambda s: -s["forward_us"]) for h in histories]
    assert forward[1] > forward[0] + 10e3, forward  # rank 1's sleep: the ranks do differ
    waits = [median_over_steps(h, lambda s: s["exposed_wait_us"]) for h in histories]
    late_bytes = [median_over_steps(h, lambda s: sum(b["bytes"] for b, x in
                                                     zip(s["buckets"], late(s)) if x))
                  for h in histories]
    per_step = [{s["step"]: s["backward_end_us"] for s in h} for h in histories]
    assert per_step[0].keys() == per_step[1].keys()
    for r in ranks:
        t = r["profile"]["timing"]
        assert t["forward_us"] == pytest.approx(max(forward), rel=1e-9)
        assert t["exposed_wait_us"] == pytest.approx(max(waits), rel=1e-9)
        assert t["late_bytes"] == pytest.approx(max(late_bytes), rel=1e-9)
        assert t["late_bytes"] >= r["history"][-1]["buckets"][-1]["bytes"]  # the last is late
        assert t["backward_end_us"] == pytest.approx(statistics.median(
            max(ps[k] for ps in per_step) for k in per_step[0]), rel=1e-9)


def test_profile_bucket_waits_are_the_mean_over_ranks_of_each_ranks_median(outcomes):
    ranks = results(outcomes, check_profile_export)
    medians = []
    for r in ranks:
        history = r["history"]
        sizes = [b["bytes"] for b in history[-1]["buckets"]]
        same = [s for s in history if [b["bytes"] for b in s["buckets"]] == sizes]
        medians.append([statistics.median((s["buckets"][k]["wait_us"] or 0.0) if late(s)[k]
                                          else 0.0 for s in same) for k in range(len(sizes))])
    mean = [sum(m[k] for m in medians) / len(medians) for k in range(len(medians[0]))]
    assert any(m[-1] != medians[0][-1] for m in medians), medians  # the ranks waited differently
    assert mean[-1] > 0, medians
    for r in ranks:
        assert r["profile"]["timing"]["bucket_waits_us"] == pytest.approx(mean, rel=1e-9,
                                                                           abs=1e-9)


def test_profile_records_the_dp_groups_world_size_and_its_rank_0_writes(outcomes):
    ranks = results(outcomes, check_profile_export)
    for rank, r in enumerate(ranks):
        p = r["profile"]
        assert p["world_size"] == 2 and p["ranks_per_node"] == 2
        assert r["path"].endswith(f"profile_{rank}.json")
        # A path without {rank}: rank 0 writes it, the other rank returns None.
        assert (r["plain"] is not None) == (rank == 0)
        # On a one-rank DP group every rank is that group's rank 0: it writes, and its profile
        # is of a world of 1 (no other rank's phases in it: its own forward, not rank 1's).
        assert r["alone_path"] == os.path.join(r["own"], "profile.json")
        alone = r["alone_profile"]
        assert alone["world_size"] == 1
        assert (alone["timing"]["forward_us"] > 10e3) == (rank == 1), alone["timing"]
    assert ranks[0]["plain"] is not None and os.path.exists(ranks[0]["plain"])
