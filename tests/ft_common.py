"""Replicas of tests/ft_worker.py as processes, their logs, and the float64 replay of their
committed steps: shared by tests/test_fault_tolerance.py, tests/test_ft_groups.py and
scripts/ft_stress.py.

A member is a replica group of one rank (its replica number, an int) or one rank of a group of
several ((replica, rank)); the functions below take either.

Bounded: every replica gives up after `max_s`; wait_all kills (by pid) only the processes it was
given that outlive their deadline.
"""
import json
import os
import signal
import subprocess
import sys
import time

import torch

import ft_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ft_worker.py")
WAIT_S = 150
TOLERANCE = 1e-5


def start_lighthouse(min_replicas=1):
    """A Lighthouse in this process; call .address() for the replicas, .shutdown() at the end."""
    from torchft._torchft import LighthouseServer
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=2000)


def member(key):
    """(replica, rank) of a member key; rank None for a replica group of one rank."""
    return key if isinstance(key, tuple) else (key, None)


def name(key):
    return ft_worker.member_name(*member(key))


def start(out, key, lighthouse, max_s=WAIT_S - 30, **cfg):
    """Member `key` as a process: tests/ft_worker.py with its config (see there), output
    to <out>/<name>.out (appended: a restarted replica writes after its first life)."""
    replica, rank = member(key)
    if rank is not None:
        cfg["rank"] = rank
    cfg = dict(replica=replica, out=str(out), lighthouse=lighthouse, max_s=max_s, **cfg)
    # The package the tests import (installed, or the checkout's python/ on PYTHONPATH), and
    # the tests' own helpers.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    log = open(os.path.join(out, f"{name(key)}.out"), "ab")
    return subprocess.Popen([sys.executable, WORKER, json.dumps(cfg)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def start_together(out, lighthouse, configs, ready_s=60):
    """Start the members of `configs` ({key: cfg}) and let them train once every Manager
    is up (heartbeating), so that the first quorum has them all."""
    go = os.path.join(out, "go")
    procs = {r: start(out, r, lighthouse, go=go, **cfg) for r, cfg in configs.items()}
    deadline = time.monotonic() + ready_s
    while not all(os.path.exists(os.path.join(out, f"ready_{name(r)}")) for r in configs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
            wait_all(procs, out, time.monotonic(), check=False)
            raise AssertionError(f"a replica did not get ready within {ready_s} s:\n" +
                                 output_tails(out, procs))
        time.sleep(0.05)
    open(go, "w").close()
    return procs


def wait_all(procs, out, deadline, check=True):
    """Exit codes of `procs` ({replica: Popen}), "hung" for any still running at `deadline`
    (killed, by pid). With `check`, raises AssertionError unless every code is 0."""
    codes = {}
    for replica, proc in procs.items():
        try:
            codes[replica] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            codes[replica] = "hung"
    if check and any(c != 0 for c in codes.values()):
        raise AssertionError(f"replicas ended with {codes}; output tails:\n" +
                             output_tails(out, procs))
    return codes


def output_tails(out, replicas, chars=3000):
    tails = {}
    for r in replicas:
        try:
            tails[r] = open(os.path.join(out, f"{name(r)}.out"), errors="replace").read()[-chars:]
        except FileNotFoundError:
            tails[r] = "(no output)"
    return "\n".join(f"--- replica {r}\n{t}" for r, t in tails.items())


def records(out, key):
    path = os.path.join(out, f"{name(key)}.log")
    return [json.loads(line) for line in open(path)]


def records_or_none(out, key):
    """The step records written so far (none yet, or a line being written: [])."""
    try:
        return [rec for rec in records(out, key) if "step" in rec]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def committers(all_records):
    """{step: replicas that took part in the committed step}, and {step: the participant counts
    the Manager reported}. A replica killed after all its buckets were reduced
    (contributed=True) counts for the step if the others committed it. A replica killed from
    outside at an unknown point (contributed=None, no step) counts for a committed step it has
    no record of when the Manager counted one participant more than the committers: it was in
    that step's quorum and the others completed the step with its gradients."""
    committed, counts, seen = {}, {}, {}
    for rec in all_records:
        if "step" in rec:
            seen.setdefault(rec["step"], set()).add(rec["replica"])
        if rec.get("commit"):
            committed.setdefault(rec["step"], set()).add(rec["replica"])
            counts.setdefault(rec["step"], set()).add(rec["participants"])
    for rec in all_records:
        if rec.get("contributed") and rec["killed"] in committed:
            committed[rec["killed"]].add(rec["replica"])
    unknown = {rec["replica"] for rec in all_records
               if "killed" in rec and rec["contributed"] is None}
    for step, who in committed.items():
        missing = [r for r in sorted(unknown) if r not in seen.get(step, ())]
        if len(counts[step]) == 1 and next(iter(counts[step])) == len(who) + 1 and \
                len(missing) == 1:
            who.add(missing[0])
    return committed, counts


def replay(all_records):
    """Float64 parameters after the committed steps: at each, the batches of every rank of the
    participating replica groups (the global batch), their gradients averaged, torch's SGD with
    momentum. A replica group's records come from each of its ranks (same `replica`). Checks
    that the committed steps are 0..n-1 and that every committed step's set of committing
    replicas has as many members as the Manager counted participants (a replica that
    contributed and is not in the log would otherwise go unnoticed). Returns (named parameters,
    committed steps, {step: replicas})."""
    committed, counts = committers(all_records)
    steps = sorted(committed)
    assert steps == list(range(len(steps))), f"committed steps are not 0..n-1: {steps}"
    group_size = {rec["replica"]: rec.get("group_size", 1) for rec in all_records}
    model = ft_worker.make_model(torch.float64)
    params = list(model.parameters())
    buffers = None
    for step in steps:
        who = sorted(committed[step])
        assert counts[step] == {len(who)}, (step, who, counts[step])
        grads = [torch.zeros_like(p) for p in params]
        ranks = [(replica, rank) for replica in who for rank in range(group_size[replica])]
        for replica, rank in ranks:
            model.zero_grad()
            x, y = ft_worker.batch(step, replica, torch.float64, rank=rank)
            ft_worker.loss_fn(model(x), y).backward()
            for g, p in zip(grads, params):
                g += p.grad / len(ranks)
        with torch.no_grad():
            if buffers is None:
                buffers = [g.clone() for g in grads]
            else:
                for b, g in zip(buffers, grads):
                    b.mul_(ft_worker.MOMENTUM).add_(g)
            for p, b in zip(params, buffers):
                p -= ft_worker.LR * b
    return dict(model.named_parameters()), steps, committed


def max_error(final, reference):
    return max((final[n].double() - reference[n]).abs().max().item() for n in reference)


def final_parameters(out, key):
    return torch.load(os.path.join(out, f"{name(key)}.pt"))
