"""Markdown tables for docs/RESULTS.md and docs/archive/PERFORMANCE_LOG.md from the benchmarks' JSON files.

    python bench/report.py bench/out/step_cpu.json bench/out/allreduce_bw_cpu.json
    python bench/report.py --summary bench/out/issue10_run*.json   # one row per model over runs

--summary combines repeated step_bench runs of the same models: per model the medians over the
runs of DDP's and FusedReducer's median step, of their ratio and of the exposed communication,
each run's ratio and A/A ratio (the noise band), and the geometric mean of the per-model median
ratios; with --targets, the issue-10 acceptance checks. Ratios are to step_bench's 'ddp' row: DDP
with its best settings since issue 22 ("DDP best"; older files: DDP with the same limits), and,
where the run has it, to 'ddp_default' (DDP(model)).
"""
import argparse
import json
import os
import statistics

IMPL_NAMES = {"ddp": "DDP", "fused": "FusedReducer", "ddp_aa": "DDP (A/A twin)",
              "fused_aa": "FusedReducer (A/A twin)", "tuned": "FusedReducer autotune",
              "local": "no wrapper", "ddp_hook": "DDP + compress hook",
              "fused_pg": "FusedReducer on the process group",
              "ddp_default": "DDP default", "fsdp2": "FSDP2 replicate",
              "fsdp2-replicate": "FSDP2 replicate"}


def impl_name(row):
    """The row's wrapper as the tables name it. Since issue 22 step_bench's 'ddp' row is DDP with
    its best settings (its rows then say how each DDP was built: 'constructed_as'); before, it
    was DDP with the same limits set through DDP's module defaults."""
    if row["impl"] in ("ddp", "ddp_aa") and "constructed_as" in row:
        return "DDP best" + (" (A/A twin)" if row["impl"] == "ddp_aa" else "")
    return IMPL_NAMES.get(row["impl"], row["impl"])


def step_table(data):
    meta = data["meta"]
    rows = data["rows"]
    best = any("constructed_as" in r for r in rows)
    lines = [f"`{meta['command']}` ({meta['date'][:16]} UTC, {meta['cpu_count']} cores "
             f"{meta.get('cpu_model', '')}, world {meta['world_size']} {meta['backend']}, "
             f"torch {meta['torch_version']}, commit {meta.get('git_commit')})", "",
             "| model | first / cap (MiB) | impl | median ms | p90 ms | all-reduces/step | MB/step "
             f"| exposed comm ms | median / {'DDP best' if best else 'DDP'} |",
             "|---|---|---|---|---|---|---|---|---|"]
    extra = [("ratio_to_ddp_default", "median / DDP default"),
             ("ratio_to_ddp_hook", "median / DDP+hook")]  # --reduce-dtype runs
    extra = [(key, head) for key, head in extra if any(key in r for r in rows)]
    for _, head in extra:
        lines[2] += f" {head} |"
        lines[3] += "---|"
    for r in rows:
        mb = "-" if r["bytes_per_step"] is None else f"{r['bytes_per_step'] / 1e6:.1f}"
        # None where a wrapper's hooks give no end-of-backward wait to time (FSDP2's)
        exposed = "-" if r["exposed_comm_ms"] is None else f"{r['exposed_comm_ms']:.1f}"
        lines.append(f"| {r['model']} | {r['first_bucket_mb']:g} / {r['bucket_cap_mb']:g} | "
                     f"{impl_name(r)} | {r['median_ms']:.1f} | "
                     f"{r['p90_ms']:.1f} | {r['collectives_per_step']} | {mb} | "
                     f"{exposed} | **{r['ratio_to_ddp']:.3f}** |"
                     + "".join(f" {r[key]:.3f} |" if key in r else " - |" for key, _ in extra))
    built = {}
    for r in rows:
        if "constructed_as" in r:
            built.setdefault(impl_name(r), set()).add(r["constructed_as"])
    if built:
        lines += ["", "; ".join(f"{name}: `{'`, `'.join(sorted(texts))}`"
                                for name, texts in built.items()) + "."]
    return "\n".join(lines)


MEMORY_NAMES = {"ddp": "DDP default", "ddp-best": "DDP best", "fused-shm": "FusedReducer, shm",
                "fused-pg": "FusedReducer, process_group", "fsdp2-replicate": "FSDP2 replicate"}


def memory_table(data):
    """bench/memory_bench.py: MiB per rank (the larger of the ranks)."""
    meta, rows = data["meta"], data["rows"]
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731

    def ratio(row, impl):
        ref = next((r for r in rows if r["impl"] == impl and r["gv"] == row["gv"]), None)
        return row["added"] / ref["added"] if ref and ref["added"] else None

    lines = [f"`{meta['command']}` ({meta.get('date', '')[:16]} UTC, {meta['cpu_count']} cores, "
             f"world {meta.get('world_size', 2)} gloo, torch {meta['torch_version']}, commit "
             f"{meta.get('git_commit')})", "",
             "| wrapper | gradient_as_bucket_view | added MiB (trimmed) | of which shared memory "
             "| added MiB (as is) | training peak MiB | / DDP default | / DDP best | "
             f"{data['settings'].get('changes', '')} limit changes: retained as is / trimmed MiB "
             "| their peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        retained = ("-" if r.get("retained") is None
                    else f"{fmt(r['retained_raw'])} / {fmt(r['retained'])}")
        lines.append(f"| {MEMORY_NAMES.get(r['impl'], r['impl'])} | {'on' if r['gv'] else 'off'} | "
                     f"**{fmt(r['added'])}** | {fmt(r['added_shmem'])} | {fmt(r['added_raw'])} | "
                     f"{fmt(r['train_peak'])} | **{fmt(ratio(r, 'ddp'), 3)}** | "
                     f"{fmt(ratio(r, 'ddp-best'), 3)} | {retained} | "
                     f"{fmt(r.get('rebuild_peak'))} |")
    return "\n".join(lines)


def bw_table(data):
    meta = data["meta"]
    rows = data["rows"]
    lines = [f"`{meta['command']}` ({meta['date'][:16]} UTC, {meta['cpu_count']} cores, world "
             f"{meta['world_size']} {meta['backend']}, torch {meta['torch_version']})", "",
             "| bytes | in-place | fused busbw GB/s | torch busbw GB/s | fused / torch | #wrong |",
             "|---|---|---|---|---|---|"]
    key = {(r["impl"], r["bytes"], r["inplace"]): r for r in rows}
    for size in sorted({r["bytes"] for r in rows}):
        for inplace in (False, True):
            f, t = key.get(("fused", size, inplace)), key.get(("torch", size, inplace))
            if f and t:
                lines.append(f"| {size} | {'yes' if inplace else 'no'} | {f['busbw_GBps']:.3f} | "
                             f"{t['busbw_GBps']:.3f} | **{f['busbw_GBps'] / t['busbw_GBps']:.3f}** | "
                             f"{f['wrong'] + t['wrong']} |")
    return "\n".join(lines)


# -- summary over repeated runs -------------------------------------------------------------------
def summarise_runs(datas, impl="fused"):
    """Per (model, first, cap): lists over runs, and their medians. `impl`: the FusedReducer row
    compared with DDP ('fused', or 'tuned' for --autotune runs)."""
    out = {}
    for data in datas:
        for r in data["rows"]:
            if r["impl"] != impl:
                continue
            key = (r["model"], r["first_bucket_mb"], r["bucket_cap_mb"])
            ddp = next(d for d in data["rows"] if d["impl"] == "ddp" and d["model"] == r["model"]
                       and d["first_bucket_mb"] == r["first_bucket_mb"]
                       and d["bucket_cap_mb"] == r["bucket_cap_mb"])
            e = out.setdefault(key, {"model": r["model"], "first": r["first_bucket_mb"],
                                     "cap": r["bucket_cap_mb"], "params": r.get("params"),
                                     "tensors": r.get("tensors"), "buckets": len(r["bucket_sizes"]),
                                     "runs": []})
            tel = r.get("telemetry") or {}
            default = next((d for d in data["rows"] if d["impl"] == "ddp_default"
                            and d["model"] == r["model"]
                            and d["first_bucket_mb"] == r["first_bucket_mb"]
                            and d["bucket_cap_mb"] == r["bucket_cap_mb"]), None)
            e["best"] = e.get("best", True) and "constructed_as" in ddp
            e["runs"].append({"ddp_ms": ddp["median_ms"], "fr_ms": r["median_ms"],
                              "ddp_default_ms": default["median_ms"] if default else None,
                              "ratio_default": r.get("ratio_to_ddp_default"),
                              "ratio": r["ratio_to_ddp"], "aa": r.get("aa_ratio"),
                              "ci": r.get("ratio_ci90"),
                              "exp_ddp": ddp["exposed_comm_ms"], "exp_fr": r["exposed_comm_ms"],
                              "exp_fr_tel": tel.get("exposed_ms"),
                              "commit": data["meta"].get("git_commit"),
                              "date": data["meta"]["date"][:10], "steps": r["steps"]})
    for e in out.values():
        runs = e["runs"]
        for k in ("ddp_ms", "fr_ms", "ratio", "exp_ddp", "exp_fr", "exp_fr_tel", "ddp_default_ms",
                  "ratio_default"):
            vals = [x[k] for x in runs if x[k] is not None]
            e[k] = statistics.median(vals) if vals else None
        aas = [x["aa"] for x in runs if x["aa"] is not None]
        e["aa_runs"] = aas
        e["noise"] = max((abs(a - 1) for a in aas), default=None)
    return list(out.values())


def summary_table(datas, impl="fused", targets=False):
    rows = summarise_runs(datas, impl)
    metas = [d["meta"] for d in datas]
    commits = sorted({m.get("git_commit") or "?" for m in metas})
    dates = sorted({m["date"][:16] for m in metas})
    who = "FusedReducer(autotune=True)" if impl == "tuned" else "FusedReducer"
    lines = [f"{len(datas)} run(s), {metas[0]['cpu_count']} cores {metas[0].get('cpu_model', '')}, "
             f"world {metas[0]['world_size']} {metas[0]['backend']} on {metas[0]['device_type']}, "
             f"torch {metas[0]['torch_version']}, commit {', '.join(commits)}, "
             f"{dates[0]} - {dates[-1]} UTC; commands:", ""]
    lines += [f"- `{m['command']}`" for m in metas]
    best = all(e["best"] for e in rows)
    ddp_name = "DDP best" if best else "DDP"
    lines += ["", f"| model | params / tensors | first / cap (MiB), buckets | {ddp_name} ms | "
              f"DDP default ms | {who} ms | ratio to {ddp_name} (median of runs) | ratio per run | "
              "ratio to DDP default | A/A per run (DDP/DDP) | exposed comm ms "
              f"{ddp_name} / FR (probe) / FR (telemetry) | commit | date |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        per_run = ", ".join(f"{x['ratio']:.3f}" for x in e["runs"])
        aa_runs = ", ".join(f"{a:.3f}" for a in e["aa_runs"]) or "-"
        commits = ", ".join(sorted({x["commit"] or "?" for x in e["runs"]}))
        days = ", ".join(sorted({x["date"] for x in e["runs"]}))
        lines.append(
            f"| {e['model']} | {e['params'] / 1e6:.2f}M / {e['tensors']} | {e['first']:g} / "
            f"{e['cap']:g}, {e['buckets']} | {e['ddp_ms']:.1f} | {fmt(e['ddp_default_ms'])} | "
            f"{e['fr_ms']:.1f} | **{e['ratio']:.3f}** | {per_run} | "
            f"{'-' if e['ratio_default'] is None else format(e['ratio_default'], '.3f')} | "
            f"{aa_runs} | {fmt(e['exp_ddp'])} / "
            f"{fmt(e['exp_fr'])} / {fmt(e['exp_fr_tel'])} | {commits} | {days} |")
    gm = statistics.geometric_mean(e["ratio"] for e in rows) if rows else float("nan")
    noise = max((e["noise"] for e in rows if e["noise"] is not None), default=None)
    defaults = [e["ratio_default"] for e in rows if e["ratio_default"] is not None]
    gm_default = (f" (to DDP default: {statistics.geometric_mean(defaults):.3f})"
                  if defaults and len(defaults) == len(rows) else "")
    lines += ["", f"Geometric mean of the per-model median ratios to {ddp_name}: **{gm:.3f}** over "
              f"{len(rows)} models{gm_default}. A/A noise band: largest |DDP/DDP - 1| of any run "
              + ("-" if noise is None else f"{noise:.3f}") + "."]
    if targets:
        lines += ["", "| model | ratio <= 1 within noise | exposed comm <= DDP's |", "|---|---|---|"]
        for e in rows:
            band = e["noise"] or 0.0
            lines.append(f"| {e['model']} | {'yes' if e['ratio'] <= 1 + band else 'NO'} "
                         f"({e['ratio']:.3f} vs 1 + {band:.3f}) | "
                         f"{'yes' if e['exp_fr'] <= e['exp_ddp'] else 'NO'} "
                         f"({e['exp_fr']:.1f} vs {e['exp_ddp']:.1f}) |")
        lines.append(f"| geometric mean <= 0.95 | {'yes' if gm <= 0.95 else 'NO'} ({gm:.3f}) | |")
    return "\n".join(lines)


def step_bars(datas, path):
    """Grouped bars: per model, each wrapper's median step (ms) with its p90 as a whisker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for d in datas for r in d["rows"]]
    models = list(dict.fromkeys(r["model"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(models), 3.6))
    for k, impl in enumerate(impls):
        got = {r["model"]: r for r in rows if r["impl"] == impl}
        xs = [i + (k - (len(impls) - 1) / 2) * width for i, m in enumerate(models) if m in got]
        med = [got[m]["median_ms"] for m in models if m in got]
        p90 = [got[m]["p90_ms"] - got[m]["median_ms"] for m in models if m in got]
        ax.bar(xs, med, width, yerr=[[0] * len(p90), p90], capsize=2,
               label=impl_name(next(iter(got.values()))))
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("median step (ms; whisker: p90)")
    meta = datas[0]["meta"]
    ax.set_title(f"{meta.get('command', 'step_bench')[:90]}\n{meta['date'][:10]}, world "
                 f"{meta['world_size']} {meta['backend']}", fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render_trace(trace_path, png_path, title=None):
    """Timeline picture of a FusedReducer Chrome trace: one row per trace row (step, backward,
    bucket 0, 1, ...), bars for its complete events, time in ms."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    tids = sorted(names)
    row = {tid: len(tids) - 1 - i for i, tid in enumerate(tids)}
    t0 = min(e["ts"] for e in spans)
    colors = {"step": "#d9d9d9", "backward": "#9ecae1", "end of backward": "#fdae6b",
              "fill": "#c7e9c0", "copy in": "#74c476", "all-reduce": "#3182bd",
              "exposed wait": "#e6550d"}

    def kind(name):
        for k in ("all-reduce", "step"):
            if name.startswith(k):
                return k
        return name

    fig, ax = plt.subplots(figsize=(12, 0.45 * len(tids) + 1.6))
    for e in spans:
        k = kind(e["name"])
        nested = k == "exposed wait"
        y = row[e["tid"]] + (0.05 if nested else 0)
        height = 0.4 if nested else 0.8
        ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)], (y - 0.4, height),
                       facecolors=colors.get(k, "#999999"), edgecolors="none")
    ax.set_yticks([row[t] for t in tids], [names[t] for t in tids])
    ax.set_xlabel("time since the first forward in the trace (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.18 if len(tids) < 8 else -0.1), ncol=7, fontsize=8,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="JSON files written by the benchmarks")
    parser.add_argument("--summary", action="store_true",
                        help="one table over repeated step_bench runs (one row per model)")
    parser.add_argument("--impl", choices=("fused", "tuned", "fused_pg"), default="fused",
                        help="with --summary: compare FusedReducer (fused), the autotuned "
                             "FusedReducer (tuned) or FusedReducer on the process group "
                             "(fused_pg, step_bench --fused-pg) with DDP")
    parser.add_argument("--targets", action="store_true",
                        help="with --summary: add the issue-10 acceptance checks")
    parser.add_argument("--bars", metavar="FILE.png",
                        help="also a bar chart of median step time per model and wrapper (the "
                             "step_bench JSON files given), e.g. of a --reduce-dtype run")
    args = parser.parse_args(argv)
    datas = [json.load(open(p)) for p in args.paths]
    if args.bars:
        step_bars([d for d in datas if d["meta"].get("benchmark") == "step_bench"], args.bars)
    if args.summary:
        print(summary_table(datas, args.impl, args.targets))
        return 0
    for data in datas:
        bench = data["meta"].get("benchmark", "")
        print(step_table(data) if bench == "step_bench" else
              memory_table(data) if bench == "memory_bench" else bw_table(data))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
