"""Internal tools of FusedReducer's own tests, benchmarks and scripts: not a public API (no
compatibility promise; users launch with torchrun). Nothing here imports fused_reducer's core."""
