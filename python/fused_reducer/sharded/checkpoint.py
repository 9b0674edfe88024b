"""Sharded checkpoints of a ShardedOptimizer through torch.distributed.checkpoint (DCP): each rank
writes only its own fragments, and a job at another world size or bucket layout reads back the
pieces it needs.

    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    ...
    sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    opt.load_sharded_state_dict(sd["optim"])

Note [Sharded checkpoint format]
What ``opt.sharded_state_dict()`` returns, as DCP sees it:

    {"optimizer": "AdamW",                       # the torch optimizer's class name
     "param_groups": [{"params": [fqn, ...], "lr": ..., ...}],   # the plain optimizer's groups,
                                                  # parameters by qualified name
     "has_state": {fqn: bool},                    # whether the parameter has optimizer state
     "state": {fqn: {"exp_avg": flat, "step": tensor(7.), ...}}}

Every per-element state (moments, Adagrad's sum, the fp32 "master_param" of master_dtype) is one
flat tensor of the parameter's numel, in the parameter's memory order (row-major for a contiguous
parameter). A rank holds one stretch of it: the fragment it owns in the bucket layout in force,
or an even split when no sharded layout exists yet (a fresh optimizer before its first forward).
The stretch is a plain tensor carrying DCP's CheckpointableTensor fields (global_shape,
global_offsets, ...), so DCP writes it as that chunk of the flat tensor and, on load, reads
exactly the overlapping parts of whatever chunks were saved: this is what makes a checkpoint
resume at another world size or layout. Scalar state (Adam's step, NAdam's mu_product) is the
same on every rank holding the parameter and is saved once (DCP deduplicates it).

A parameter without state (no gradient yet) still has every key, as zeros, because a load must
name its keys before it reads anything; "has_state" says to drop them again on load. Each
rank's dict names only the parameters it holds a stretch of; the keys a fresh optimizer
expects come from stepping a throwaway one-element copy of the optimizer with lr 0
(state_template).

Saving hands DCP views of the live state (nothing is copied). Loading into a fresh optimizer fills
fresh tensors that load_sharded_state_dict adopts; into an optimizer that already has state,
dcp.load writes that state in place (as torch's own optimizer state dicts for DCP): a load that
fails half-way then leaves it partly overwritten. ``load_checkpoint`` checks the checkpoint's
metadata (names, shapes, optimizer class, every rank's file) before reading anything.

The same format comes from and goes to a plain torch optimizer (``plain_optimizer_state_dict``
and ``load_plain_optimizer_state_dict``): a DCP checkpoint of a ShardedOptimizer loads into a
plain optimizer under DDP or in one process, and one saved under DDP loads into a ShardedOptimizer.
"""
import os

import torch
import torch.distributed as dist

from ..errors import ShardedOptimizerError

FORMAT_KEYS = ("optimizer", "param_groups", "has_state", "state")


# -- the pieces DCP sees --------------------------------------------------------------------------

def as_piece(tensor, numel, begin):
    """`tensor`, elements [begin, begin + len) of a flat tensor of `numel` elements, as a DCP
    CheckpointableTensor. A view carries the fields, so the optimizer's own tensor stays plain."""
    piece = tensor.view(-1)
    piece.global_shape = (numel,)
    piece.global_offsets = ((begin,),)
    piece.local_offsets = ((0,),)
    piece.local_sizes = ((piece.numel(),),)
    return piece


def piece_range(piece):
    """(begin, end) of a piece within its flat tensor."""
    if hasattr(piece, "global_offsets"):
        begin = piece.global_offsets[0][0]
        return begin, begin + piece.numel()
    return 0, piece.numel()  # a plain tensor: the whole flat tensor


def even_range(numel, world, rank):
    """Rank `rank`'s stretch of `numel` elements split evenly (torch.chunk's rule); None if empty."""
    chunk = -(-numel // world)
    begin, end = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    return (begin, end) if begin < end else None


def storage_order(tensor):
    """A 1-D view of a dense tensor in the order its elements sit in memory."""
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def per_element(key, value, param):
    """Whether optimizer state `key` of `param` holds one value per element (moments, masters)
    rather than one for the parameter (a step count, NAdam's mu_product). A 0-dim parameter's
    moments are 0-dim too: there only the key tells."""
    if not torch.is_tensor(value):
        return False
    return value.dim() > 0 if param.dim() > 0 else key not in ("step", "mu_product")


def state_template(optimizer_class, options, dtype, device):
    """{key: (per-element, example)}: the state `optimizer_class` keeps for a parameter of `dtype`
    once it has stepped, found by stepping a throwaway two-element parameter with lr 0."""
    options = dict(options)
    if "lr" in options:
        options["lr"] = torch.tensor(0.0) if torch.is_tensor(options["lr"]) else 0.0
    probe = torch.zeros(2, dtype=dtype, device=device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    throwaway = optimizer_class([dict(options, params=[probe])])  # the group's own options
    throwaway.step()
    return {key: (per_element(key, value, probe), value)
            for key, value in throwaway.state[probe].items()}


def template_entry(template, numel, begin, end, device):
    """Zeros of every key of `template` for elements [begin, end): what a load fills."""
    entry = {}
    for key, (elementwise, example) in template.items():
        if elementwise:
            entry[key] = as_piece(torch.zeros(end - begin, dtype=example.dtype, device=device),
                                  numel, begin)
        else:
            entry[key] = example.clone() if torch.is_tensor(example) else example
    return entry


def groups_by_name(param_groups, name_of):
    """The optimizer's param_groups with each parameter as its qualified name."""
    return [dict({k: v for k, v in group.items() if k != "params"},
                 params=[name_of[id(p)] for p in group["params"]]) for group in param_groups]


def check_loadable(optimizer_class, param_groups, name_of, sd):
    """Raise, naming what differs, when `sd` (a dict in this format, after dcp.load) is not a
    checkpoint of this optimizer class over these parameters. Changes nothing."""
    missing = [k for k in FORMAT_KEYS if k not in sd]
    if missing:
        raise ShardedOptimizerError(
            f"load_sharded_state_dict: the dict lacks {missing}; pass the dict that "
            "opt.sharded_state_dict() returned, after dcp.load filled it")
    check_same_optimizer(optimizer_class, param_groups, name_of, sd)


def check_same_optimizer(optimizer_class, param_groups, name_of, sd):
    """The optimizer class and the parameter groups (by name) of `sd` are these."""
    if sd["optimizer"] != optimizer_class.__name__:
        raise ShardedOptimizerError(
            f"load_sharded_state_dict: the checkpoint holds {sd['optimizer']} state, this "
            f"optimizer is {optimizer_class.__name__}; load it into a {sd['optimizer']}")
    ours = [[name_of[id(p)] for p in group["params"]] for group in param_groups]
    theirs = [list(group["params"]) for group in sd["param_groups"]]
    if len(ours) != len(theirs):
        raise ShardedOptimizerError(
            f"load_sharded_state_dict: the checkpoint has {len(theirs)} parameter groups, this "
            f"optimizer {len(ours)}")
    for g, (mine, saved) in enumerate(zip(ours, theirs)):
        if mine != saved:
            only_mine = sorted(set(mine) - set(saved))[:3]
            only_saved = sorted(set(saved) - set(mine))[:3]
            raise ShardedOptimizerError(
                f"load_sharded_state_dict: parameter group {g} differs from the checkpoint's: "
                f"here only {only_mine}, there only {only_saved}"
                + ("" if only_mine or only_saved else " (same names, another order)")
                + "; a checkpoint loads into the same model with the same groups")


def apply_group_options(param_groups, sd):
    """The checkpoint's hyperparameters win (lr, betas, ...), as torch's load_state_dict."""
    for group, saved in zip(param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


# -- a plain torch optimizer ----------------------------------------------------------------------

def names_of(module):
    return {id(p): name for name, p in module.named_parameters()}


def plain_optimizer_state_dict(module, optimizer):
    """The sharded checkpoint format (Note [Sharded checkpoint format]) of a plain torch optimizer
    over `module`'s parameters, e.g. under DDP (every rank holds the whole state: DCP writes it
    once). Views of the live state where it exists."""
    name_of = names_of(module)
    state, has_state = {}, {}
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        template = None
        for p in group["params"]:
            if not p.requires_grad:
                continue
            name, live = name_of[id(p)], optimizer.state.get(p)
            has_state[name] = bool(live)
            if live:
                state[name] = {k: (storage_order(dense_like(v, p)) if per_element(k, v, p)
                                   else v) for k, v in live.items()}
            else:
                template = template or state_template(type(optimizer), options, p.dtype,
                                                       p.device)
                state[name] = template_entry(template, p.numel(), 0, p.numel(), p.device)
    return {"optimizer": type(optimizer).__name__,
            "param_groups": groups_by_name(optimizer.param_groups, name_of),
            "has_state": has_state, "state": state}


def dense_like(value, param):
    """`value` (shaped like `param`) laid out as `param` is in memory (a copy only if not)."""
    if value.shape == param.shape and value.stride() == param.stride():
        return value
    return torch.empty_like(param, dtype=value.dtype).copy_(value)


def load_plain_optimizer_state_dict(module, optimizer, sd):
    """Load a dict of the sharded checkpoint format (filled by dcp.load from
    plain_optimizer_state_dict(module, optimizer) or opt.sharded_state_dict()) into a plain torch
    optimizer. A ShardedOptimizer's "master_param" is dropped (the parameters are the model's)."""
    name_of = names_of(module)
    check_loadable(type(optimizer), optimizer.param_groups, name_of, sd)
    position = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            position[name_of[id(p)]] = (len(position), p)
    state = {}
    for name, entry in sd["state"].items():
        if not sd["has_state"].get(name):
            continue
        index, p = position[name]
        mine = {}
        for key, value in entry.items():
            if key == "master_param":
                continue
            if per_element(key, value, p):
                shaped = torch.empty_like(p, dtype=value.dtype)
                storage_order(shaped).copy_(value)
                mine[key] = shaped
            else:
                mine[key] = value
        state[index] = mine
    plain = {"state": state,
             "param_groups": [dict({k: v for k, v in saved.items() if k != "params"},
                                   params=[position[n][0] for n in saved["params"]])
                              for saved in sd["param_groups"]]}
    # torch casts floating state to the parameter's dtype; keep the checkpoint's dtypes as the
    # ShardedOptimizer does (fp32 moments of bf16 parameters)
    optimizer.load_state_dict(plain)
    for index, mine in state.items():
        p = [q for group in optimizer.param_groups for q in group["params"]][index]
        for key, value in mine.items():
            if torch.is_tensor(value) and value.dim() > 0:
                optimizer.state[p][key] = value.to(p.device)


# -- checking a checkpoint before reading it -------------------------------------------------------

def check_checkpoint(checkpoint_id, sd):
    """Raise naming what differs if the DCP checkpoint at `checkpoint_id` (a directory written by
    dcp.save) cannot fill `sd`: a key missing, a shape or a kind that differs, a rank's file that
    is absent. Reads only the checkpoint's metadata; changes nothing."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(checkpoint_id).read_metadata()
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(sd)
    problems = []
    for key, value in flat.items():
        if key not in saved:
            problems.append(f"'{key}' is not in the checkpoint")
        elif torch.is_tensor(value):
            if isinstance(saved[key], BytesStorageMetadata):
                problems.append(f"'{key}' is a tensor here, a Python value in the checkpoint")
                continue
            size = getattr(value, "global_shape", None) or tuple(value.shape)
            if tuple(saved[key].size) != tuple(size):
                problems.append(f"'{key}' has shape {tuple(saved[key].size)} in the checkpoint, "
                                f"{tuple(size)} here")
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    absent = [f for f in files if not os.path.exists(os.path.join(checkpoint_id, f))]
    if absent:
        problems.append(f"the checkpoint's files {absent} are missing (a rank's part of the "
                        "save; copy every file of the checkpoint directory)")
    if problems:
        raise ShardedOptimizerError(
            f"the checkpoint at {checkpoint_id} does not fit this model and optimizer: "
            + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)"
                                        if len(problems) > 5 else "")
            + ". Nothing was loaded.")


def _drop_masters_not_saved(checkpoint_id, sd):
    """Master weights turned on since the save: the checkpoint has no "master_param", and the
    masters start from the loaded parameters (as in a new ShardedOptimizer)."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    for name, entry in sd["optim"]["state"].items():
        if "master_param" in entry and f"optim.state.{name}.master_param" not in saved:
            del entry["master_param"]


def load_checkpoint(checkpoint_id, model, optimizer, process_group=None):
    """Load a checkpoint saved as {"model": model.state_dict(), "optim":
    optimizer.sharded_state_dict()} after checking it fits (check_checkpoint): a checkpoint of
    another model, another optimizer class or missing a rank's file raises and loads nothing.
    Collective over the model's ranks."""
    import torch.distributed.checkpoint as dcp

    # Fresh tensors for the optimizer's part, which load_sharded_state_dict adopts only once
    # all is read; the model's are its parameters, written by dcp.load: so every check first.
    sd = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict(fresh=True)}
    name_of = names_of(model)
    _drop_masters_not_saved(checkpoint_id, sd)
    # The optimizer's class and groups are Python values, not in the metadata: read them alone.
    identity = {"optim": {"optimizer": "", "param_groups": sd["optim"]["param_groups"]}}
    failure = None
    try:
        check_checkpoint(checkpoint_id, sd)
        dcp.load(identity, checkpoint_id=checkpoint_id, process_group=process_group)
        check_same_optimizer(type(optimizer) if not hasattr(optimizer, "optimizer_class")
                             else optimizer.optimizer_class, optimizer.param_groups, name_of,
                             identity["optim"])
    except ShardedOptimizerError as e:
        failure = str(e)
    # every rank decides together: one rank's missing file must stop all of them
    verdicts = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(verdicts, failure, group=process_group)
    failures = [v for v in verdicts if v]
    if failures:
        raise ShardedOptimizerError(failures[0])
    dcp.load(sd, checkpoint_id=checkpoint_id, process_group=process_group)
    model.load_state_dict(sd["model"])
    optimizer.load_sharded_state_dict(sd["optim"])
