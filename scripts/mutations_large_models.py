"""Mutation entries for large models (issue 40); same format as scripts/mutations.py's
MUTATIONS. The code: python/fused_reducer/core/tensor_parallel.py (Note [DTensor parameters]),
the re-arm of several forwards before their backwards in core/wrapper.py (Note [Several forwards
before their backwards]) and fused_reducer.pipelining's stage (pipelining.py, Note
[Split backward]); tests in tests/test_tensor_parallel.py, tests/test_forwards_before_backwards.py
tests/test_pipeline_parallel.py and tests/test_3d_parallel.py.
"""

TP_PY = "python/fused_reducer/core/tensor_parallel.py"
ARMING_PY = "python/fused_reducer/core/backward_arming.py"
PIPELINING_PY = "python/fused_reducer/pipelining.py"
AUTOTUNE_PY = "python/fused_reducer/tuning/autotune.py"
TP = "tests/test_tensor_parallel.py::"
FB = "tests/test_forwards_before_backwards.py::"
PP = "tests/test_pipeline_parallel.py::"
D3 = "tests/test_3d_parallel.py::"

MUTATIONS = [
    dict(
        id="tp-sharded-norm-part-not-summed-over-tp",
        file=TP_PY,
        edits=[("                dist.all_reduce(part, op=op, group=mesh.get_group(dim))",
                "                pass")],
        why="the global norm of DTensor gradients counts only this rank's shard of each "
            "tensor-parallel parameter: clip_grad_norm_ clips by a norm torch would not compute",
        tests=[TP + "test_norm_from_the_copy_is_torchs_dtensor_norm"],
    ),
    dict(
        id="tp-norm-from-the-copy-counts-replicated-twice",
        file=TP_PY,
        edits=[("            parts[1] = copied if norm_type == math.inf else max(copied - float(parts[0]), 0.0)",
                "            parts[1] = copied")],
        why="the norm from the copy puts the replicated parameters' share in the sharded part "
            "too: they count once per TP rank and once more",
        tests=[TP + "test_norm_from_the_copy_is_torchs_dtensor_norm"],
    ),
    dict(
        id="tp-zero-grad-not-seen-by-the-leaf",
        file=TP_PY,
        edits=[("            if grad is None:\n                e.leaf.grad = None\n",
                "            if grad is None:\n                pass\n")],
        why="after optimizer.zero_grad(set_to_none=True) the reducer's leaf keeps last step's "
            "gradient: the next backward accumulates onto it and every step after the first "
            "applies the sum of all the steps so far",
        tests=[TP + "test_tp_times_dp_matches_float64_global_batch_and_ddp"],
    ),
    dict(
        id="several-forwards-arm-not-renewed",
        file=ARMING_PY,
        edits=[("        if self.armed(reducer):\n            return\n        if attachment.sharded:",
                "        if True:\n            return\n        if attachment.sharded:")],
        why="a second backward of forwards run outside no_sync() stays local as under DDP: "
            "param.grad = avg(g1) + g2, silently wrong",
        tests=[FB + "test_several_forwards_before_backwards_match_the_float64_global_batch[gpipe]"],
    ),
    dict(
        id="split-backward-last-weight-half-not-armed",
        file=PIPELINING_PY,
        edits=[("        if reduce:\n            self.submod.prepare_for_backward()\n",
                "        if False:\n            self.submod.prepare_for_backward()\n")],
        why="the step's last weight half runs unarmed: its gradients stay local and no bucket "
            "of a split stage is reduced (each DP rank steps on its own gradients)",
        tests=[PP + "test_interleaved_zero_bubble_split_backward_is_exact_with_one_reduction_per_bucket"],
    ),
    dict(
        id="split-backward-groups-in-forward-order",
        file=PIPELINING_PY,
        edits=[("key=lambda item: -item[0]", "key=lambda item: item[0]")],
        why="the last weight half computes the first layer's weight gradients first: the "
            "buckets (laid out last layer first) fill only at its end, so the reduction no "
            "longer overlaps it",
        tests=[PP + "test_zero_bubble_reduction_starts_while_the_last_weight_half_runs"],
    ),
    dict(
        id="split-backward-intermediates-not-clamped",
        file=PIPELINING_PY,
        edits=[("for node, grads in zip(intermediates, saved)] if len(intermediates) > 1 else [])",
                "for node, grads in zip(intermediates, saved)] if False else [])")],
        why="a weight used twice in a stage: the gradient reaching one of its intermediates "
            "through the other is added to the saved one, counted twice",
        tests=[PP + "test_zero_bubble_with_each_weight_used_twice_is_exact"],
    ),
    dict(
        id="split-backward-overlapped-with-find-unused",
        file=PIPELINING_PY,
        edits=[("            reduce = last_backward and not self.submod.find_unused_parameters",
                "            reduce = last_backward")],
        why="with find_unused_parameters the end of the first group's weight backward decides "
            "the later groups' parameters unused: their gradients are averaged as zeros",
        tests=[PP + "test_zero_bubble_with_find_unused_parameters_is_exact_with_one_reduction_per_bucket"],
    ),
    dict(
        id="split-backward-input-half-given-the-dtensor-parameters",
        file=PIPELINING_PY,
        edits=[('bwd_kwargs["input_values"], iter(leaves))',
                'bwd_kwargs["input_values"], self.submod.parameters())')],
        why="torch's input half is given the module's DTensor parameters, whose gradient "
            "accumulators are not in the graph (it holds FusedReducer's plain leaves): the "
            "tensor-parallel weights of a split stage get no gradient at all",
        tests=[D3 + "test_tp_pp_dp_zero_bubble_split_backward_matches_float64_with_one_reduction_per_bucket"],
    ),
    dict(
        id="split-backward-dtensor-grads-not-republished",
        file=PIPELINING_PY,
        edits=[("        self.submod.attachment.publish_gradients()\n\n    def _leaves",
                "\n    def _leaves")],
        why="after a weight half the DTensor parameters' .grad still views the old (or no) "
            "local gradient: the next forward's hand-over back to the leaves drops what the "
            "weight halves accumulated",
        tests=[D3 + "test_tp_pp_dp_zero_bubble_split_backward_matches_float64_with_one_reduction_per_bucket"],
    ),
    dict(
        id="pipeline-scaling-on-released-gradients",
        file=PIPELINING_PY,
        edits=[("        if optimizer is None:\n            return super().scale_grads(grad_scale_factor)",
                "        if True:\n            return super().scale_grads(grad_scale_factor)")],
        why="a pipeline schedule's scaling by microbatches divides param.grad, which a "
            "ShardedOptimizer has released (a placeholder): every step of PP with ZeRO-1 fails",
        tests=[PP + "test_sharded_optimizer_under_1f1b_is_exact_with_one_reduction_per_bucket"],
    ),
    dict(
        id="autotune-predictions-anchored-on-the-reduced-backward",
        file=AUTOTUNE_PY,
        edits=[("        observed_ms = _observed_step_ms(history, last_step_ms)",
                "        observed_ms = (last[\"finalize_end_us\"] - last[\"forward_us\"]) / 1e3 if last else 0.0")],
        why="autotune's predicted step times are anchored on the recorded forward-to-written-back "
            "span, which for a pipeline stage is the reduced last microbatch's backward only: "
            "its predictions read 6x below the schedule steps the trials measure",
        tests=[D3 + "test_autotune_on_a_pipeline_stage_measures_and_stays_exact"],
    ),
    dict(
        id="tp-sharded-inf-norm-summed-over-dp",
        file=TP_PY,
        edits=[("        dist.all_reduce(parts, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=dp_group)",
                "        dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=dp_group)")],
        why="a ShardedOptimizer's inf-norm of a tensor-parallel model adds the DP ranks' largest "
            "|g| instead of taking the largest: clip_grad_norm_(norm_type=inf) clips by a norm "
            "torch would not compute (only the 2-norm was checked)",
        tests=[TP + "test_sharded_optimizer_with_dtensor_parameters_reports_the_global_1_and_inf_norms"],
    ),
    dict(
        id="tp-tied-parameter-swapped-in-one-owner-only",
        file=TP_PY,
        edits=[("for e in self.entries.values() for owner, attr in e.owners]",
                "for e in self.entries.values() for owner, attr in e.owners[:1]]")],
        why="a DTensor parameter tied between two modules is replaced by the leaf's view in its "
            "first owner only: the other use's gradient lands on the DTensor parameter and is "
            "overwritten when the leaf's gradient is published (one use's gradient dropped)",
        tests=[TP + "test_dtensor_parameter_tied_between_two_modules_gets_both_uses_gradients"],
    ),
    dict(
        id="tp-published-gradient-kept-for-a-new-bucket-view",
        file=TP_PY,
        edits=[("                if grad is e.published_from and (current is None or current is e.published):",
                "                if e.published_from is not None and (current is None or current is e.published):")],
        why="P.grad keeps the DTensor published at the last backward though the leaf's gradient is "
            "a new tensor (gradient_as_bucket_view: the rebuild after the first step makes new "
            "bucket views): P.grad shows the old bucket's values, not this step's average",
        tests=[TP + "test_dtensor_views_and_gradients_are_not_rebuilt_every_step"],
    ),
    dict(
        id="tp-gradient-published-through-from-local",
        file=TP_PY,
        edits=[("        return DTensor(local_grad, self.param._spec, requires_grad=False)",
                "        return DTensor.from_local(local_grad, self.param.device_mesh, self.param.placements,\n"
                "                                  run_check=False, shape=self.param.shape,\n"
                "                                  stride=self.param.stride())")],
        why="each backward publishes P.grad through DTensor.from_local (a new spec and an autograd "
            "Function per parameter, about 10 times the constructor's cost): the same values, the "
            "per-step Python cost Note [One pass per step] removed",
        tests=[TP + "test_dtensor_views_and_gradients_are_not_rebuilt_every_step"],
    ),
    dict(
        id="tp-hand-set-grad-not-adopted",
        file=TP_PY,
        edits=[("                if e.leaf.grad is None or local_grad.data_ptr() != e.leaf.grad.data_ptr():",
                "                if e.leaf.grad is None:")],
        why="a DTensor parameter's .grad set by hand before a forward is not handed to the "
            "reducer's leaf: the backward accumulates onto the last step's gradient instead",
        tests=[TP + "test_dtensor_gradients_kept_or_set_by_hand_are_accumulated_onto"],
    ),
    dict(
        id="split-backward-find-unused-zeros-into-the-dtensor-parameters",
        file=PIPELINING_PY,
        edits=[("            reduced = self.submod.attachment.params[::-1]",
                "            reduced = self.submod.attachment.module_params[::-1]")],
        why="with find_unused_parameters REDUCE_GRAD's backward of zeros goes into the module's "
            "DTensor parameters, not the reducer's leaves: no gradient hook fires, the split "
            "stages' weight gradients are never averaged and the DP ranks diverge",
        tests=[TP + "test_tp_stages_split_backward_with_find_unused_parameters_stay_exact_and_in_step"],
    ),
]
