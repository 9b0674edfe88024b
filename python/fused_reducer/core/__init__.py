"""The core: the FusedReducer module wrapper (wrapper.py: DDP's surface) and what it is attached
to (attachment.py: group, transport, C++ reducer, parameters, built from config.py's frozen
ReducerConfig); beside them the argument and model checks (validation.py), which backward is
reduced (backward_arming.py), norms (norms.py), the sharded mode (sharded_mode.py), copies
(copies.py), reports (reports.py), join, communication hooks, the module's states and the hook
points the tuning layer plugs into (plugins.py). Imports the base (errors, settings) and the
transports, never the layers above."""
