"""Mutation entries for one area (issue 38); same format as scripts/mutations.py's MUTATIONS.

The norm from the copy (model.grad_norm / clip_grad_norm_: when it may be used, when torch's
must be) and the ShardedOptimizer's norm (dtype and value); tests in tests/test_grad_norm.py.
"""

REDUCER_CPP = "ext/reducer.cpp"
NORMS_PY = "python/fused_reducer/core/norms.py"
SHARDED_PY = "python/fused_reducer/sharded/optimizer.py"
N = "tests/test_grad_norm.py::"

MUTATIONS = [
    # -- Python: FusedReducer.grad_norm ------------------------------------------------------------
    dict(
        id="norm-fallback-count-at-least",
        # gradient_norm falls back to torch's unless the counts agree: `!=` made `<` is the
        # old `==` made `>=` (the copy used whenever len(grads) >= the reduced count).
        file=NORMS_PY,
        edits=[("    if from_copy is None or len(grads) != _reduced_grads(attachment):",
                "    if from_copy is None or len(grads) < _reduced_grads(attachment):")],
        why="the fallback compares the counts with >= ('every reduced gradient is there'): a "
            "frozen or DDP-ignored parameter holding a .grad is then left out of the norm "
            "(torch's clip over model.parameters() counts it), and clip_grad_norm_ scales by "
            "too small a norm",
        tests=[N + "test_grad_norm_counts_frozen_and_ignored_parameters_holding_a_grad_as_torch_does[world2]"],
    ),
    dict(
        id="norm-reduced-grads-counted-over-module",
        file=NORMS_PY,
        edits=[("    return sum(p.grad is not None for p in attachment.params)",
                "    return sum(p.grad is not None for p in attachment.module.parameters())")],
        why="_reduced_grads counts the gradients of every module parameter instead of the "
            "reduced ones: the counts always agree, so a frozen or ignored parameter's .grad "
            "is silently missing from the norm",
        tests=[N + "test_grad_norm_counts_frozen_and_ignored_parameters_holding_a_grad_as_torch_does[world2]"],
    ),
    dict(
        id="norm-dtype-of-the-first-grad",
        file=NORMS_PY,
        edits=[("    return functools.reduce(torch.promote_types, (g.dtype.to_real() for g in grads))",
                "    return grads[0].dtype.to_real()")],
        why="the norm from the copy is returned in the first gradient's dtype: a model whose "
            "first layer is bfloat16 and the rest float32 gets a bfloat16 norm (torch: float32), "
            "rounded to 8 bits",
        tests=[N + "test_grad_norm_without_a_sharded_optimizer_has_torchs_dtype_and_value_for_every_model[world2]"],
    ),
    # -- C++: Reducer::snapshot_gradients / copy_norms ----------------------------------------------
    dict(
        id="norm-unreduced-kept-grad-trusted",
        file="ext/health_exchange.cpp",
        edits=[("      norms_valid_ = false;  // a gradient no rank produced this step, kept as it was",
                "      (void)0;  // a gradient no rank produced this step, kept as it was")],
        why="a parameter no rank used this step (find_unused_parameters) but whose .grad was "
            "kept from an earlier step is not seen as outside the copy: the norm from the copy "
            "leaves it out, while torch's counts it",
        tests=[N + "test_grad_norm_after_a_step_where_every_rank_skipped_a_branch_that_kept_its_grad_is_torchs_norm_of_param_grad[world2]"],
    ),
    dict(
        id="norm-version-not-compared",
        file="ext/health_exchange.cpp",
        edits=[("    if (impl != grad_snapshot_[i].first || (impl != nullptr && grad._version() != grad_snapshot_[i].second)) {",
                "    if (impl != grad_snapshot_[i].first) {")],
        why="copy_norms trusts the probes alone for an in-place change: one that leaves the "
            "three probed elements as they were (a pruning mask, an edit of a few elements) "
            "returns the stale norm from the copy",
        tests=[N + "test_grad_norm_after_grads_changed_in_place_is_torchs_norm_of_param_grad[world2]"],
    ),
    dict(
        id="norm-tensor-identity-not-compared",
        file="ext/health_exchange.cpp",
        edits=[("    if (impl != grad_snapshot_[i].first || (impl != nullptr && grad._version() != grad_snapshot_[i].second)) {",
                "    if (impl != nullptr && grad._version() != grad_snapshot_[i].second) {")],
        why="copy_norms compares only version counters: param.grad replaced by a new tensor "
            "(version 0, as the unpacked one) that agrees where probed keeps the stale norm",
        tests=[N + "test_grad_norm_after_param_grad_was_replaced_is_torchs_norm_of_the_new_tensors[world2]"],
    ),
    dict(
        id="norm-probes-not-compared",
        file="ext/health_exchange.cpp",
        edits=[("  if (grad_probes_.defined()) {\n    const at::Tensor now = gradient_probes();",
                "  if (false) {\n    const at::Tensor now = gradient_probes();")],
        why="the probes are kept but never compared: changes the version counter misses "
            "(GradScaler.unscale_, p.grad.data.mul_) keep the stale norm from the copy",
        tests=[N + "test_grad_norm_after_changes_without_a_version_bump_is_torchs_norm_of_param_grad[world2]"],
    ),
    dict(
        id="norm-trusted-before-probes-were-taken",
        file="ext/health_exchange.cpp",
        edits=[("  if (!norms_valid_ || !grad_probes_taken_) {",
                "  if (!norms_valid_) {")],
        why="the model's first grad_norm() call uses the copy although that backward kept no "
            "probes: after scaler.unscale_ (no version bump) it returns the scaled norm",
        tests=[N + "test_grad_norm_after_changes_without_a_version_bump_is_torchs_norm_of_param_grad[world2]"],
    ),
    # -- Python: ShardedOptimizer's norm ------------------------------------------------------------
    dict(
        id="sharded-norm-always-float32",
        file=SHARDED_PY,
        edits=[("        return grads, total.cpu().to(self._norm_result_dtype())",
                "        return grads, total.cpu().to(torch.float32)")],
        why="the sharded norm is returned as float32 whatever the parameters: a float64 model's "
            "norm (and the clip coefficient) loses precision and has another dtype than torch's",
        tests=[N + "test_sharded_norm_of_float64_parameters_is_float64_and_torchs_value_under_ddp[world2]"],
    ),
    dict(
        id="sharded-shard-norm-in-its-own-dtype",
        file=SHARDED_PY,
        edits=[("    return torch.promote_types(grad.dtype, torch.float32)",
                "    return grad.dtype")],
        why="each bfloat16 shard's norm is accumulated and returned in bfloat16: the global norm "
            "of a mixed model is off by up to 2**-8 (torch accumulates in float32)",
        tests=[N + "test_sharded_norm_of_a_mixed_bf16_fp32_model_is_float32_and_torchs_value_under_ddp[world2]"],
    ),
    dict(
        id="sharded-norm-dtype-float32-unless-float64",
        file=SHARDED_PY,
        edits=[("        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32",
                "        return torch.float64 if torch.float64 in dtypes else torch.float32")],
        why="the sharded norm's dtype is float32 unless some parameter is float64 (the code "
            "before issue 38): a bfloat16 model gets a float32 norm where torch's under DDP is "
            "bfloat16, and its clip coefficient differs in the last bit",
        tests=[N + "test_sharded_norm_of_a_bf16_model_has_torchs_dtype_and_value_under_ddp[world2]"],
    ),
]
