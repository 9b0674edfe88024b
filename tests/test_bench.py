"""The benchmarks: smoke runs at tiny sizes, JSON schema, bandwidth arithmetic, the #wrong check.

The end-to-end runs start the benchmarks as a user would (python bench/...; they spawn their
own gloo ranks on CPU), so they take a few seconds each; everything else runs in-process.
"""
import collections
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import allreduce_bw  # noqa: E402
import common  # noqa: E402
import models  # noqa: E402
import step_bench  # noqa: E402
from step import measure  # noqa: E402

ROW_KEYS = {"impl", "bytes", "dtype", "inplace", "time_us", "algbw_GBps", "busbw_GBps", "wrong"}
META_KEYS = {"hostname", "cpu_count", "torch_version", "gpu", "world_size", "date", "backend"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def available_impls():
    """What allreduce_bw can run on this machine (cupy needs 2 GPUs and cupy)."""
    impls = ["fused", "torch"]
    if torch.cuda.device_count() >= 2:
        try:
            import cupy  # noqa: F401
            impls.append("cupy")
        except ImportError:
            pass
    return impls


def run_bench(script, *args, timeout=150):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in common.TORCHRUN_ENV:  # a test run under torchrun must still spawn its own ranks
        env.pop(key, None)
    return subprocess.run([sys.executable, os.path.join(BENCH, script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def table_lines(stdout):
    return [line.split() for line in stdout.splitlines()
            if line.strip() and not line.startswith("#")]


def check_bandwidth_arithmetic(rows, world):
    """busbw and algbw recomputed by hand from time_us and bytes."""
    for r in rows:
        seconds = r["time_us"] / 1e6
        algbw = r["bytes"] / seconds / 1e9
        busbw = algbw * 2 * (world - 1) / world
        assert r["algbw_GBps"] == pytest.approx(algbw, rel=1e-9)
        assert r["busbw_GBps"] == pytest.approx(busbw, rel=1e-9)


def check_table_matches_json(stdout, rows):
    lines = table_lines(stdout)
    assert len(lines) * 2 == len(rows)
    for cols in lines:
        impl, nbytes, count = cols[0], int(cols[1]), int(cols[2])
        assert cols[4:6] == ["sum", "-1"]
        for inplace, (t, alg, bus, wrong) in ((False, cols[6:10]), (True, cols[10:14])):
            row = next(r for r in rows if r["impl"] == impl and r["bytes"] == nbytes
                       and r["inplace"] == inplace)
            assert count * torch.empty((), dtype=allreduce_bw.DTYPES[row["dtype"]]).element_size() == nbytes
            assert float(t) == pytest.approx(row["time_us"], abs=0.01 + row["time_us"] * 1e-6)
            assert float(alg) == pytest.approx(row["algbw_GBps"], abs=0.006)
            assert float(bus) == pytest.approx(row["busbw_GBps"], abs=0.006)
            assert wrong == ("N/A" if row["wrong"] is None else str(row["wrong"]))


# -- end to end -----------------------------------------------------------------------------------
def test_allreduce_bw_smoke_json_plot(tmp_path):
    impls = available_impls()
    out_json, out_png = tmp_path / "bw.json", tmp_path / "bw.png"
    res = run_bench("allreduce_bw.py", "-b", "8", "-e", "64K", "-f", "16", "-n", "3", "-w", "1",
                    "--impl", ",".join(impls + ["cupy"]), "--json", str(out_json),
                    "--plot", str(out_png), "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "#wrong" in out and "out-of-place" in out and "in-place" in out
    assert "# Out of bounds values : 0 OK" in out
    for impl in impls:
        assert any(line.startswith("# Avg bus bandwidth    : ") and line.endswith(f"({impl})")
                   for line in out.splitlines())

    data = json.loads(out_json.read_text())
    assert set(data) == {"meta", "rows"}
    assert META_KEYS <= set(data["meta"])
    meta = data["meta"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo"
    if "cupy" not in impls:
        assert "cupy" in meta["skipped"]
    rows = data["rows"]
    sizes = [8, 128, 2048, 32768]
    assert len(rows) == len(impls) * len(sizes) * 2
    for r in rows:
        assert set(r) == ROW_KEYS
        assert isinstance(r["impl"], str) and isinstance(r["bytes"], int)
        assert isinstance(r["inplace"], bool) and r["dtype"] == "float"
        assert r["time_us"] > 0 and r["wrong"] == 0
    assert {(r["impl"], r["bytes"], r["inplace"]) for r in rows} == {
        (i, s, ip) for i in impls for s in sizes for ip in (False, True)}
    check_bandwidth_arithmetic(rows, 2)
    check_table_matches_json(out, rows)
    # '# Avg bus bandwidth' = mean of that impl's busbw cells
    for impl in impls:
        cells = [r["busbw_GBps"] for r in rows if r["impl"] == impl]
        line = next(l for l in out.splitlines() if l.startswith("# Avg bus bandwidth") and f"({impl})" in l)
        assert float(line.split(":")[1].split()[0]) == pytest.approx(sum(cells) / len(cells), abs=1e-4)
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_allreduce_bw_queues_its_timed_operations_unless_told_to_wait(monkeypatch):
    """--launch queued (all_reduce_perf: enqueue -n, then synchronise) starts every timed
    operation before waiting for any; --launch waited waits for each before the next."""
    events = []

    class Recording(allreduce_bw.Impl):
        def start(self, send, recv, inplace):
            events.append("start")
            return lambda: events.append("wait")

    class Ctx:
        def sync(self):
            pass

    monkeypatch.setattr(allreduce_bw.dist, "barrier", lambda: None)
    monkeypatch.setattr(allreduce_bw, "_mean_over_ranks", lambda ctx, value: value)
    for queued, expected in ((True, ["start"] * 3 + ["wait"] * 3),
                             (False, ["start", "wait"] * 3)):
        events.clear()
        assert allreduce_bw.time_case(Ctx(), Recording(), None, None, True, 1, 3, queued) > 0
        assert events == ["start", "wait"] + expected  # one warm-up operation first
    args = allreduce_bw.build_parser().parse_args([])
    assert args.launch == "queued"


def test_plan_validate_measures_interleaved_cells_and_compares(tmp_path):
    """plan_validate measure: one sweep JSON with a measured row per cell and the recording
    reducer's profile (its rest of the step measured by the bench); compare predicts each
    cell from them."""
    sweep, profiles = tmp_path / "sweep.json", tmp_path / "profiles"
    res = run_bench("plan_validate.py", "measure", "--model", "many-small", "--sweep-first",
                    "0.25,4", "--sweep-cap", "1", "--warmup", "1", "--steps", "2", "--out",
                    str(profiles), "--json", str(sweep))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(sweep.read_text())
    assert data["meta"]["world_size"] == 2
    cells = [(r["first_bucket_mb"], r["bucket_cap_mb"], r["recorded"]) for r in data["rows"]]
    # the recording reducer (DDP's limits by default) first, then the cells
    assert cells == [(1.0, 25.0, True), (0.25, 1.0, False), (4.0, 1.0, False)]
    for row in data["rows"]:
        assert row["impl"] == "fused" and row["steps"] == 2 and row["median_ms"] > 0
        assert row["slowest_rank_median_ms"] >= row["median_ms"]
        assert sum(row["bucket_sizes"]) == data["models"][0]["grad_bytes"]
    assert len(data["rows"][1]["bucket_sizes"]) > len(data["rows"][2]["bucket_sizes"]) == 1
    timing = json.loads((profiles / "profile_many-small.json").read_text())["timing"]
    for key in ("other_us", "step_us", "backward_no_comm_us"):
        assert "plan_validate.py measure" in timing[f"{key}_source"]
    # the profile's step is the recording reducer's measured one, and the rest of it a few
    # ms, not the other cells' steps in between
    assert timing["step_us"] == pytest.approx(1e3 * data["rows"][0]["median_ms"])
    assert timing["other_us"] < 0.5 * timing["step_us"]
    assert 0 < timing["backward_no_comm_us"] < timing["step_us"]

    calibration = tmp_path / "bw.json"
    res = run_bench("allreduce_bw.py", "-b", "16K", "-e", "1M", "-f", "8", "-n", "3", "-w", "1",
                    "-c", "0", "--impl", "fused", "--quiet", "--json", str(calibration))
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / "validate.json"
    res = run_bench("plan_validate.py", "compare", "--sweep", str(sweep), "--profiles",
                    str(profiles), "--calibrate", str(calibration), "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert [(c["first_mb"], c["cap_mb"]) for c in result["cells"]] == [(0.25, 1.0), (4.0, 1.0)]
    assert result["overlap"] == "measured" and 0 <= result["overlap_cost"]["many-small"] <= 1
    # the recorded layout is the anchor, not a prediction: reproduced, and kept out of the error
    recorded, = result["recorded_cells"]
    assert recorded["predicted_ms"] == pytest.approx(recorded["measured_ms"])
    for c in result["cells"]:
        assert c["buckets_predicted"] == c["buckets_measured"]
        assert math.isfinite(c["predicted_ms"]) and c["predicted_ms"] > 0
        assert c["error_pct"] == pytest.approx(100 * (c["predicted_ms"] / c["measured_ms"] - 1))
    assert result["summary"]["all"]["cells"] == 2
    layouts = result["summary"]["many-small"]
    assert layouts["layouts"] == 2 and "predicted_best_layout_vs_measured_best_pct" in layouts


def test_allreduce_bw_check_detects_corrupted_result(tmp_path):
    """--corrupt (testing only) alters one element of fused's result on the last of 3 ranks: the
    check must count exactly that element, torch's rows stay clean, and the run fails."""
    out_json = tmp_path / "bad.json"
    res = run_bench("allreduce_bw.py", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1",
                    "-d", "half", "--nranks", "3", "--trials", "2", "--impl", "fused,torch",
                    "--corrupt", "fused", "--json", str(out_json), "--quiet")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout
    data = json.loads(out_json.read_text())
    assert data["meta"]["world_size"] == 3
    rows = data["rows"]
    assert len(rows) == 2 * 2  # impls x (out-of-place, in-place)
    for r in rows:
        assert r["wrong"] == (1 if r["impl"] == "fused" else 0), r
    check_bandwidth_arithmetic(rows, 3)  # factor 2(n-1)/n = 4/3 here
    check_table_matches_json(res.stdout, rows)


def test_step_bench_smoke_sweep_json_heatmap(tmp_path):
    out_json = tmp_path / "steps.json"
    res = run_bench("step_bench.py", "--model", "large,many-small", "--layers", "2", "--hidden", "32",
                    "--seq", "8", "--batch", "4", "--steps", "2", "--warmup", "2", "--probe-steps", "1",
                    "--sweep-first", "0.001,1", "--sweep-cap", "25", "--aa", "none",
                    "--json", str(out_json), "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "ratio FusedReducer/DDP median step, large" in out
    assert "ratio FusedReducer/DDP median step, many-small" in out
    assert "MISMATCH" not in out and "DIFFER" not in out

    data = json.loads(out_json.read_text())
    assert {"meta", "settings", "models", "grid", "rows"} <= set(data)
    assert data["grid"] == {"first_bucket_mb": [0.001, 1.0], "bucket_cap_mb": [25.0]}
    rows = data["rows"]
    # models x configs x wrappers (DDP best, DDP default, fused, torch's FSDP2 replicate)
    assert len(rows) == 2 * 2 * 4
    by_key = {(r["model"], r["first_bucket_mb"], r["impl"]): r for r in rows}
    for model in ("large", "many-small"):
        info = next(m for m in data["models"] if m["model"] == model)
        for first in (0.001, 1.0):
            ddp, fused = by_key[(model, first, "ddp")], by_key[(model, first, "fused")]
            for r in (ddp, fused):
                assert r["steps"] == 2 and len(r["step_times_ms"]) == 2
                assert 0 < r["median_ms"] <= r["p90_ms"] + 1e-9
                assert r["exposed_comm_ms"] >= 0
                # counted by the profiler: one collective per bucket, every gradient byte once
                assert r["collectives_source"].startswith("profiler")
                assert r["collectives_per_step"] == len(r["bucket_sizes"])
                assert r["bytes_per_step"] == info["grad_bytes"]
            assert ddp["ratio_to_ddp"] == 1.0
            assert fused["ratio_to_ddp"] == pytest.approx(fused["median_ms"] / ddp["median_ms"])
            # DDP(model) next to DDP's best settings; the ratios to it too
            default = by_key[(model, first, "ddp_default")]
            assert default["constructed_as"] == "DDP(model)"
            assert "batched_grad_copy=True" in ddp["constructed_as"]
            assert default["bytes_per_step"] == info["grad_bytes"]
            assert default["collectives_per_step"] == len(default["bucket_sizes"])
            assert fused["ratio_to_ddp_default"] == pytest.approx(
                fused["median_ms"] / default["median_ms"])
            assert fused["layout_match"] and fused["grad_max_abs_diff"] <= 1e-6
            # ...and the independent count agrees with FusedReducer's own stats
            assert fused["stats"]["allreduces"] == fused["collectives_per_step"]
            # FSDP2 replicate: timed in the same rounds, its gradients (DTensors) equal to
            # DDP's, one all-reduce per group (each block, then the root), every byte once
            fsdp2 = by_key[(model, first, "fsdp2-replicate")]
            assert fsdp2["steps"] == 2 and fsdp2["median_ms"] > 0
            assert fsdp2["grad_max_abs_diff"] <= 1e-6 * max(1.0, fsdp2["grad_max_abs"])
            assert fsdp2["grad_max_abs"] > 0
            assert fsdp2["collectives_per_step"] == len(fsdp2["bucket_sizes"])
            assert sum(fsdp2["bucket_sizes"]) == info["grad_bytes"] == fsdp2["bytes_per_step"]
            assert fsdp2["ratio_to_ddp"] == pytest.approx(fsdp2["median_ms"] / ddp["median_ms"])
            assert fsdp2["exposed_comm_ms"] is None  # not probed (the docstring says why)
        # a 1 KiB first bucket splits these models into >= 2 buckets; 1 MiB does not
        assert by_key[(model, 0.001, "fused")]["collectives_per_step"] >= 2
        assert by_key[(model, 1.0, "fused")]["collectives_per_step"] == 1
    # FSDP2 groups: the large model's 2 blocks and the root's rest; many-small the root alone
    assert len(by_key[("large", 1.0, "fsdp2-replicate")]["bucket_sizes"]) == 3
    assert len(by_key[("many-small", 1.0, "fsdp2-replicate")]["bucket_sizes"]) == 1
    assert "ratio fsdp2-replicate/DDP median step, large" in out
    assert data["refused"] == []
    assert (tmp_path / "steps.png").read_bytes()[:8] == PNG_MAGIC  # heatmap next to the JSON


def real_models_available():
    """The real models whose library (torchvision / transformers: the bench extra) is here."""
    names = []
    for name in models.REAL:
        try:
            models.require(name)
        except models.MissingLibrary:
            continue
        names.append(name)
    return names


def test_step_bench_smoke_real_models(tmp_path):
    """Every model of the real-model set through the whole measurement (1 timed step, tiny
    inputs), in one run so the ranks start once: gradients equal to DDP's, layouts equal, one
    collective per bucket and every gradient byte reduced once."""
    names = real_models_available()
    if not names:
        pytest.skip("neither torchvision nor transformers installed (pip install '.[bench]')")
    out_json = tmp_path / "real.json"
    res = run_bench("step_bench.py", "--model", ",".join(names), "--steps", "1", "--warmup", "2",
                    "--probe-steps", "1", "--batch", "2", "--seq", "16", "--aa", "none",
                    "--json", str(out_json), "--quiet", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MISMATCH" not in res.stdout and "DIFFER" not in res.stdout
    data = json.loads(out_json.read_text())
    assert [m["model"] for m in data["models"]] == names
    rows = data["rows"]
    # DDP best, DDP default, FusedReducer, and FSDP2 replicate except where torch refuses it
    refused = {r["model"]: r for r in data["refused"]}
    assert set(refused) == {n for n in names if n.endswith("-cl")}
    for r in refused.values():  # the channels_last ResNets, with torch's own message
        assert r["impl"] == "fsdp2-replicate" and "non-contiguous parameters" in r["error"]
        assert f"fsdp2-replicate refused {r['model']}: NotImplementedError" in res.stdout
    assert len(rows) == 4 * len(names) - len(refused)
    for info in data["models"]:
        assert info["channels_last"] == info["model"].endswith("-cl")
        ddp, fused = (next(r for r in rows if r["model"] == info["model"] and r["impl"] == impl)
                      for impl in ("ddp", "fused"))
        for r in (ddp, fused):
            assert r["collectives_per_step"] == len(r["bucket_sizes"])
            assert r["bytes_per_step"] >= info["grad_bytes"]  # FusedReducer pads slots to 16 B
            assert r["exposed_comm_ms"] >= 0 and r["median_ms"] > 0
        assert fused["layout_match"] and fused["grad_max_abs_diff"] <= 1e-6 * max(1.0, fused["grad_max_abs"])
        tel = fused["telemetry"]
        assert tel["exposed_ms"] >= 0 and len(tel["buckets"]) == len(fused["bucket_sizes"])
        if info["model"] not in refused:
            fsdp2 = next(r for r in rows if r["model"] == info["model"]
                         and r["impl"] == "fsdp2-replicate")
            assert fsdp2["grad_max_abs_diff"] <= 1e-6 * max(1.0, fsdp2["grad_max_abs"])
            assert fsdp2["collectives_per_step"] == len(fsdp2["bucket_sizes"]) > 1
    assert f"ratio FusedReducer/DDP median step, {names[0]}" in res.stdout
    assert "geometric mean of FusedReducer/DDP" in res.stdout or len(names) == 1


def test_step_bench_aa_pair_and_autotune(tmp_path):
    """--aa adds a second instance of one wrapper (the noise band) and --autotune a tuned
    FusedReducer, both timed interleaved with the others and reported next to the ratio."""
    out_json = tmp_path / "aa.json"
    res = run_bench("step_bench.py", "--model", "many-small", "--layers", "6", "--hidden", "16",
                    "--batch", "4", "--steps", "3", "--warmup", "2", "--probe-steps", "1",
                    "--aa", "fused", "--autotune", "--no-fsdp2", "--json", str(out_json), "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out_json.read_text())["rows"]
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"ddp", "ddp_default", "fused", "fused_aa", "tuned"}
    for r in rows:
        assert r["steps"] == 3 and r["aa"] == "fused_aa/fused"
        assert r["aa_ratio"] == pytest.approx(by["fused_aa"]["median_ms"] / by["fused"]["median_ms"])
        lo, hi = r["ratio_ci90"]
        assert lo <= hi
    assert by["tuned"]["autotune"]["report"]["done"]
    assert by["tuned"]["telemetry"]["buckets"]
    assert "A/A fused_aa/fused" in res.stdout and "ratio tuned FusedReducer/DDP" in res.stdout


def test_autotune_bench_smoke_sweep_tuned_and_final(tmp_path):
    """The README's autotune comparison: a (small) exhaustive sweep, a tuned model and the
    final interleaved timing run to the end and write their JSON (the sweep once crashed on
    timed_step's pair, bench/step/measure.py)."""
    out_json = tmp_path / "autotune.json"
    res = run_bench("autotune_bench.py", "--model", "many-small", "--layers", "4", "--hidden",
                    "16", "--batch", "4", "--sweep-steps", "1", "--final-steps", "2",
                    "--warmup", "1", "--json", str(out_json), "--quiet", timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out_json.read_text())
    assert result["sweep"] and result["sweep_best"], result
    assert set(result["final_median_ms"]) >= {"default", "sweep_best", "tuned"}, result
    assert all(ms > 0 for ms in result["final_median_ms"].values()), result


def test_norm_reference_smoke_ours_is_the_float64_norm(tmp_path):
    """bench/norm_reference.py (docs/archive/PERFORMANCE_LOG.md's table of torch's thread-dependent CPU
    norm): runs, writes its rows, and the norm from the copy is the float64 norm."""
    out_json = tmp_path / "norms.json"
    res = run_bench("norm_reference.py", "--sizes", "5000,70000", "--threads-list", "1,2",
                    "--json", str(out_json))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 6 and all(r["source"] == "copy" for r in rows), rows
    for r in rows:
        assert abs(r["ours"] - r["float64"]) <= 1e-6 * r["float64"], r
        assert {"torch@1", "torch@2"} <= set(r), r


def test_straggler_noise_smoke_counts_warnings_and_names_a_late_rank(tmp_path):
    """bench/straggler_noise.py (docs/HEALTH.md's measurement of the straggler threshold): a
    balanced run and a run with rank 1 late by 40 % of its step, no busy loops; the late rank is
    named at some exchange and the JSON holds every exchange."""
    out_json = tmp_path / "straggler.json"
    res = run_bench("straggler_noise.py", "--runs", "1", "--late-runs", "1", "--steps", "30",
                    "--busy", "0", "--late-fraction", "0.4", "--json", str(out_json))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "with a warning" in res.stdout and "named (first at steps" in res.stdout, res.stdout
    out = json.loads(out_json.read_text())
    assert [e["step"] for e in out["balanced"][0]["exchanges"]] == [10, 20, 30]
    late = out["late"][0]["exchanges"]
    assert any(1 in e["stragglers"] for e in late), late


def test_step_bench_names_the_bench_extra_when_a_library_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision -> ImportError
    with pytest.raises(models.MissingLibrary, match=r"pip install '\.\[bench\]'"):
        models.ModelSpec.from_args("resnet18").build("cpu")
    with pytest.raises(SystemExit) as exc:
        step_bench.main(["--model", "resnet50", "--channels-last"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "resnet50-cl" in err and "torchvision" in err and ".[bench]" in err


def test_model_set_aliases_and_channels_last_flag():
    assert models.expand(["all"]) == list(models.REAL + models.SYNTHETIC)
    assert step_bench._models("real,large") == list(models.REAL) + ["large"]
    with pytest.raises(Exception):
        step_bench._models("resnet34")
    args = step_bench.build_parser().parse_args(["--model", "resnet18,gpt2", "--channels-last"])
    assert args.channels_last  # main() maps resnet18 -> resnet18-cl before launching


@pytest.mark.parametrize("n", [2, 3, 4])
def test_interleaving_is_balanced(n):
    """Over a cycle of rounds every wrapper runs in every position equally often, and from
    three wrappers on (the A/A twin, --autotune) none ever runs right after itself."""
    variants = [(name, None) for name in "abcd"[:n]]
    cycle = len(measure._order_cycle(n))
    assert cycle == math.factorial(n)
    rounds = [[name for name, _ in measure.round_order(variants, r)] for r in range(cycle)]
    assert all(sorted(r) == list("abcd"[:n]) for r in rounds)
    for pos in range(n):
        counts = collections.Counter(r[pos] for r in rounds)
        assert set(counts.values()) == {cycle // n}, counts
    seq = [name for r in rounds for name in r]  # cyclic: the cycle repeats
    repeats = collections.Counter(a for a, b in zip(seq, seq[1:] + seq[:1]) if a == b)
    if n == 2:
        assert repeats["a"] == repeats["b"]  # A,B / B,A: each repeated alike
    else:
        assert not repeats
    assert measure.round_order(variants, cycle) == measure.round_order(variants, 0)


@pytest.mark.parametrize("name", models.REAL + models.HOLDOUT)
def test_real_models_build_from_configs(name):
    try:
        models.require(name)
    except models.MissingLibrary as e:
        pytest.skip(str(e))
    # densenet121 pools a 16-pixel image down to nothing: it needs 32
    spec = models.ModelSpec.from_args(name, batch=2, seq=32 if name == "densenet121" else 16)
    a, b = spec.build("cpu"), spec.build("cpu")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    info = spec.describe(a)
    expected = {"resnet18": (11_181_642, 62), "resnet50": (23_528_522, 161),
                "mobilenet_v2": (2_236_682, 158), "densenet121": (6_964_106, 364),
                "llama": (8_716_928, 21)}  # llama: untied, two 32000 x 128 embeddings
    if name.split("-")[0] in expected:
        assert (info["params"], info["tensors"]) == expected[name.split("-")[0]]
    else:  # tied embeddings: the output layer is the input embedding, one tensor
        assert info["tensors"] < 50 and 3e6 < info["params"] < 8e6
    x = spec.input(0, 1, "cpu")
    assert torch.equal(x, spec.input(0, 1, "cpu")) and not torch.equal(x, spec.input(1, 1, "cpu"))
    a(x).float().pow(2).mean().backward()
    convs = [p for p in a.parameters() if p.dim() == 4]
    if name.endswith("-cl"):
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert all(p.grad.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert all(p.grad is not None for p in a.parameters())  # no unused parameter


# -- in-process -----------------------------------------------------------------------------------
def test_parse_size():
    cases = {"8": 8, "64K": 65536, "64k": 65536, "1M": 1 << 20, "2G": 2 << 30, "1.5M": 3 << 19,
             "4MB": 4 << 20, "4MiB": 4 << 20, "512B": 512}
    for text, value in cases.items():
        assert common.parse_size(text) == value, text
    for bad in ("", "x", "1X", "-4K", "K"):
        with pytest.raises(Exception):
            common.parse_size(bad)
    assert common.format_size(65536) == "64K" and common.format_size(1000) == "1000"


def test_bandwidth_hand_computation():
    # 1 MB in 1000 us: algbw 1 GB/s; busbw x 2(n-1)/n
    assert allreduce_bw.bandwidths(1_000_000, 1000.0, 2) == pytest.approx((1.0, 1.0))
    assert allreduce_bw.bandwidths(1_000_000, 1000.0, 4) == pytest.approx((1.0, 1.5))
    assert allreduce_bw.bandwidths(8 << 20, 2500.0, 8)[1] == pytest.approx(8 * 2 ** 20 / 2.5e-3 / 1e9 * 14 / 8)


def test_sizes_like_nccl_tests():
    args = allreduce_bw.build_parser().parse_args(["-b", "8", "-e", "128", "-f", "2"])
    assert allreduce_bw.sizes_from(args) == [8, 16, 32, 64, 128]
    args = allreduce_bw.build_parser().parse_args(["-b", "1K", "-e", "4K", "-f", "1", "-i", "1K"])
    assert allreduce_bw.sizes_from(args) == [1024, 2048, 3072, 4096]


@pytest.mark.parametrize("dtype", sorted(set(allreduce_bw.DTYPES.values()), key=str))
@pytest.mark.parametrize("world", [2, 3, 8])
def test_crafted_inputs_have_an_exact_sum(dtype, world):
    """Rank inputs sum (in float64) to the expected values, which the dtype holds exactly; a
    single changed element and a collective that did nothing are both detected."""
    count = 5000  # > period: the tiling is exercised too
    crafted = [allreduce_bw.CraftedData(dtype, r, world, "cpu", period=997) for r in range(world)]
    assert crafted[0].exact
    inputs = []
    for c in crafted:
        buf = torch.empty(count, dtype=dtype)
        c.fill_input(buf)
        inputs.append(buf)
    assert len(set(inputs[0][:200].tolist())) > 1  # not a constant pattern
    total = torch.stack([b.to(torch.float64) for b in inputs]).sum(0)
    result = total.to(dtype)
    assert torch.equal(result.to(torch.float64), total)  # exactly representable
    assert crafted[0].count_wrong(result) == 0
    allreduce_bw.fill_sentinel(result[count // 3:count // 3 + 1])  # a value no sum takes
    assert crafted[0].count_wrong(result) == 1
    assert crafted[0].count_wrong(inputs[0]) > count // 2  # no reduction at all


def test_every_flag_is_documented():
    for module in (allreduce_bw, step_bench):
        parser = module.build_parser()
        text = parser.format_help()
        for action in parser._actions:
            if action.help == "==SUPPRESS==":
                assert allreduce_bw.CORRUPT_FLAG in action.option_strings
                continue
            assert action.help, f"{module.__name__}: {action.option_strings} has no help"
            for opt in action.option_strings:
                assert opt in text
    sb = step_bench.build_parser().format_help()
    for flag in ("--model", "--layers", "--hidden", "--bucket-cap-mb", "--first-bucket-mb",
                 "--sweep-first", "--sweep-cap", "--json", "--plot", "--seed", "--steps"):
        assert flag in sb
    ab = allreduce_bw.build_parser().format_help()
    for flag in ("-b", "-e", "-f", "-n", "-w", "-d", "-c", "--impl", "--json", "--plot"):
        assert flag in ab
    assert "--corrupt" not in ab


def test_torchrun_detection(monkeypatch):
    for key in common.TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not common.launched_by_torchrun()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not common.launched_by_torchrun()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert common.launched_by_torchrun()


def test_step_bench_models_match_their_description():
    large = models.ModelSpec("large", 4, 768, 8, 64, 0)
    info = large.describe(large.build("cpu"))
    assert 20e6 < info["params"] < 40e6 and 24 <= info["tensors"] <= 60
    small = models.ModelSpec("many-small", 200, 64, 32, 64, 0)
    info = small.describe(small.build("cpu"))
    assert info["tensors"] >= 200 and info["params"] < 2e6
    # same seed -> same weights; inputs depend on (seed, rank, step)
    a, b = small.build("cpu"), small.build("cpu")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(small.input(0, 3, "cpu"), small.input(0, 3, "cpu"))
    assert not torch.equal(small.input(0, 3, "cpu"), small.input(1, 3, "cpu"))


def test_sharded_bench_smoke_float64_reference_and_plot(tmp_path):
    """bench/sharded_bench.py on a small model at 2 ranks: the sharded run is bit-identical to
    DDP's (a sum of two has one order) and as far from the float64 reference; the state per rank
    is halved; every way is timed, torch's FSDP2 ZeRO-2 too (its parameters, gathered whole, equal
    to DDP's; its state halved); the plot is a PNG. Also the process-group transport, SGD."""
    png = tmp_path / "sharded.png"
    result = run_bench("sharded_bench.py", "--model", "many-small", "--steps", "2",
                       "--warmup", "1", "--float64-reference", "--plot", str(png))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "shm transport" in out and "max |ddp - sharded| parameter 0.00e+00" in out, out
    import re
    ddp_f64, sharded_f64 = map(float, re.search(
        r"float64 reference: max \|ddp - f64\| (\S+), max \|sharded - f64\| (\S+)", out).groups())
    assert ddp_f64 == sharded_f64 > 0, out
    states = {line.split()[0]: line.split("per rank ")[1] for line in out.splitlines()
              if "optimizer state per rank" in line}
    assert set(states) == {"ddp", "sharded", "sharded-overlap", "zero", "fsdp2-zero2"}, out
    # torch's FSDP2 ZeRO-2 (fully_shard, reshard_after_forward=False): the same parameters
    # (gathered whole from its DTensor shards), half the optimizer state per rank
    assert "max |ddp - fsdp2-zero2| parameter 0.00e+00" in out, out
    ddp_mib, sharded_mib = (float(states[w].split(",")[0]) for w in ("ddp", "sharded"))
    assert abs(sharded_mib - ddp_mib / 2) <= 0.1, states
    assert float(states["fsdp2-zero2"].split(",")[0]) == sharded_mib, states
    assert png.read_bytes()[:8] == PNG_MAGIC
    result = run_bench("sharded_bench.py", "--model", "many-small", "--steps", "1",
                       "--warmup", "0", "--ways", "ddp,sharded", "--transport", "process_group",
                       "--optimizer", "sgd")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process_group transport" in result.stdout, result.stdout
    assert "max |ddp - sharded| parameter 0.00e+00" in result.stdout, result.stdout
    assert "zero" not in result.stdout.split("parameter 0.00e+00")[1], result.stdout


def test_memory_bench_fsdp2_replicate_trains_to_ddp_best_parameters(tmp_path):
    """bench/memory_bench.py with torch's FSDP2 replicate beside DDP best (each in its own ranks,
    tiny model, AdamW): both rows are measured, FSDP2's parameters after training (DTensors,
    gathered whole) have DDP best's fingerprint, and the JSON says so."""
    out_json = tmp_path / "memory.json"
    res = run_bench("memory_bench.py", "--impl", "ddp-best,fsdp2-replicate", "--gv", "off",
                    "--layers", "2", "--hidden", "64", "--steps", "2", "--changes", "0",
                    "--optimizer", "adamw", "--json", str(out_json), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "FSDP2 replicate" in res.stdout and "MISMATCH" not in res.stdout, res.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["ddp-best", "fsdp2-replicate"]
    ddp, fsdp2 = rows
    assert len(fsdp2["fingerprint"]) == len(ddp["fingerprint"]) == 4  # 2 x (weight, bias)
    assert fsdp2["param_difference"] <= 1e-6 and ddp["param_difference"] == 0.0
    assert fsdp2["added"] is not None and fsdp2["train_peak"] > 0


def test_large_models_bench_smoke_counts_and_matches_ddp(tmp_path):
    """bench/large_models_bench.py at tiny sizes on 4 gloo ranks: TP=2 x DP=2 and PP=2 x DP=2,
    FusedReducer and DDP in the same set-up end with the same parameters; the profiler counts
    the DP all-reduces per step (one bucket here: 1 per step and rank, as DDP's; TP's own
    all-reduces counted apart); the JSON has both ways of both layouts."""
    out_json = tmp_path / "large.json"
    result = run_bench("large_models_bench.py", "--nranks", "4", "--dim", "16", "--layers", "2",
                       "--batch", "8", "--steps", "1", "--warmup", "1", "--json", str(out_json),
                       timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("max |ours - ddp| parameter 0.00e+00") == 2, out
    assert "(DP: [1, 1, 1, 1], TP's own: 4)" in out, out
    assert "pp ours  step" in out and "all-reduces per step and rank [1, 1, 1, 1]" in out, out
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["layout"], r["way"]) for r in rows} == {(l, w) for l in ("tp", "pp")
                                                       for w in ("ours", "ddp")}
    assert all(r["dp_allreduces_per_step"] == [1] * 4 and r["step_ms"] > 0 for r in rows), rows
