"""One rank of a torchft replica group training through fused_reducer.torchft, for
tests/test_fault_tolerance.py and tests/test_ft_groups.py: run as a process by the test, which
starts the Lighthouse. A replica group of one rank by default; with `group_size` > 1 and `rank`,
one rank of a group whose ranks are processes too (their own gloo group, as torchrun starts
them; rank 0 holds the group's TCPStore and writes its port to <out>/replica<R>.store).

    python tests/ft_worker.py CONFIG_JSON

Every replica trains the same model (seeded alike) on batch(step, replica, rank=rank) and
writes JSON lines to <out>/<member>.log (member_name below): one per step after should_commit
(committed or not, participants, what the buckets did, the heals this process received and from
which group rank, the time), then the final parameters to <out>/<member>.pt.
tests/ft_common.py starts replicas and replays the committed steps in float64 from these logs
(for the tests and scripts/ft_stress.py). `kill_step` with `kill_in`: the replica kills itself
(SIGKILL, its own pid) in that step's "forward", its "backward" once `kill_after_buckets` buckets
went out, "after_backward" (before should_commit) or in the optimizer "step" (after should_commit).
`go`: wait for that file once the Manager is up (replicas started together); `hold`: wait for
that file before the Manager exists (a restart let go later).
"""
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch import nn

IN = 48
HIDDEN = 96
OUT = 8
BATCH = 64
LR = 0.05
MOMENTUM = 0.9


class Net(nn.Module):
    """Layers registered in another order than forward uses them: the gradient-ready order then
    differs from reverse registration order, so the layout rebuilt after the first step differs
    from the initial one (what a healing replica must be given)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Linear(HIDDEN, HIDDEN)
        self.a = nn.Linear(IN, HIDDEN)
        self.d = nn.Linear(HIDDEN, OUT)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return Net().to(dtype)


def member_name(replica, rank=None):
    """The file stem of a replica group's rank: replica<R> for a group of one rank (rank None),
    else replica<R>_rank<K>."""
    return f"replica{replica}" if rank is None else f"replica{replica}_rank{rank}"


def batch(step, replica, dtype=torch.float32, rank=0):
    """The batch of rank `rank` of replica group `replica` at `step`."""
    g = torch.Generator().manual_seed(1000 * step + replica + 100 * rank)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def limits_at(step, cfg=None):
    """The bucket limits this replica sets before the forward of `step`: by default every
    replica changes its cap at step 2 (so a replica healing later must receive it); cfg's
    "limits" ({step: {name: value}}, this replica's own) replaces that."""
    if cfg is not None and "limits" in cfg:
        return cfg["limits"].get(str(step))
    if step == 2:
        return {"bucket_cap_bytes": 15_000}
    return None


def group_store(out_dir, replica, rank):
    """The replica group's TCPStore (its Manager's, and its process group's): rank 0 holds it
    and writes its port to <out>/replica<R>.store (removed by the test before a restart)."""
    path = os.path.join(out_dir, f"replica{replica}.store")
    if rank == 0:
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)
        return store
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica} rank {rank}: no store port from rank 0")
        time.sleep(0.02)
    port = int(open(path).read())
    return torch.distributed.TCPStore("127.0.0.1", port, is_master=False,
                                      wait_for_workers=False)


def main():
    cfg = json.loads(sys.argv[1])
    replica = cfg["replica"]
    group_size = cfg.get("group_size", 1)
    rank = cfg.get("rank", 0)
    member = member_name(replica, cfg.get("rank"))
    out_dir = cfg["out"]
    log_path = os.path.join(out_dir, f"{member}.log")

    import torchft
    from torchft import Manager, ProcessGroupGloo
    import fused_reducer.torchft as ft
    from fused_reducer import NonFiniteGradientError

    if cfg.get("hold"):
        # Started, imports done, held before its Manager exists: a Manager that heartbeats
        # without asking for a quorum would hold the Lighthouse's quorums back (it wants more
        # than half of the heartbeating replicas), which no restarted replica does.
        while not os.path.exists(cfg["hold"]):
            time.sleep(0.01)
    timeout = timedelta(seconds=cfg.get("timeout_s", 10))
    store = group_store(out_dir, replica, rank)
    if group_size > 1:  # the replica group's own process group, as torchrun would make it
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.PrefixStore("group", store), rank=rank,
            world_size=group_size, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=None, state_dict=None,
        replica_id=f"replica_{replica}", lighthouse_addr=cfg["lighthouse"],
        store_addr="127.0.0.1", store_port=store.port, rank=rank, world_size=group_size,
        use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10), init_sync=False)

    fused = cfg.get("reducer", "fused_reducer") == "fused_reducer"
    heals = []
    if fused:
        model = ft.DistributedDataParallel(
            manager, make_model(), first_bucket_mb=0.004, bucket_cap_mb=0.04,
            group_reduction=cfg.get("group_reduction", ft.DEFAULT_GROUP_REDUCTION),
            replica_id=f"replica_{replica}", **cfg.get("health", {}))
        inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        load, save = ft.state_dict_fns(model, inner)

        def counted_load(state):  # how many times this replica healed, from which group rank
            heals.append(state["sender_rank"])
            load(state)

        def labelled_save():
            return dict(save(), sender_rank=rank)

        manager.register_state_dict_fn("fused_reducer", counted_load, labelled_save)
    else:  # torchft's own DDP, for comparison (bench/, the report)
        model = torchft.DistributedDataParallel(manager, make_model())
        inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        def load(state):
            model.module.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])

        manager.register_state_dict_fn("ddp", load, lambda: {
            "model": model.module.state_dict(), "optimizer": inner.state_dict()})
    optimizer = ft.Optimizer(manager, inner)

    # What each bucket did this step: when it went to the Manager, when its reduction
    # completed, and when backward computed each gradient meanwhile.
    events = []

    def timed(launch):
        """`launch` (what returns a bucket's future), recording the launch and the completion."""
        def timed_launch(*args):
            index = sum(1 for e in events if e[0] == "launch")
            events.append(("launch", time.perf_counter(), index))
            fut = launch(*args)
            fut.add_done_callback(lambda _: events.append(("done", time.perf_counter(), index)))
            return fut
        return timed_launch

    for p in model.module.parameters():
        p.register_hook(lambda g: events.append(("ready", time.perf_counter(), None)))
    # The hooks look these up at each call. A group's bucket goes to its worker thread at
    # launch, and is done when its whole chain (inside, across, inside) is.
    if fused and model.group_reduction is not None:
        model.group_reduction.launch = timed(model.group_reduction.launch)
    else:
        ft._managed_future = timed(ft._managed_future)

    deadline = time.monotonic() + cfg.get("max_s", 120)
    if cfg.get("go"):
        # Start together: a replica whose first quorum request comes before the other's Manager
        # heartbeats forms a quorum of one and trains alone until the next quorum.
        open(os.path.join(out_dir, f"ready_{member}"), "w").close()
        while not os.path.exists(cfg["go"]):
            if time.monotonic() > deadline:
                raise SystemExit(f"replica {replica}: no go within max_s")
            time.sleep(0.01)
    kill_step = cfg.get("kill_step")
    healed_at = None
    together, together_quorum = 0, None
    nan_injected = False
    while True:
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica}: gave up at step {manager.current_step()}")
        optimizer.zero_grad()  # the quorum (and a heal) happens here
        step = manager.current_step()
        if healed_at is None and cfg.get("restarted"):
            healed_at = step
        limits = limits_at(step, cfg)
        if limits and fused:
            for name, value in limits.items():
                setattr(model, name, value)
        x, y = batch(step, replica, rank=rank)
        x.requires_grad_(True)
        compute_end = []
        x.register_hook(lambda g: compute_end.append(time.perf_counter()))
        events.clear()
        kill_in = cfg.get("kill_in") if step == kill_step else None

        def die(phase, contributed):
            """SIGKILL of this process (its own pid) at `phase` of the step; `contributed`: all
            its buckets were reduced (the others may commit the step with its gradients)."""
            launched = sum(1 for e in events if e[0] == "launch")
            with open(log_path, "a") as f:
                f.write(json.dumps({"killed": step, "replica": replica, "rank": rank,
                                    "group_size": group_size, "phase": phase,
                                    "launched": launched, "contributed": contributed,
                                    "time": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

        hooks = []
        if kill_in == "forward":
            hooks.append(model.module.b.register_forward_hook(lambda *_: die("forward", False)))
        if kill_in == "backward":
            after = cfg.get("kill_after_buckets", 1)

            def kill_when_launched(grad):
                if sum(1 for e in events if e[0] == "launch") >= after:
                    die("backward", False)
                return grad

            hooks.append(model.module.a.weight.register_hook(kill_when_launched))  # late
        if kill_in == "step":
            hooks.append(inner.register_step_pre_hook(lambda *_: die("step", True)))
        if cfg.get("nan_step") == step and not nan_injected:  # one NaN, in one parameter
            nan_injected = True  # once: the step is retried (not committed)
            hooks.append(model.module.get_parameter(cfg["nan_param"]).register_hook(
                lambda g: g.flatten().index_fill(0, torch.tensor([0]), float("nan")).view_as(g)))
        if cfg.get("sleep_ms"):  # a slow replica: late in every forward, after the quorum
            hooks.append(model.module.register_forward_pre_hook(
                lambda *_: time.sleep(cfg["sleep_ms"] / 1000)))
        nonfinite = None
        loss = loss_fn(model(x), y)
        try:
            loss.backward()
        except NonFiniteGradientError as e:  # every replica raises it, the step is skipped
            nonfinite = str(e)
        if kill_in == "after_backward":
            die("after_backward", True)
        participants = manager.num_participants()
        participating = manager.is_participating()
        errored = manager.errored() is not None
        committed = manager.should_commit()
        if committed:
            inner.step()
        for hook in hooks:
            hook.remove()
        end = compute_end[0] if compute_end else float("nan")
        launches = {i: t for k, t, i in events if k == "launch"}
        dones = {i: t for k, t, i in events if k == "done"}
        readies = [t for k, t, _ in events if k == "ready"]
        # Buckets during whose reduction backward went on computing gradients (none if the
        # hook waited for its bucket: backward runs on the thread that calls the hook).
        overlapped = sum(1 for i, t in launches.items()
                         if any(t < r < dones.get(i, float("inf")) for r in readies))
        record = {
            "replica": replica, "rank": rank, "group_size": group_size, "pid": os.getpid(),
            "step": step, "commit": committed,
            "participants": participants, "participating": participating, "errored": errored,
            "quorum_rank": manager.participating_rank(),
            "buckets": len(launches),
            "launched_before_end": sum(t < end for t in launches.values()),
            "done_before_end": sum(t < end for t in dones.values()),
            "overlapped": overlapped,
            "layout": model.bucket_parameter_names() if fused else None,
            "caps": model.bucket_caps_bytes if fused else None,
            "healed_at": healed_at,
            "heals": len(heals),
            "healed_from_ranks": heals,
            "quorum": manager._quorum_id,
            "time": time.time(),
            "nonfinite": nonfinite,
            "stragglers": model.straggler_report()["stragglers"] if fused else None,
        }
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        # Ends after `steps` and `together` commits in a row with `final_participants` in one
        # quorum (torchft 0.2.0's Lighthouse id, bumped when the membership changes): every
        # replica sees the same commits and quorums, a restarted one included, so all end after
        # the same step.
        quorum = manager._quorum_id
        if committed and participants >= cfg.get("final_participants", 1):
            together = together + 1 if quorum == together_quorum else 1
        else:
            together = 0
        together_quorum = quorum
        if manager.current_step() >= cfg["steps"] and together >= cfg.get("together", 3):
            break
        time.sleep(cfg.get("pause_s", 0.0))
    torch.save({n: p.detach().clone() for n, p in model.module.named_parameters()},
               os.path.join(out_dir, f"{member}.pt"))
    if fused:
        model.close()
    manager.shutdown(wait=False)
    store = None
    os._exit(0)  # torchft's threads (quorum, timeouts) are not joined at exit


if __name__ == "__main__":
    main()
