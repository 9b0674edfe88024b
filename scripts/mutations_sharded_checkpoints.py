"""Mutation entries for the sharded checkpoints (issue 41); same format as
scripts/mutations.py's MUTATIONS. The code: python/fused_reducer/sharded/checkpoint.py (the
format, Note [Sharded checkpoint format]) and the ShardedOptimizer's side of it
(sharded_state_dict, load_sharded_state_dict, the move of state between layouts); tests in
tests/test_sharded_checkpoint.py.
"""

CHECKPOINT_PY = "python/fused_reducer/sharded/checkpoint.py"
SHARDED_PY = "python/fused_reducer/sharded/optimizer.py"
C = "tests/test_sharded_checkpoint.py::"
RESUME = C + "test_a_checkpoint_resumes_exactly_at_another_world_size_and_layout"

MUTATIONS = [
    dict(
        id="checkpoint-even-split-floors",
        file=CHECKPOINT_PY,
        edits=[("    chunk = -(-numel // world)", "    chunk = numel // world")],
        why="the even split a fresh optimizer loads into (before its first sharded layout) "
            "rounds its stretches down: the last elements of a parameter whose numel the world "
            "size does not divide are never read, and their moments resume as zeros",
        tests=[RESUME + "[AdamW-2to3]"],
    ),
    dict(
        id="checkpoint-move-slices-at-the-bucket-offset",
        file=SHARDED_PY,
        edits=[("                        mine[key] = value[f.begin:f.end].to(f.opt.dtype, copy=True)",
                "                        mine[key] = value[f.at:f.at + f.end - f.begin].to(f.opt.dtype, copy=True)")],
        why="a fragment takes its stretch of the assembled state at its offset in the bucket "
            "instead of in the parameter: every parameter but the first of a shard resumes "
            "with another stretch's moments",
        tests=[RESUME + "[AdamW-2to3]"],
    ),
    dict(
        id="checkpoint-has-state-ignored",
        file=SHARDED_PY,
        edits=[('            if not state_dict["has_state"].get(name) or name not in index_of:',
                "            if name not in index_of:")],
        why="a parameter saved without optimizer state resumes with the zeros written for it: "
            "Rprop's step sizes are then 0 (it never moves) and SGD with dampening starts its "
            "buffer below the gradient",
        tests=[C + "test_a_checkpoint_saved_before_any_step_resumes_as_fresh_optimizers"],
    ),
    dict(
        id="checkpoint-fresh-inverted",
        file=SHARDED_PY,
        edits=[("        live = {} if fresh else self._live_pieces()",
                "        live = self._live_pieces() if fresh else {}")],
        why="sharded_state_dict() of a trained optimizer hands DCP zeros to save instead of its "
            "state (and load_checkpoint's fresh dict is the live state): every resume starts "
            "AdamW over",
        tests=[RESUME + "[AdamW-2to3]", C + "test_a_live_job_rolls_back_to_a_checkpoint_of_another_world_size"],
    ),
    dict(
        id="checkpoint-missing-files-not-checked",
        file=CHECKPOINT_PY,
        edits=[("    absent = [f for f in files if not os.path.exists(os.path.join(checkpoint_id, f))]",
                "    absent = []")],
        why="load_checkpoint no longer checks that every rank's file is there: a checkpoint "
            "missing one fails half-way through dcp.load, after the model was partly overwritten",
        tests=[C + "test_a_checkpoint_that_does_not_fit_raises_naming_what_differs_and_loads_nothing"],
    ),
]
