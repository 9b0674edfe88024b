"""Markdown tables for docs/PERFORMANCE.md from the benchmarks' JSON files.

    python bench/report.py bench/out/step_cpu.json bench/out/allreduce_bw_cpu.json
"""
import json
import sys


def step_table(data):
    meta = data["meta"]
    lines = [f"`{meta['command']}` ({meta['date'][:16]} UTC, {meta['cpu_count']} cores "
             f"{meta.get('cpu_model', '')}, world {meta['world_size']} {meta['backend']}, "
             f"torch {meta['torch_version']}, commit {meta.get('git_commit')})", "",
             "| model | first / cap (MiB) | impl | median ms | p90 ms | all-reduces/step | MB/step "
             "| exposed comm ms | median / DDP |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['model']} | {r['first_bucket_mb']:g} / {r['bucket_cap_mb']:g} | "
                     f"{'FusedReducer' if r['impl'] == 'fused' else 'DDP'} | {r['median_ms']:.1f} | "
                     f"{r['p90_ms']:.1f} | {r['collectives_per_step']} | {r['bytes_per_step'] / 1e6:.1f} | "
                     f"{r['exposed_comm_ms']:.1f} | **{r['ratio_to_ddp']:.3f}** |")
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


def main(paths):
    for path in paths:
        data = json.load(open(path))
        bench = data["meta"].get("benchmark", "")
        print(step_table(data) if bench == "step_bench" else bw_table(data))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
