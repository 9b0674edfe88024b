"""Mutation check: plant each bug of scripts/mutations.py, alone, in a scratch copy of the tree
and run the tests that must notice it. See docs/TESTING.md.

    bash scripts/mutants.sh                    # every mutation (CPU ones; GPU ones: NOT RUN)
    bash scripts/mutants.sh --only ID,ID       # some of them
    bash scripts/mutants.sh --list             # the list, with whether each snippet is found

How: the tracked and untracked-not-ignored files of the repository are copied (synced: only
changed files are rewritten) to a scratch tree (default /tmp/mutants/tree) that is built once,
CPU-only and in place (FUSED_REDUCER_NO_CUDA=1 python setup.py build_ext --inplace) and then
reused: a C++ mutation recompiles only the mutated file (ninja, in the scratch tree's persistent
build/). Per mutation: apply the edits (an original snippet that is not found exactly once makes
the mutation STALE: the code changed, update the entry), rebuild if C++, run its tests with
PYTHONPATH=<scratch>/python:<scratch>/tests (`pytest -x -q -p no:cacheprovider`), restore the
file (C++ is rebuilt lazily: before the next Python mutation or at the end). Python mutations run
first, then C++ ones grouped by file, so the restore costs at most one build.

Verdicts: KILLED (assertion): a test's value/behaviour assertion failed; KILLED (exception): a
check raised (on a rank, or in the test); KILLED (timeout): pytest-timeout, a rank that hung,
or a collective that timed out noticed it; KILLED (crash): a rank died (gloo aborts on a
collective mismatch, a segfault) - timeouts and crashes are the weakest kills, the target is
none of them;
SURVIVED: every test passed; STALE; BUILD FAILED (the mutation does not compile: fix the entry);
NOT RUN (GPU). Before the mutations, the union of their tests runs once on the unmutated tree
(the baseline); tests that fail there are left out of the mutants' runs and reported.

Writes <out>/mutants.json and <out>/mutants.md (default out: /tmp/mutants) and prints the table.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from mutations import MUTATIONS  # noqa: E402

CPP_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")
# Build outputs and caches that live in the scratch tree and must survive a sync.
KEEP_IN_SCRATCH = ("build/", ".hypothesis/", ".pytest_cache/")
# A rank killed by a signal (gloo aborts on a collective mismatch, a segfault): a crash, not a
# value check.
CRASH_PATTERNS = re.compile(
    r"exited with code -\d+ without reporting|Fatal Python error|Segmentation fault|"
    r"terminate called after throwing")
TIMEOUT_PATTERNS = re.compile(
    r"Timeout \(>|pytest-timeout|did not report within|\(hang\?\)|Timed out waiting|"
    r"timed out after|TimeoutError|DistBackendError.*[Tt]imeout|watchdog caught collective")


def log(msg):
    print(msg, flush=True)


# -- the scratch tree -----------------------------------------------------------------------------

def repo_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                         check=True, capture_output=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f and os.path.isfile(os.path.join(REPO, f)))


def sync_scratch(scratch):
    """Make the scratch tree's sources equal the repository's working tree; return the paths
    rewritten. Files there that are neither in the repository nor build outputs are removed."""
    os.makedirs(scratch, exist_ok=True)
    manifest = os.path.join(scratch, ".mutants_manifest")
    before = set(open(manifest).read().split("\n")) - {""} if os.path.exists(manifest) else set()
    files = repo_files()
    changed = []
    for rel in files:
        src, dst = os.path.join(REPO, rel), os.path.join(scratch, rel)
        with open(src, "rb") as f:
            data = f.read()
        if os.path.exists(dst):
            with open(dst, "rb") as f:
                if f.read() == data:
                    continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
        shutil.copymode(src, dst)
        changed.append(rel)
    for rel in sorted(before - set(files)):
        path = os.path.join(scratch, rel)
        if os.path.isfile(path) and not rel.startswith(KEEP_IN_SCRATCH):
            os.remove(path)
            changed.append(rel + " (removed)")
    with open(manifest, "w") as f:
        f.write("\n".join(files))
    return changed


def source_stamp(scratch):
    """A hash of what the extension is built from (changes mean: rebuild)."""
    import hashlib
    digest = hashlib.sha256()
    for top in ("ext", "cuda", "setup.py"):
        root = os.path.join(scratch, top)
        paths = [root] if os.path.isfile(root) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
        for path in paths:
            digest.update(path.encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def build(scratch, python, log_path):
    """CPU-only in-place build (incremental: ninja recompiles what changed). True on success."""
    env = dict(os.environ, FUSED_REDUCER_NO_CUDA="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    start = time.monotonic()
    with open(log_path, "w") as f:
        rc = subprocess.run([python, "setup.py", "build_ext", "--inplace"], cwd=scratch, env=env,
                            stdout=f, stderr=subprocess.STDOUT).returncode
    return rc == 0, time.monotonic() - start


def test_env(scratch):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(scratch, "python"),
                                         os.path.join(scratch, "tests")])
    env.pop("PYTEST_ADDOPTS", None)
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    return env


def check_import(scratch, python):
    """The scratch tree's fused_reducer must be the one imported (not an installed copy)."""
    out = subprocess.run([python, "-c", "import fused_reducer; print(fused_reducer.__file__)"],
                         cwd=scratch, env=test_env(scratch), capture_output=True, text=True)
    path = out.stdout.strip()
    if out.returncode != 0 or not os.path.realpath(path).startswith(os.path.realpath(scratch)):
        sys.exit(f"mutants: the tests would import fused_reducer from {path!r}, not from the "
                 f"scratch tree {scratch}\n{out.stderr}")
    return path


# -- one pytest run -------------------------------------------------------------------------------

def run_tests(scratch, python, tests, log_path, timeout=None, stop_first=True):
    """Run `tests`; return {"rc", "seconds", "failures": [(nodeid, kind, message)], "ran",
    "skipped"} from pytest's junit report."""
    xml = log_path + ".xml"
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "-o", "junit_family=xunit1"]
    if stop_first:
        cmd.append("-x")
    if timeout:
        cmd.append(f"--timeout={timeout}")
    cmd += tests
    start = time.monotonic()
    with open(log_path, "w") as f:
        rc = subprocess.run(cmd, cwd=scratch, env=test_env(scratch), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    failures, ran, skipped = [], 0, 0
    if os.path.exists(xml):
        root = ET.parse(xml).getroot()
        for case in root.iter("testcase"):
            ran += 1
            nodeid = _nodeid(case)
            for tag in ("failure", "error"):
                node = case.find(tag)
                if node is not None:
                    text = (node.get("message") or "") + "\n" + (node.text or "")
                    failures.append((nodeid, classify(tag, text), _summary(node, text)))
            if case.find("skipped") is not None:
                skipped += 1
    return {"rc": rc, "seconds": seconds, "failures": failures, "ran": ran, "skipped": skipped}


def _nodeid(case):
    cls = case.get("classname", "")
    path = cls.replace(".", "/") + ".py"
    return f"{path}::{case.get('name')}"


def _summary(node, text):
    message = (node.get("message") or "").strip() or text.strip()
    message = " ".join(message.split())
    return message[:300]


def classify(tag, text):
    """crash / timeout / exception / assertion: how the test noticed the mutation."""
    if CRASH_PATTERNS.search(text):
        return "crash"
    if TIMEOUT_PATTERNS.search(text):
        return "timeout"
    if tag == "error":  # in a fixture: the spawn itself failed
        return "exception"
    # per_rank() turns a check that raised on a rank into `AssertionError: rank N: <Error>: ...`
    if re.search(r"AssertionError: rank \d+: [\w.]+(Error|Exception|Failed|Interrupt)\b", text) or \
            re.search(r"^E\s+AssertionError: rank \d+: [\w.]+(Error|Exception)", text, re.M):
        return "exception"
    if "AssertionError" in text or re.search(r"^E\s+assert ", text, re.M):
        return "assertion"
    return "exception"


# -- mutations ------------------------------------------------------------------------------------

def find_state(scratch, mutation):
    """None if every snippet occurs exactly once in the scratch tree's file, else why not."""
    path = os.path.join(scratch, mutation["file"])
    if not os.path.exists(path):
        return f"{mutation['file']} does not exist"
    text = open(path).read()
    for i, (original, _) in enumerate(mutation["edits"]):
        count = text.count(original)
        if count != 1:
            return f"edit {i}: original snippet found {count} times in {mutation['file']}"
    return None


def apply(scratch, mutation):
    """Plant the mutation; return the file's unmutated text (the repository may have moved on
    meanwhile: the scratch copy is restored to what was synced, not re-read from it)."""
    path = os.path.join(scratch, mutation["file"])
    pristine = open(path).read()
    text = pristine
    for original, replacement in mutation["edits"]:
        text = text.replace(original, replacement, 1)
    with open(path, "w") as f:
        f.write(text)
    _drop_bytecode(path)
    return pristine


def restore(scratch, mutation, pristine):
    path = os.path.join(scratch, mutation["file"])
    with open(path, "w") as f:
        f.write(pristine)
    _drop_bytecode(path)


def _drop_bytecode(path):
    """Never let a .pyc of the other version (same mtime second, same size) be used."""
    if path.endswith(".py"):
        shutil.rmtree(os.path.join(os.path.dirname(path), "__pycache__"), ignore_errors=True)


def is_cpp(mutation):
    return mutation["file"].endswith(CPP_SUFFIXES)


def verdict(result):
    if result["failures"]:
        nodeid, kind, message = result["failures"][0]
        return f"KILLED ({kind})", nodeid, message
    if result["rc"] == 0:
        if result["ran"] and result["ran"] == result["skipped"]:
            return "SURVIVED (all tests skipped)", None, ""
        return "SURVIVED", None, ""
    return f"ERROR (pytest exit {result['rc']})", None, "see the log"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutation ids")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--scratch", default=os.environ.get("MUTANTS_SCRATCH", "/tmp/mutants/tree"))
    parser.add_argument("--out", default=os.environ.get("MUTANTS_OUT", "/tmp/mutants"))
    parser.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"))
    parser.add_argument("--timeout", type=int, help="pytest-timeout per test (default: pyproject)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the tests on the unmutated tree")
    args = parser.parse_args()
    if not os.path.exists(args.python):
        args.python = sys.executable

    ids = [m["id"] for m in MUTATIONS]
    assert len(ids) == len(set(ids)), "duplicate mutation ids"
    selected = MUTATIONS
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in ids]
        if unknown:
            sys.exit(f"mutants: unknown ids {unknown}; --list shows them")
        selected = [m for m in MUTATIONS if m["id"] in wanted]

    scratch = os.path.abspath(args.scratch)
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    started = time.monotonic()

    changed = sync_scratch(scratch)
    if args.list:
        for m in MUTATIONS:
            state = find_state(scratch, m)
            kind = "C++" if is_cpp(m) else "Py "
            log(f"{m['id']:34} {kind} {m['file']:36} {'ok' if state is None else 'STALE: ' + state}"
                f"{'  [GPU]' if m.get('gpu') else ''}")
            log(f"{'':34}     {m['why']}")
        return 0

    so = [f for f in os.listdir(os.path.join(scratch, "python", "fused_reducer"))
          if f.startswith("_C") and f.endswith(".so")]
    stamp_path = os.path.join(scratch, ".mutants_built")
    stamp = source_stamp(scratch)
    built = open(stamp_path).read() if os.path.exists(stamp_path) else None
    log(f"mutants: scratch tree {scratch}: {len(changed)} files synced")
    if built != stamp or not so:
        log("mutants: building the unmutated scratch tree (CPU-only, incremental)")
        ok, seconds = build(scratch, args.python, os.path.join(logs, "build-original.log"))
        if not ok:
            sys.exit(f"mutants: the unmutated scratch tree does not build; see {logs}/build-original.log")
        with open(stamp_path, "w") as f:
            f.write(stamp)
        log(f"mutants: built in {seconds:.0f}s")
    log(f"mutants: fused_reducer imported from {check_import(scratch, args.python)}")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip())

    results = []
    runnable = []
    for m in selected:
        state = find_state(scratch, m)
        if state is not None:
            results.append(dict(id=m["id"], file=m["file"], verdict="STALE", test=None,
                                message=state, seconds=0.0))
        elif m.get("gpu"):
            results.append(dict(id=m["id"], file=m["file"], verdict="NOT RUN (GPU)", test=None,
                                message="NCCL path only: run on a CUDA build with 2 GPUs "
                                        f"({', '.join(m['tests'])})", seconds=0.0))
        else:
            runnable.append(m)

    # Baseline: every test the mutations name, on the unmutated tree.
    broken = set()
    if runnable and not args.no_baseline:
        union = []
        for m in runnable:
            for t in m["tests"]:
                if t not in union:
                    union.append(t)
        log(f"mutants: baseline: {len(union)} test ids on the unmutated tree")
        base = run_tests(scratch, args.python, union, os.path.join(logs, "baseline.log"),
                         args.timeout, stop_first=False)
        for nodeid, kind, message in base["failures"]:
            broken.add(nodeid)
            log(f"mutants: BASELINE FAILURE {nodeid} ({kind}): {message}")
        log(f"mutants: baseline {base['ran']} tests, {len(base['failures'])} failing, "
            f"{base['seconds']:.0f}s")

    # Python first (no rebuilds), then C++ grouped by file (one rebuild per mutation, one to
    # restore at the end).
    runnable.sort(key=lambda m: (is_cpp(m), m["file"] if is_cpp(m) else ""))
    so_is_mutated = False
    for m in runnable:
        tests = [t for t in m["tests"] if not any(b == t or b.startswith(t + "::")
                                                   or b.startswith(t + "[") for b in broken)]
        entry = dict(id=m["id"], file=m["file"], test=None, message="", seconds=0.0)
        if not tests:
            entry.update(verdict="NO TEST (all its tests fail at baseline)")
            results.append(entry)
            continue
        t0 = time.monotonic()
        if not is_cpp(m) and so_is_mutated:
            ok, seconds = build(scratch, args.python, os.path.join(logs, "build-restore.log"))
            so_is_mutated = False
            if not ok:
                sys.exit("mutants: the restored tree does not build")
            with open(stamp_path, "w") as f:
                f.write(stamp)
        pristine = apply(scratch, m)
        try:
            if is_cpp(m):
                so_is_mutated = True
                if os.path.exists(stamp_path):
                    os.remove(stamp_path)  # the extension no longer matches the sources
                ok, build_s = build(scratch, args.python, os.path.join(logs, f"{m['id']}.build.log"))
                entry["build_seconds"] = round(build_s, 1)
                if not ok:
                    entry.update(verdict="BUILD FAILED", message=f"see logs/{m['id']}.build.log")
                    results.append(entry)
                    log(f"mutants: {m['id']}: BUILD FAILED")
                    continue
            res = run_tests(scratch, args.python, tests, os.path.join(logs, f"{m['id']}.log"),
                            args.timeout)
        finally:
            restore(scratch, m, pristine)
        v, nodeid, message = verdict(res)
        entry.update(verdict=v, test=nodeid, message=message, seconds=round(time.monotonic() - t0, 1),
                     tests=tests)
        results.append(entry)
        log(f"mutants: {m['id']}: {v}{' by ' + nodeid if nodeid else ''} "
            f"({entry['seconds']:.0f}s){': ' + message[:160] if message else ''}")
    if so_is_mutated:
        log("mutants: rebuilding the unmutated extension")
        ok, _ = build(scratch, args.python, os.path.join(logs, "build-restore.log"))
        if ok:
            with open(stamp_path, "w") as f:
                f.write(stamp)
        else:
            log("mutants: WARNING: the restored scratch tree does not build")

    order = {m["id"]: i for i, m in enumerate(MUTATIONS)}
    results.sort(key=lambda r: order[r["id"]])
    total = time.monotonic() - started
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": commit,
              "dirty_worktree": dirty, "seconds": round(total), "results": results,
              "baseline_failures": sorted(broken)}
    write_reports(report, args.out)
    print_table(report)
    ran = [r for r in results if r["verdict"].startswith(("KILLED", "SURVIVED"))]
    killed = [r for r in ran if r["verdict"].startswith("KILLED")]
    by_value = [r for r in killed if r["verdict"] == "KILLED (assertion)"]
    log(f"\nmutants: {len(killed)}/{len(ran)} killed ({len(by_value)} by a value/behaviour "
        f"assertion), {len(results) - len(ran)} not run; {total / 60:.1f} min; "
        f"{args.out}/mutants.md, {args.out}/mutants.json")
    problems = len(ran) - len(by_value) + sum(
        r["verdict"] in ("STALE", "BUILD FAILED") or r["verdict"].startswith("NO TEST")
        for r in results)
    return 1 if problems else 0


def table_rows(report):
    rows = []
    for r in report["results"]:
        by = r["test"] or ""
        rows.append((r["id"], r["verdict"], by, r["message"][:140], f"{r['seconds']:.0f}"))
    return rows


def write_reports(report, out):
    with open(os.path.join(out, "mutants.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"Mutation check, {report['date']}, commit {report['commit']}"
             f"{' (+ uncommitted changes)' if report['dirty_worktree'] else ''}, "
             f"{report['seconds'] / 60:.1f} min", "",
             "| mutation | verdict | first failing test | message | s |", "|---|---|---|---|---|"]
    for row in table_rows(report):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    with open(os.path.join(out, "mutants.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def print_table(report):
    log("")
    log(f"{'mutation':34} {'verdict':22} first failing test")
    for mid, v, by, message, seconds in table_rows(report):
        log(f"{mid:34} {v:22} {by}")


if __name__ == "__main__":
    sys.exit(main())
