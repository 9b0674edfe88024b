"""fused_reducer.torchft on CUDA with torchft's NCCL process groups (issue 47, point 7): one
replica group of one rank on one GPU (NCCL refuses two ranks on one GPU), its Manager over
torchft.ProcessGroupNCCL or torchft.ProcessGroupBabyNCCL (NCCL in a subprocess), a Lighthouse in
this process. Trains like the CPU tests' model and compares with the float64 replay of its
committed steps; a NaN in one parameter's gradient on the GPU is named (check_finite, through
the Manager) and the step is not committed. Skips without a GPU; bench/gpu_check.sh runs it."""
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install .[ft])")

import torch.distributed as dist  # noqa: E402

import fused_reducer.torchft as ft  # noqa: E402
from fused_reducer import NonFiniteGradientError  # noqa: E402

import ft_worker  # noqa: E402
from ft_common import TOLERANCE, max_error, replay, start_lighthouse  # noqa: E402

STEPS = 5


@pytest.fixture
def lighthouse():
    server = start_lighthouse()
    yield server.address()
    server.shutdown()


@pytest.mark.parametrize("pg_class", ["ProcessGroupNCCL", "ProcessGroupBabyNCCL"])
def test_one_gpu_replica_over_torchft_nccl_matches_float64(lighthouse, pg_class):
    timeout = timedelta(seconds=20)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=getattr(torchft, pg_class)(timeout=timeout), min_replica_size=1,
        load_state_dict=None, state_dict=None, replica_id="gpu_0",
        lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=store.port, rank=0,
        world_size=1, use_async_quorum=False, timeout=timeout, init_sync=False)
    model = ft.DistributedDataParallel(manager, ft_worker.make_model().cuda(),
                                       first_bucket_mb=0.004, bucket_cap_mb=0.04,
                                       replica_id="gpu_0", check_finite=True,
                                       straggler_interval=1)
    inner = torch.optim.SGD(model.parameters(), lr=ft_worker.LR, momentum=ft_worker.MOMENTUM)
    optimizer = ft.Optimizer(manager, inner)
    logged = []
    try:
        for attempt in range(STEPS + 1):
            optimizer.zero_grad()
            step = manager.current_step()
            x, y = (t.cuda() for t in ft_worker.batch(step, 0))
            poisoned = attempt == 2  # one NaN in c.weight's gradient, once
            hook = model.module.c.weight.register_hook(
                lambda g: g.flatten().index_fill(0, torch.tensor([0], device=g.device),
                                                 float("nan")).view_as(g)) if poisoned else None
            try:
                ft_worker.loss_fn(model(x), y).backward()
                assert not poisoned, "the NaN was not reported"
            except NonFiniteGradientError as e:
                assert poisoned, e
                assert "replica gpu_0: 1 element in 1 parameter, first 'c.weight' (1)" in str(e)
            if hook is not None:
                hook.remove()
            committed = manager.should_commit()
            assert committed != poisoned
            if committed:
                inner.step()
            logged.append({"replica": 0, "step": step, "commit": committed,
                           "participants": manager.num_participants()})
        assert model.bucket_sizes() and len(model.bucket_sizes()) > 1
        assert model.straggler_report()["replicas"] == ["gpu_0"]
        reference, steps, _ = replay(logged)
        assert steps == list(range(STEPS))
        final = {n: p.detach().cpu() for n, p in model.module.named_parameters()}
        assert max_error(final, reference) < TOLERANCE
    finally:
        model.close()
        manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()  # the replica's own group, made by the adapter
