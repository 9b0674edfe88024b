"""The core: the FusedReducer module wrapper (wrapper.py), its argument and model checks
(validation.py), the interface join, the sharded optimizer and tuning get of it (attachment.py),
the hook points the tuning layer plugs into (plugins.py), join, communication hooks and the
module's states. Imports the base (errors, settings) and the transports, never the layers above."""
