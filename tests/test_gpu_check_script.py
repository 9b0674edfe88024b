"""bench/gpu_check.sh, checked statically (no GPU, no build, no spawned ranks):
it must fit one short GPU lease (stage limits <= 420 s in all), fail on a CPU-only build and on
any skipped GPU test, and write exactly one archive plus one summary file."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
BUDGET_S = 420


def _text():
    with open(SCRIPT) as f:
        return f.read()


def _code_lines():
    """The script's lines without comments (a '#' that starts a line or follows a blank)."""
    return [re.sub(r"(^|\s)#.*$", "", line) for line in _text().splitlines()]


def _stage_calls():
    """[(name, seconds)] of every `stage NAME SECONDS ...` call (not the function's definition)."""
    calls = []
    for line in _code_lines():
        m = re.match(r"\s*stage\s+(\S+)\s+(\S+)", line)
        if m:
            assert m.group(2).isdigit(), f"stage limit must be a literal number of seconds: {line!r}"
            calls.append((m.group(1), int(m.group(2))))
    return calls


def _other_timeouts():
    """Literal `timeout [--opt=...] N` uses outside the stage function (which passes "$limit")."""
    found = []
    for line in _code_lines():
        for m in re.finditer(r"(?<![-\w])timeout\s+((?:--?\S+\s+)*)(\d+)\b", line):
            found.append(int(m.group(2)))
    return found


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_syntax_is_ok():
    result = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_stage_limits_add_up_to_at_most_the_lease_budget():
    calls = _stage_calls()
    names = [n for n, _ in calls]
    assert len(names) == len(set(names)), names
    assert names[:5] == ["prereq", "build", "build_info", "gpu_tests", "no_skips"], \
        "tests come right after the build, before the benchmarks"
    assert {"copy_bench", "allreduce_bw", "step_bench"} <= set(names)
    total = sum(s for _, s in calls) + sum(_other_timeouts())
    assert total <= BUDGET_S, (calls, _other_timeouts(), total)
    # The header's arithmetic states the same limits.
    header = "\n".join(line for line in _text().splitlines() if line.startswith("#"))
    for name, seconds in calls:
        assert re.search(rf"\b{name} {seconds}\b", header), f"header does not state {name} {seconds}"
    assert re.search(rf"= {total}\b", header), "header states the total"
    planned = re.search(r"PLANNED=\(([^)]*)\)", _text()).group(1).split()
    assert planned == names, "the table lists every stage, in order"


def test_every_stage_runs_under_timeout_and_the_tests_are_bounded_per_test():
    text = _text()
    assert re.search(r'timeout --kill-after=\d+ "\$limit" "\$@"', text)
    per_test = int(re.search(r"pytest\b.*--timeout[ =](\d+)", text).group(1))
    stages = dict(_stage_calls())
    assert per_test * 2 <= stages["gpu_tests"], "a hanging test ends well inside its stage"


def test_builds_for_sm_90_only_and_asserts_a_cuda_build():
    text = _text()
    assert re.search(r"^export TORCH_CUDA_ARCH_LIST=9\.0$", text, re.M)
    assert "unset FUSED_REDUCER_NO_CUDA" in text
    assert 'info["cuda"] is True' in text and 'build_info()' in text
    assert 'build_info()[\\"cuda\\"]' in text or 'build_info()["cuda"]' in text
    # The build_info stage stops the run when it fails.
    assert re.search(r"stage build_info \d+ .*\n.*finish 1", text)


def test_a_skipped_gpu_test_fails_the_check():
    text = _text()
    assert re.search(r"-m pytest\b.*\s-rs\s", text) and "--junitxml" in text
    assert 'find("skipped")' in text and "sys.exit(1 if skipped" in text
    for node in ("tests/test_gpu.py", "tests/test_gpu_ordering.py",
                 "tests/test_reduce_dtype.py::test_cast_copy_cuda_one_launch",
                 "tests/test_module_surface_like_ddp.py"
                 "::test_syncbatchnorm_converted_model_trains_like_ddp_on_cuda"):
        assert node in text, node
        path, _, test = node.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            assert not test or re.search(rf"^def {test}\(", f.read(), re.M), f"{node} does not exist"


def test_writes_one_archive_and_one_summary_only():
    text = _text()
    assert re.search(r"^OUT=\$\{OUT:-bench/out/gpu_check\}$", text, re.M)
    assert re.search(r'^ARCHIVE="\$OUT/[\w.-]+\.tar\.gz"$', text, re.M)
    assert re.search(r'^SUMMARY="\$OUT/[\w.-]+\.txt"$', text, re.M)
    # $OUT is named nowhere else: everything else goes to $WORK and into the archive.
    uses = [line for line in _code_lines() if "$OUT" in line or "${OUT" in line]
    allowed = ("OUT=${OUT:-", 'mkdir -p "$OUT"', 'OUT=$(cd "$OUT"', 'ARCHIVE="$OUT/', 'SUMMARY="$OUT/')
    assert all(line.strip().startswith(allowed) for line in uses), uses
    assert 'mv -f "$WORK.tar.gz" "$ARCHIVE"' in text and 'cp "$WORK/summary.txt" "$SUMMARY"' in text


def test_the_table_is_printed_last():
    finish = re.search(r"^finish\(\) \{\n(.*?)^\}", _text(), re.M | re.S).group(1)
    lines = [l.strip() for l in finish.splitlines() if l.strip()]
    assert lines[-2:] == ['table "$overall"', 'exit "$code"'], lines[-3:]
