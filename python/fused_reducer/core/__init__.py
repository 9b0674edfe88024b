"""The core: the FusedReducer module wrapper (wrapper.py), its argument validation (validation.py),
the interface helpers get (attachment.py), join, communication hooks and the module's states.
Imports the base (errors, settings) and the transports, never tuning or the integrations."""
