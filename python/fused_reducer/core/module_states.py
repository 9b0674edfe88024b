"""Which of a module's tensors the reducer averages and which it broadcasts, as DDP decides."""


def _ignored(module):
    """The names DDP._set_params_and_buffers_to_ignore_for_model(module, names) set: parameters
    and buffers that stay rank-local (not reduced, not broadcast), as DDP leaves them. DDP
    matches a top-level parameter as ".name"; both spellings count here."""
    names = set(getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ())
    return names | {name[1:] for name in names if name.startswith(".")}


def reduced_parameters(module):
    """(name, parameter) of what the reducer averages: trainable, not ignored."""
    ignored = _ignored(module)
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]


def synced_states(module, buffers, parameters=True):
    """What DDP broadcasts from one rank to the others (at construction, after join): every
    parameter (frozen ones too) and, with `buffers`, every buffer, except the ignored ones."""
    ignored = _ignored(module)
    states = [p.detach() for n, p in module.named_parameters() if n not in ignored] if parameters else []
    if buffers:
        states += [b for n, b in module.named_buffers() if n not in ignored]
    return states


def will_sync_buffers(model):
    """Whether this forward of `model` (a FusedReducer) broadcasts the buffers, by DDP's rule:
    not after a forward that did not synchronise (no_sync, no_grad). A cheap early exit per
    forward; synced_states leaves out the ignored ones."""
    return model.forward_sync_buffers and model.require_forward_param_sync and any(
        True for _ in model.module.buffers())
