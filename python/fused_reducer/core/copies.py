"""What a copy of a FusedReducer keeps (pickle, torch.save, copy.copy, copy.deepcopy): like DDP,
not the process group and the reducer; the model attaches again at its first forward
(collective). A copy keeps the settings in force at the time: the limits and reduce dtype set
while training, the sharded mode, a registered comm hook, and with DTensor parameters the name
of its data-parallel group (Note [Copies of DTensor models])."""
# The wrapper's attributes a copy does not take: what only the live attachment can give.
TRANSIENT = ("process_group", "_attachment", "_arming")


def copied_state(state, attachment):
    """The wrapper's `state` (its __dict__) as a copy keeps it, `attachment` the live one."""
    state = dict(state)
    if attachment is not None and attachment.reducer is not None:
        reducer = attachment.reducer
        state["_config"] = state["_config"].with_limits_in_force(
            reducer.bucket_caps_bytes, reducer.last_bucket_bytes, reducer.reduce_dtype)
        state["_attach_sharded"] = attachment.sharded
        if attachment.tensor_parallel:
            state["_dp_group_name"] = attachment.group.group_name
    for transient in TRANSIENT:
        state[transient] = None
    state["_closed"] = False  # a copy of a closed model can be trained (it attaches anew)
    return state

