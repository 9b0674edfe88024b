"""The step benchmark's heatmap: median step time of DDP and FusedReducer, and their ratio, over
the (first bucket, cap) sweep."""
import common


def heatmap(path, rows, meta, firsts, caps, models):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = (("ddp", "DDP median step (ms)"), ("fused", "FusedReducer median step (ms)"),
              ("ratio", "FusedReducer / DDP"))
    fig, axes = plt.subplots(len(models), 3, figsize=(4.2 * 3 + 1, 3.2 * len(models) + 1),
                             squeeze=False)
    for mi, model in enumerate(models):
        grids = {}
        for key, _ in panels:
            grid = np.full((len(firsts), len(caps)), np.nan)
            for r in rows:
                if r["model"] == model and r["impl"] == ("fused" if key == "ratio" else key):
                    i, j = firsts.index(r["first_bucket_mb"]), caps.index(r["bucket_cap_mb"])
                    grid[i, j] = r["ratio_to_ddp"] if key == "ratio" else r["median_ms"]
            grids[key] = grid
        times = np.concatenate([grids["ddp"].ravel(), grids["fused"].ravel()])
        times = times[np.isfinite(times)]
        ratios = grids["ratio"][np.isfinite(grids["ratio"])]
        spread = max(0.05, float(np.max(np.abs(ratios - 1.0)))) if ratios.size else 0.05
        for pi, (key, title) in enumerate(panels):
            grid = grids[key]
            if key == "ratio":  # green = FusedReducer faster, red = slower, 1.0 in the middle
                cmap, vmin, vmax = plt.get_cmap("RdYlGn_r"), 1 - spread, 1 + spread
            else:  # one scale for DDP and FusedReducer so the colours compare
                cmap = plt.get_cmap("viridis")
                vmin, vmax = (float(times.min()), float(times.max())) if times.size else (0, 1)
                if vmax <= vmin:
                    vmax = vmin + 1e-9
            ax = axes[mi][pi]
            im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, origin="lower", aspect="auto")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
            for i in range(len(firsts)):
                for j in range(len(caps)):
                    value = grid[i, j]
                    if not np.isfinite(value):
                        continue
                    r, g, b, _ = cmap((value - vmin) / (vmax - vmin))
                    ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                    ax.text(j, i, f"{value:.3f}" if key == "ratio" else f"{value:.1f}",
                            ha="center", va="center", fontsize=8, color=ink)
            ax.set_xticks(range(len(caps)), [f"{c:g}" for c in caps])
            ax.set_yticks(range(len(firsts)), [f"{f:g}" for f in firsts])
            ax.set_xlabel("bucket cap (MiB)")
            ax.set_ylabel("first bucket (MiB)")
            ax.set_title(f"{model}: {title}", fontsize=9)
    fig.suptitle(f"step time over (first bucket, cap) - {common.meta_label(meta)}", fontsize=9)
    fig.tight_layout()
    common.ensure_parent(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


