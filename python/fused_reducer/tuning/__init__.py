"""Tuning, above the core: the cost model, the transport probe, profiles, the planner and its
command line (python -m fused_reducer.plan), the runtime autotuner and the Chrome trace export.
The core never imports this layer: the autotuner (a forward observer), the profile export and
the trace export register themselves in core/plugins.py."""
