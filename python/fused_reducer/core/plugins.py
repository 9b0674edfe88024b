"""What the layers above plug into the core, so that the core never imports them.

The tuning layer (fused_reducer/tuning) offers FusedReducer three tools: the autotuner, the
profile export and the Chrome trace export. Each registers itself here when its module is
imported (``fused_reducer/__init__.py`` imports them), and FusedReducer's ``autotune()``,
``export_profile()`` and ``export_trace()`` look them up by name. Like DDP's comm hook or join
hook, the interface is small:

* ``"autotuner"``: ``start(model, **options)``, a collective, returns a forward observer
  (below) once every rank accepted the options.
* ``"export_profile"``: ``export(model, path)``, a collective; returns the path written or None.
* ``"export_trace"``: ``export(model, path, steps)``; returns the path written.

A forward observer is what ``model.attachment.tuner`` holds: the wrapper calls ``on_forward()``
once per synchronised step, before the forward runs (it may set the bucket limits for this step:
a safe point); reads ``state`` (``"done"`` once it no longer issues collectives of its own: join
and ShardedOptimizer wait for that); calls ``abandon()`` when a new one replaces it and
``report()`` for ``autotune_report()``.
"""
from ..errors import FusedReducerError

_tools = {}


def provide(name, tool):
    """Register `tool` under `name` (a later registration replaces an earlier one)."""
    _tools[name] = tool
    return tool


def tool(name, caller):
    """The tool registered under `name`; a FusedReducerError naming `caller` if none is."""
    try:
        return _tools[name]
    except KeyError:
        raise FusedReducerError(
            f"{caller}: the tuning layer did not register {name!r}; import fused_reducer (the "
            "package imports fused_reducer.tuning, which registers it)") from None
