"""Mutation entries for fault-tolerant data parallelism (issue 47); same format as
scripts/mutations.py's MUTATIONS. The code: python/fused_reducer/torchft.py (Note [Layout agreed
through the quorum], the heal's reducer_state); tests in tests/test_fault_tolerance.py, the
in-process ones (a stand-in Manager), which fail in seconds.
"""

FT_PY = "python/fused_reducer/torchft.py"
FT = "tests/test_fault_tolerance.py::"

MUTATIONS = [
    dict(
        id="ft-agreement-keeps-a-limit-set-on-one-replica",
        file=FT_PY,
        edits=[('    if not agreed["rebuilds"] and (mine["rebuilds"], mine["limits"]) == '
                '(False, agreed["limits"]):',
                '    if not agreed["rebuilds"]:')],
        why="a limit set on a replica other than quorum rank 0 is kept there: its next forward "
            "rebuilds with its own limits, its buckets no longer pair with the others' (a size "
            "error in the Manager's all-reduce, or buckets of one size holding other parameters)",
        tests=[FT + "test_forward_agrees_limits_and_order_with_quorum_rank_0"],
    ),
    dict(
        id="ft-agreement-rebuilds-from-its-own-order",
        file=FT_PY,
        edits=[('    _rebuild_as(model, caps, last_bucket_bytes, reduce_dtype, agreed["order"])',
                '    _rebuild_as(model, caps, last_bucket_bytes, reduce_dtype, mine["order"])')],
        why="a rebuild takes quorum rank 0's limits but this replica's own gradient-ready order: "
            "where the replicas observed different orders their layouts differ",
        tests=[FT + "test_forward_agrees_limits_and_order_with_quorum_rank_0"],
    ),
    dict(
        id="ft-agreement-every-replica-writes-its-row",
        file=FT_PY,
        edits=[("    wire = own.clone() if manager.participating_rank() == 0 else "
                "torch.zeros_like(own)",
                "    wire = own.clone()")],
        why="every participant writes its row into the agreement's sum: the sum of rows is no "
            "replica's limits or order (with two replicas the 'present' field is 2 and nothing "
            "is ever agreed)",
        tests=[FT + "test_forward_agrees_limits_and_order_with_quorum_rank_0"],
    ),
    dict(
        id="ft-heal-state-ignores-a-pending-rebuild",
        file=FT_PY,
        edits=[("    if reducer.rebuild_pending():\n        # That forward rebuilds",
                "    if False:\n        # That forward rebuilds")],
        why="the state a healing replica receives, and the order the agreement sends, is the "
            "layout in force even where the next forward rebuilds from the last ready order: the "
            "first step's rebuild rebuilds the initial layout on every replica (DDP's rebuild by "
            "the observed order is lost), and a replica healed there gets that layout",
        tests=[FT + "test_heal_after_the_first_step_gives_the_layout_the_live_replica_rebuilds"],
    ),
]
