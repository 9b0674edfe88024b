"""Tuning, above the core: the cost model, the transport probe, profiles, the planner and its
command line (python -m fused_reducer.plan), the runtime autotuner (observes the wrapper's forward
through core.wrapper.ForwardObserver) and the Chrome trace export."""
