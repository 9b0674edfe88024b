"""Mutation entries for the sharded checkpoints (issue 41); same format as
scripts/mutations.py's MUTATIONS. The code: python/fused_reducer/sharded/checkpoint.py (the
format, Note [Sharded checkpoint format]) and the ShardedOptimizer's side of it
(sharded_state_dict, load_sharded_state_dict, the move of state between layouts); tests in
tests/test_sharded_checkpoint.py. Also the ShardedOptimizer's division by the microbatches under a
pipeline schedule (issue 48; tests in tests/test_pipeline_parallel.py).
"""

CHECKPOINT_PY = "python/fused_reducer/sharded/checkpoint.py"
SHARDED_PY = "python/fused_reducer/sharded/optimizer.py"
C = "tests/test_sharded_checkpoint.py::"
PIPELINE = "tests/test_pipeline_parallel.py::"
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
    dict(
        id="sharded-divide-gradients-in-the-bucket",
        file=SHARDED_PY,
        edits=[("                    f.opt.grad.div_(divisor)",
                "                    self.model._attachment.reducer.bucket_flats()[f.bucket]"
                "[f.at:f.at + (f.end - f.begin)].div_(divisor)")],
        why="divide_gradients (a pipeline stage's scaling by the number of microbatches) divides "
            "the shard in the bucket instead of the fragment's gradient: the same where the "
            "gradient is a view of the bucket, lost where it is an fp32 copy (reduce_dtype=bf16, "
            "bf16 parameters with fp32 masters): each parameter moves 4 times as far",
        tests=[PIPELINE + "test_sharded_optimizer_under_1f1b_with_bf16_reduction_"
                          "divides_by_the_microbatches",
               PIPELINE + "test_sharded_optimizer_under_1f1b_with_master_weights_"
                          "divides_by_the_microbatches"],
    ),
    dict(
        id="checkpoint-hyperparameters-not-restored",
        file=SHARDED_PY,
        edits=[("        checkpoint.apply_group_options(self.param_groups, state_dict)\n", "")],
        why="load_sharded_state_dict keeps the constructor's hyperparameters instead of the "
            "checkpoint's: a job saved after its lr decayed resumes with the initial lr",
        tests=[C + "test_a_resume_takes_the_checkpoints_hyperparameters_over_the_constructors"],
    ),
    dict(
        id="checkpoint-plain-load-has-state-by-key",
        file=CHECKPOINT_PY,
        edits=[('        if not sd["has_state"].get(name):',
                '        if name not in sd["has_state"]:')],
        why="load_plain_optimizer_state_dict asks whether a parameter is named in has_state, not "
            "whether it has state: a parameter saved without state gets the format's zeros "
            "(SGD with dampening starts its buffer below the gradient, Rprop never moves)",
        tests=[C + "test_a_parameter_without_state_loads_into_a_plain_optimizer_without_state",
               C + "test_a_checkpoint_saved_before_any_step_resumes_as_fresh_optimizers"],
    ),
    dict(
        id="checkpoint-plain-load-reshapes-channels-last",
        file=CHECKPOINT_PY,
        edits=[("                storage_order(shaped).copy_(value)",
                "                shaped.reshape(-1).copy_(value)")],
        why="load_plain_optimizer_state_dict writes a flat state into a reshape of the new "
            "tensor instead of its storage order: for a channels_last parameter the reshape is a "
            "copy, and the loaded moments stay uninitialised memory",
        tests=[C + "test_a_checkpoint_of_channels_last_parameters_loads_into_a_plain_optimizer"],
    ),
]
