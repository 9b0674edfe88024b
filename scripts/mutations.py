"""The mutation list of `bash scripts/mutants.sh` (logic in scripts/mutants.py, docs/TESTING.md).

Each entry is one small, plausible bug, planted alone in a scratch copy of the tree:

    id       short name, used by `--only`
    file     path relative to the repository root
    edits    [(original, replacement), ...]: every `original` must occur exactly once in the
             file (else the mutation is reported STALE: the code changed, update the entry)
    why      what a developer could plausibly get wrong, and what a user would then see
    tests    pytest node ids (or files), cheapest and most direct first; run in this order with
             -x, the first failure is the kill. Module fixtures spawn once per file, so ids of
             one file cost one spawn.
    gpu      (optional) only observable on the NCCL path: reported NOT RUN without a CUDA build
             and two GPUs.

Keep snippets short but unique, and keep the list honest: a mutation that cannot change
behaviour (equivalent) does not belong here; replace it with one that can.
"""

REDUCER_CPP = "ext/reducer.cpp"
REDUCER_PY = "python/fused_reducer/core/wrapper.py"
VALIDATION_PY = "python/fused_reducer/core/validation.py"
ATTACHMENT_PY = "python/fused_reducer/core/attachment.py"
ARMING_PY = "python/fused_reducer/core/backward_arming.py"
CONFIG_PY = "python/fused_reducer/core/config.py"
COPIES_PY = "python/fused_reducer/core/copies.py"
MODULE_STATES_PY = "python/fused_reducer/core/module_states.py"
NORMS_PY = "python/fused_reducer/core/norms.py"
REPORTS_PY = "python/fused_reducer/core/reports.py"
BUFFERS = "tests/test_buffers.py::"
CLOSE = "tests/test_close.py::"
COPIES = "tests/test_pickle_and_copy.py::"
HISTORY = "tests/test_step_history.py::"
HOOKS = "tests/test_comm_hook_results.py::"
JOIN = "tests/test_join_hook.py::"
LIGHTNING = "tests/test_lightning_strategy_settings.py::"
NO_SYNC = "tests/test_no_sync.py::"
PLAN = "tests/test_plan.py::"
PROFILE = "tests/test_profile_unequal_ranks.py::"
RANK0 = "tests/test_rank0_decides.py::"
REBUILDS = "tests/test_bucket_rebuilds.py::"
ROUTE = "tests/test_gradient_route.py::"
UNUSED = "tests/test_unused_parameters.py::"
EQ = "tests/test_equivalence_ddp.py::"
BEH = "tests/test_implicit_ddp_behaviours.py::"
SHM = "tests/test_shm_transport.py::"

MUTATIONS = [
    # -- C++: the gradient path --------------------------------------------------------------------
    dict(
        id="scale-1-over-world",
        file=REDUCER_CPP,
        edits=[("  return 1.0 / static_cast<double>(gradient_divisor());\n}",
                "  return 1.0;\n}")],
        why="the copy into the bucket forgets the 1/world_size scale: every rank gets the SUM "
            "of the gradients, training diverges by a factor world_size",
        tests=[EQ + "test_fp32_grads_match_ddp_with_default_cap[world2]"],
    ),
    dict(
        id="launch-completion-order",
        file=REDUCER_CPP,
        edits=[("  while (next_to_launch_ < count && progress_[next_to_launch_].pending == 0) {\n"
                "    const size_t index = next_to_launch_++;",
                "  for (size_t index = 0; index < count; ++index) {\n"
                "    if (progress_[index].pending != 0) continue;\n"
                "    progress_[index].pending = -1;  // launched\n"
                "    ++next_to_launch_;")],
        why="a bucket is launched as soon as it is complete instead of strictly in order: ranks "
            "whose gradients become ready in different orders pair different buckets in the "
            "collective (wrong sums when the sizes match, a hang when they do not)",
        tests=[ROUTE + "test_buckets_launch_in_layout_order_when_ranks_complete_them_differently",
               "tests/test_bucket_layout.py"],
    ),
    dict(
        id="skip-layout-broadcast",
        file="ext/bucket_layout.cpp",
        edits=[("  auto work = group_->broadcast(tensors, broadcast);",
                "  std::vector<at::Tensor> sent{tensors[0].clone()};\n"
                "  auto work = group_->broadcast(sent, broadcast);  // rank 0's inputs land in a copy")],
        why="the rebuild uses each rank's own observed order and limits instead of rank 0's: "
            "layouts differ across ranks whenever ready orders differ",
        tests=[RANK0 + "test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves",
               "tests/test_bucket_layout.py::test_rebuilt_layout_follows_rank0_ready_order_on_every_rank"],
    ),
    dict(
        id="rank0-limits-ignored",
        file="ext/bucket_layout.cpp",
        edits=[("  rank0.bucket_caps_bytes.assign(data + kHeader, data + kHeader + data[0]);\n"
                "  rank0.last_bucket_bytes = data[1];\n",
                "  rank0.bucket_caps_bytes = limits.bucket_caps_bytes;\n"
                "  rank0.last_bucket_bytes = limits.last_bucket_bytes;\n")],
        why="the rebuild takes rank 0's order but keeps this rank's own limits: ranks that set "
            "different limits build different layouts",
        tests=[RANK0 + "test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves",
               "tests/test_bucket_layout.py::test_limits_that_differ_by_rank_resolve_to_rank0_values_at_rebuild"],
    ),
    dict(
        id="unused-param-not-zero-filled",
        file=REDUCER_CPP,
        edits=[("    jobs.push_back({at::Tensor(), view, index});  // an unused parameter contributes zeros",
                "    (void)view;  // an unused parameter contributes zeros")],
        why="a locally unused parameter's slot is not zeroed: it contributes whatever the slot "
            "held (last step's reduced gradient) to the others' average",
        tests=[EQ + "test_unused_and_rank_dependent_params_match_ddp_find_unused[world2]"],
    ),
    dict(
        id="limits-not-persistent",
        file="ext/bucket_layout.cpp",
        edits=[("  std::copy(limits.bucket_caps_bytes.begin(), limits.bucket_caps_bytes.begin() + ncaps,\n"
                "            data + kHeader);",
                "  std::copy(limits.bucket_caps_bytes.begin(), limits.bucket_caps_bytes.begin() + ncaps,\n"
                "            data + kHeader);\n"
                "  data[kHeader] = int64_t{1} << 20;  // DDP's kDefaultFirstBucketBytes")],
        why="DDP's own bug: rebuilds use the 1 MiB constant, so a first bucket set at "
            "construction or at runtime is lost at the first rebuild",
        tests=[REBUILDS + "test_first_bucket_limit_survives_every_rebuild"],
    ),
    dict(
        id="used-map-forgets-no-sync",
        file=REDUCER_CPP,
        edits=[("    if (!sync_enabled_ && params_[index].grad().defined()) {\n"
                "      unused_.mark_used(index);\n"
                "    }\n"
                "    check_not_decided_unused(index);",
                "    check_not_decided_unused(index);")],
        why="find_unused_parameters: a parameter used only in no_sync micro-steps counts as "
            "unused at the synchronised step, its accumulated gradient is not averaged",
        tests=[NO_SYNC + "test_usage_inside_no_sync_counts_for_find_unused_parameters"],
    ),
    dict(
        id="unarmed-backward-reduced",
        file=REDUCER_CPP,
        edits=[("  if (!expect_hooks_) {\n"
                "    // A backward that no synchronised FusedReducer.forward armed",
                "  if (false) {\n"
                "    // A backward that no synchronised FusedReducer.forward armed")],
        why="a backward that no synchronised forward armed (the inner module called directly, a "
            "second backward of one graph) is reduced: DDP keeps those gradients local",
        tests=[ROUTE + "test_backward_of_the_inner_module_stays_local"],
    ),
    dict(
        id="contiguous-slot-views",
        file="ext/bucket_layout.cpp",
        edits=[("          param.is_non_overlapping_and_dense()\n"
                "              ? bucket.flat.as_strided",
                "          false\n"
                "              ? bucket.flat.as_strided")],
        why="bucket slots are contiguous instead of keeping the parameter's strides: "
            "channels_last gradients become strided copies, gradient_as_bucket_view changes "
            "their memory format",
        tests=[REBUILDS + "test_bucket_view_grads_are_16_byte_aligned_and_keep_the_parameters_strides",
               "tests/test_cuda_path_cpu.py::test_slots_are_16_byte_aligned_keep_strides_and_match_ddp"],
    ),
    dict(
        id="slot-alignment-removed",
        file="ext/bucket_layout.cpp",
        edits=[("constexpr int64_t kSlotAlignBytes = 16;", "constexpr int64_t kSlotAlignBytes = 1;")],
        why="slots are packed element by element: only the first slot of a bucket starts on a "
            "16-byte boundary, the fused copy kernel loses its vector path",
        tests=[REBUILDS + "test_bucket_view_grads_are_16_byte_aligned_and_keep_the_parameters_strides",
               "tests/test_cuda_path_cpu.py::test_slots_are_16_byte_aligned_keep_strides_and_match_ddp"],
    ),
    dict(
        id="copy-at-hook-skipped",
        file=REDUCER_CPP,
        edits=[("  copy_at_hook_ = !params_.front().is_cuda();", "  copy_at_hook_ = false;")],
        why="CPU gradients are no longer copied into their slot at their own hook but when the "
            "bucket is complete: an in-place change to an earlier gradient by a later hook of "
            "the same backward leaks into the average (DDP copies at the hook)",
        tests=[ROUTE + "test_gradient_is_copied_into_its_slot_at_its_own_hook_like_ddp"],
    ),
    dict(
        id="packed-flag-not-reset",
        file=REDUCER_CPP,
        edits=[("  packed_.assign(params_.size(), 0);", "  packed_.resize(params_.size(), 0);")],
        why="resize instead of assign: the 'already copied at its hook' flag survives into the "
            "next step, so a parameter unused in that step keeps last step's slot contents "
            "instead of zeros",
        tests=[EQ + "test_unused_and_rank_dependent_params_match_ddp_find_unused[world2]"],
    ),
    dict(
        id="early-unpack-with-find-unused",
        file=REDUCER_CPP,
        edits=[("  if (!options_.find_unused_parameters) {\n    unpack_completed_buckets();",
                "  if (true) {\n    unpack_completed_buckets();")],
        why="reduced buckets are unpacked during backward also with find_unused_parameters, "
            "before the used map is known: a parameter no rank used gets a zero gradient "
            "instead of keeping grad None (DDP)",
        tests=[UNUSED + "test_globally_unused_parameter_keeps_grad_none_when_its_bucket_finishes_early"],
    ),
    dict(
        id="nonview-unpack-gives-view",
        file=REDUCER_CPP,
        edits=[("    if (!grad.defined() && options_.gradient_as_bucket_view) {\n      grad = view;",
                "    if (!grad.defined()) {\n      grad = view;")],
        why="without gradient_as_bucket_view, param.grad becomes a view of the bucket anyway: "
            "the next step's collective overwrites gradients the user still holds",
        tests=[ROUTE + "test_without_bucket_view_grads_are_private_copies"],
    ),
    dict(
        id="timeout-ignored-in-wait",
        file=REDUCER_CPP,
        edits=[("    collective->wait(options_.timeout);\n  } catch (const std::exception& e) {\n"
                "    wait_for_launched_quietly();\n    TORCH_CHECK(false, \"FusedReducer: all-reduce of bucket \"",
                "    collective->wait(std::chrono::minutes(10));\n  } catch (const std::exception& e) {\n"
                "    wait_for_launched_quietly();\n    TORCH_CHECK(false, \"FusedReducer: all-reduce of bucket \"")],
        why="the wait for a bucket ignores timeout=: a stalled live peer is waited for 10 "
            "minutes (the default) instead of raising after the user's timeout",
        tests=[ROUTE + "test_timeout_bounds_the_wait_for_a_stalled_peer"],
    ),
    dict(
        id="comm-hook-gets-scaled-buckets",
        file=REDUCER_CPP,
        edits=[("  if (comm_hook_) {\n    return 1.0;\n  }", "  if (false) {\n    return 1.0;\n  }")],
        why="gradient_scale() forgets that a DDP comm hook averages itself: gradients are "
            "divided by world_size twice",
        tests=["tests/test_ddp_comm_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets"],
    ),
    dict(
        id="average-after-the-sum",
        file=REDUCER_CPP,
        edits=[("  if (comm_hook_) {\n    return 1.0;\n  }\n  return 1.0 / static_cast<double>(gradient_divisor());",
                "  return 1.0;"),
               ("  wait_for_bucket(index);\n  const BucketTiming& timing",
                "  wait_for_bucket(index);\n  if (!comm_hook_) buckets()[index].flat.mul_(1.0 / gradient_divisor());\n"
                "  const BucketTiming& timing")],
        why="ncclAvg's arithmetic restored: buckets summed unscaled, then multiplied by 1/n in "
            "the bucket's dtype (a second rounding; not DDP's bits at 3 ranks, and in bf16/fp16 "
            "a bias), instead of scaling each gradient in the copy",
        tests=["tests/test_exactness.py::test_fp32_averages_are_ddps_arithmetic_scaled_in_the_copy_then_summed"],
    ),
    dict(
        id="bucket-view-multiplied-not-divided",
        file=REDUCER_CPP,
        edits=[("        view.div_(gradient_divisor());", "        view.mul_(gradient_scale());")],
        why="a gradient that is its bucket view (gradient_as_bucket_view) is multiplied by "
            "1/n instead of divided by n: 1 ulp away from DDP's bits on 3 ranks",
        tests=["tests/test_exactness.py::test_fp32_averages_are_ddps_arithmetic_scaled_in_the_copy_then_summed"],
    ),
    dict(
        id="step-ends-with-the-nested-backward",
        file=REDUCER_PY,
        edits=[("                find_unused=self.find_unused_parameters and self._require_forward_param_sync,",
                "                find_unused=False,")],
        why="find_unused_parameters decides unused parameters when the first backward with a "
            "hook ends: with reentrant checkpointing of the last layer that is the nested "
            "backward, and every rank gets the same wrong gradients (issue 19: 79 % off)",
        tests=["tests/test_exactness.py::test_reentrant_checkpoint_of_last_layer_with_find_unused_parameters_is_exact",
               "tests/test_graph_shapes.py"],
    ),
    dict(
        id="late-hook-of-an-unused-parameter-ignored",
        file=REDUCER_CPP,
        edits=[("  if (!finished_since_forward_ || !decided_unused_[index] || finalized_graph_task_ < 0) {",
                "  if (true) {")],
        why="where the outputs cannot be hooked, a parameter decided unused whose gradient "
            "arrives later in the enclosing backward is silently averaged as zero",
        tests=["tests/test_exactness.py::test_outputs_hidden_from_fused_reducer_make_the_late_gradient_raise_on_every_rank"],
    ),
    dict(
        id="outputs-only-backward-ends-the-step",
        file=REDUCER_CPP,
        edits=[("  if (ready_order_.empty()) {\n    // A backward that reached the outputs but no parameter",
                "  if (false) {\n    // A backward that reached the outputs but no parameter")],
        why="a gradient penalty's torch.autograd.grad reaches the outputs but no parameter; "
            "ending the step there leaves the real backward's gradients local",
        tests=["tests/test_graph_shapes.py"],
    ),
    dict(
        id="no-sync-exit-turns-sync-on",
        file=REDUCER_PY,
        edits=[("        finally:\n            self.require_backward_grad_sync = previous",
                "        finally:\n            self.require_backward_grad_sync = True")],
        why="leaving an inner no_sync() turns syncing on inside an outer one: the backward still "
            "in the outer window is averaged (DDP keeps it local)",
        tests=["tests/test_exactness.py::test_no_sync_nests_like_ddp_and_restores_the_previous_setting_when_the_body_raises"],
    ),

    # -- Python: the module wrapper ------------------------------------------------------------------
    dict(
        id="cpu-copy-loop-unscaled",
        file="ext/bucket_copy.cpp",
        edits=[("      dst[i] = static_cast<Dst>(x * scale);",
                "      dst[i] = static_cast<Dst>(x);")],
        why="the CPU fast path of the bucket copy drops the 1/world_size scale: every fp32 "
            "gradient reaches the all-reduce unscaled, ranks get the sum instead of the average",
        tests=[EQ + "test_fp32_grads_match_ddp_with_default_cap[world2]"],
    ),
    dict(
        id="other-stream-gradients-not-waited",
        file=REDUCER_CPP,
        edits=[("    if (*packing != *produced_on) {", "    if (false) {")],
        why="a bucket packed on one stream reads gradients another stream is still writing "
            "(forward branches on side streams): stale values averaged. CUDA only",
        tests=["tests/test_gpu_ordering.py::test_gradients_from_several_streams_are_packed_after_their_stream"],
        gpu=True,
    ),
    dict(
        id="broadcast-buffers-false-ignored",
        file=MODULE_STATES_PY,
        edits=[("    return model.forward_sync_buffers and model.require_forward_param_sync and any(",
                "    return model.require_forward_param_sync and any(")],
        why="broadcast_buffers=False is ignored: BatchNorm running stats are overwritten with "
            "rank 0's before every forward",
        tests=[BUFFERS + "test_buffer_broadcast_rules_match_ddp"],
    ),
    dict(
        id="buffers-broadcast-after-no-sync",
        file=REDUCER_PY,
        edits=[("        grad_sync = torch.is_grad_enabled() and self._syncing",
                "        grad_sync = torch.is_grad_enabled()")],
        why="DDP's rule broken: buffers are broadcast also before the forward that follows a "
            "no_sync forward, so the running stats of a gradient-accumulation window differ "
            "from DDP's",
        tests=[BUFFERS + "test_buffer_broadcast_rules_match_ddp"],
    ),
    dict(
        id="no-sync-without-finally",
        file=REDUCER_PY,
        edits=[("        try:\n            yield\n        finally:\n"
                "            self.require_backward_grad_sync = previous",
                "        yield\n"
                "        self.require_backward_grad_sync = previous")],
        why="an exception inside `with model.no_sync():` leaves synchronisation off for the "
            "rest of training (DDP restores it in a finally)",
        tests=[NO_SYNC + "test_exception_inside_no_sync_leaves_sync_on"],
    ),
    dict(
        id="timeout-not-passed-to-reducer",
        file=CONFIG_PY,
        edits=[("        options.timeout_seconds = timeout_s\n",
                "        options.timeout_seconds = 600.0\n")],
        why="timeout= reaches the transport but not the C++ reducer: its waits use the default "
            "10 minutes",
        tests=[ROUTE + "test_timeout_bounds_the_wait_for_a_stalled_peer"],
    ),
    dict(
        id="version-counter-bumped",
        file=ATTACHMENT_PY,
        edits=[("        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):",
                "        if True:")],
        why="the buffer broadcast before a second forward bumps the buffers' version counters: "
            "backward of the first forward raises 'modified by an inplace operation' (DDP does "
            "not)",
        tests=[BUFFERS + "test_two_forwards_then_backward_with_a_buffer_saved_for_backward"],
    ),
    dict(
        id="pickle-keeps-process-group",
        file=COPIES_PY,
        edits=[('TRANSIENT = ("process_group", "_attachment", "_arming")',
                'TRANSIENT = ("_attachment", "_arming")')],
        why="pickling/deepcopy keeps the process group: torch.save(model) or copy.deepcopy fail "
            "(a ProcessGroup cannot be pickled), or the copy reuses a group it does not own",
        tests=[COPIES + "test_pickled_and_deep_copied_models_train_like_ddp"],
    ),
    dict(
        id="close-not-idempotent",
        # The wrapper drops its attachment at close(), so a second close() is made harmless
        # by the wrapper's guard (Attachment.close's own guard is reached only by a second
        # close of one attachment, which nothing does): the guard is planted out there.
        file=REDUCER_PY,
        edits=[("        if attachment is not None:\n            attachment.close()",
                "        attachment.close()")],
        why="the second close() (or the atexit/GC one after an explicit close) raises "
            "AttributeError on the released transport",
        tests=[CLOSE + "test_close_is_idempotent_and_final"],
    ),
    dict(
        id="closed-model-reattaches",
        file=REDUCER_PY,
        edits=[("        self._closed = True\n        attachment, self._attachment =",
                "        attachment, self._attachment =")],
        why="a closed model silently re-attaches at the next forward (as after unpickling) "
            "instead of refusing: close() is not final",
        tests=[CLOSE + "test_close_is_idempotent_and_final"],
    ),
    dict(
        id="trace-steps-not-shrinking",
        file=REPORTS_PY,
        edits=[("        if self.attachment is not None:\n"
                "            self.attachment.reducer.set_trace_capacity(steps)",
                "        pass")],
        why="setting trace_steps does not reach the C++ ring: step_history() keeps growing to "
            "the old capacity",
        tests=[HISTORY + "test_trace_steps_bounds_the_step_history"],
    ),
    dict(
        id="join-divide-by-initial-ignored",
        file=REDUCER_PY,
        edits=[("        elif self._divide_by_initial_world_size:",
                "        elif True:")],
        why="join(divide_by_initial_world_size=False) still divides by the initial world size: "
            "after a rank joined, the others' gradients are too small",
        tests=["tests/test_join_uneven_inputs.py::test_join_uneven_inputs_dividing_by_current_world_size_matches_ddp"],
    ),
    dict(
        id="env-overrides-set-default",
        file="python/fused_reducer/settings.py",
        edits=[("    if _default_first_bucket_bytes is not None:\n"
                "        return _default_first_bucket_bytes\n"
                "    raw = os.environ.get(ENV_FIRST_BUCKET_BYTES)\n",
                "    raw = os.environ.get(ENV_FIRST_BUCKET_BYTES)\n"
                "    if _default_first_bucket_bytes is not None and not raw:\n"
                "        return _default_first_bucket_bytes\n")],
        why="FUSED_REDUCER_FIRST_BUCKET_BYTES in the environment overrides an explicit "
            "set_default_first_bucket_bytes() call",
        tests=[REBUILDS + "test_set_default_first_bucket_bytes_wins_over_the_environment"],
    ),
    dict(
        id="join-skips-unused-map",
        file="python/fused_reducer/core/join.py",
        edits=[("        if model.find_unused_parameters:\n            # Not zeros",
                "        if False:\n            # Not zeros")],
        why="a joined rank does not shadow the unused-parameter all-reduce of "
            "find_unused_parameters: the training ranks' map reduction pairs with the joined "
            "rank's next collective",
        tests=[JOIN + "test_a_joined_rank_shadows_each_bucket_then_the_unused_map",
               "tests/test_join_uneven_inputs.py::test_join_uneven_inputs_with_find_unused_parameters_matches_ddp"],
    ),
    dict(
        id="join-used-map-zeros",
        file="ext/unused_parameters.cpp",
        edits=[("  used_map_ = result.device;\n", "")],
        why="a joined rank all-reduces zeros as its used-parameter map, where DDP's joined rank "
            "all-reduces its last one: a parameter the joined rank used last counts as unused "
            "for the others, gets no gradient, and momentum makes the parameters leave DDP's",
        tests=["tests/test_join_uneven_inputs.py::test_join_uneven_inputs_with_find_unused_parameters_matches_ddp"],
    ),
    dict(
        id="reduce-dtype-not-from-rank0",
        file="ext/bucket_layout.cpp",
        edits=[("  rank0.reduce_dtype = data[2] == kNoReduceDtype\n",
                "  rank0.reduce_dtype = limits.reduce_dtype;\n  (void)(data[2] == kNoReduceDtype\n"),
               ("                           : std::optional<at::ScalarType>(static_cast<at::ScalarType>(data[2]));",
                "                           : std::optional<at::ScalarType>(static_cast<at::ScalarType>(data[2])));")],
        why="the reduce dtype does not travel with rank 0's layout: ranks that set different "
            "reduce dtypes all-reduce buckets of different dtypes (garbage or a gloo error)",
        tests=[RANK0 + "test_reduce_dtype_in_force_is_rank0s_on_every_rank_before_any_bucket_moves",
               "tests/test_reduce_dtype.py::test_property_semantics"],
    ),
    dict(
        id="reduce-dtype-ignored-by-bucket",
        file="ext/bucket_layout.cpp",
        edits=[("  if (reduce_dtype && at::isFloatingType(type)) {",
                "  if (false && reduce_dtype && at::isFloatingType(type)) {")],
        why="reduce_dtype is accepted but buckets keep the gradients' dtype: fp32 bytes on the "
            "wire where the user asked for half, silently",
        tests=["tests/test_reduce_dtype.py::test_allreduce_bytes_exactly_half"],
    ),
    dict(
        id="comm-hook-result-dropped",
        file="python/fused_reducer/core/comm_hooks.py",
        edits=[("            with torch.no_grad():\n                flat.copy_(result.view(-1))",
                "            pass")],
        why="a hook's future holding a new tensor (fp16/bf16 compression, PowerSGD) is not "
            "copied back into the bucket: param.grad gets the unreduced local gradient",
        tests=["tests/test_ddp_comm_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets"],
    ),
    dict(
        id="duplicate-gpu-by-index",
        file="python/fused_reducer/transports/transport.py",
        edits=[("        users.setdefault((host, physical), (device, []))[1].append(rank)",
                "        users.setdefault((host, device), (device, []))[1].append(rank)")],
        why="the one-rank-per-GPU check compares the CUDA index instead of the physical GPU: "
            "ranks with different CUDA_VISIBLE_DEVICES that share a GPU pass, distinct GPUs "
            "that are both cuda:0 in their process are refused",
        tests=["tests/test_cuda_path_cpu.py::test_shared_gpus_groups_ranks_by_host_and_physical_gpu"],
    ),
    dict(
        id="autotune-plan-not-from-rank0",
        file="python/fused_reducer/tuning/autotune.py",
        edits=[("        plan = None\n        if self.rank == 0:\n            try:",
                "        plan = None\n        if True:\n            try:"),
               ("        plan = box[0]\n", "        plan = plan  # this rank's own plan\n")],
        why="every rank makes its own tuning plan from its own ready times instead of rank 0's: "
            "ranks measure different trials (and may issue different numbers of collectives)",
        tests=[RANK0 + "test_autotune_plan_and_choice_are_rank0s"],
    ),
    dict(
        id="autotune-step-times-not-agreed",
        file="python/fused_reducer/tuning/autotune.py",
        edits=[("        agreed = control_allreduce(times, dist.ReduceOp.MAX, self.group,\n"
                "                                   self.model.attachment.control_device)\n",
                "        agreed = list(times)\n")],
        why="step times are not the slowest rank's: each rank ranks candidates on its own "
            "timings, so the ranks' decisions can differ",
        tests=[RANK0 + "test_autotune_plan_and_choice_are_rank0s"],
    ),
    # -- the planner -------------------------------------------------------------------------------
    dict(
        id="profile-agreement-on-cpu",
        file="python/fused_reducer/tuning/profile.py",
        edits=[("    control = model.attachment.control_device\n", "    control = \"cpu\"\n")],
        why="export_profile stages its agreements on CPU tensors whatever the group: a plain "
            "NCCL group refuses them, so recording a profile fails on every GPU cluster",
        tests=[PLAN + "test_profile_round_trip"],
    ),
    dict(
        id="planner-copy-back-constant",
        file="python/fused_reducer/tuning/costmodel.py",
        edits=[("        return self.finalize_us * late_bytes / self.finalize_bytes",
                "        return self.finalize_us")],
        why="the copy back after backward stays the recorded layout's for every layout: a layout "
            "with one big last bucket (all copied back at the end) looks as cheap as one whose "
            "buckets were unpacked during backward, and the planner ranks it best (measured: "
            "+14.1 % from the best on `large`)",
        tests=[PLAN + "test_step_adds_forward_copy_back_and_rest"],
    ),
    dict(
        id="planner-anchor-unscaled",
        file="python/fused_reducer/tuning/plan.py",
        edits=[("        self.residual_us = residual_us * compute_scale\n",
                "        self.residual_us = residual_us\n")],
        why="the recorded run's unmodelled time is added at full size after --compute-scale "
            "moved the compute to a faster machine: a CPU profile planned for GPUs carries CPU "
            "milliseconds into every prediction",
        tests=[PLAN + "test_predictions_are_anchored_on_the_measured_step_of_the_recorded_layout"],
    ),
    dict(
        id="planner-overlap-cost-ignored",
        file="python/fused_reducer/tuning/costmodel.py",
        edits=[("        return self.free_us + overlap_cost * self.overlapped_us",
                "        return self.free_us + self.overlapped_us")],
        why="a measured or given overlap cost is read as 'contended': the planner charges "
            "backward all overlapped communication whatever was measured",
        tests=[PLAN + "test_timeline_launches_in_order_one_collective_at_a_time"],
    ),
    dict(
        id="allreduce-bw-waits-each-op",
        file="bench/allreduce_bw.py",
        edits=[("    if queued:\n        for wait in", "    if False:\n        for wait in")],
        why="the bandwidth benchmark waits for every operation although it says it queues them "
            "(nccl-tests' method): each pays a wake-up, the calibration the planner reads is "
            "slower than a step's queued buckets",
        tests=["tests/test_bench.py::test_allreduce_bw_queues_its_timed_operations_unless_told_to_wait"],
    ),
    # -- the shared-memory transport ---------------------------------------------------------
    dict(
        id="shm-sum-drops-last-rank",
        file="ext/shm_segment.h",
        edits=[("    for (size_t r = 2; r < in.size(); ++r) {\n      const T* c = in[r];",
                "    for (size_t r = 2; r + 1 < in.size(); ++r) {\n      const T* c = in[r];")],
        why="the float sum stops one rank early: exact with two ranks, while with three every "
            "fp32 gradient misses the last rank's share",
        tests=["tests/test_shm_transport.py::test_sums_match_float64_and_gloo_across_chunks_and_replicas_are_identical"],
    ),
    dict(
        id="shm-part-misses-a-line",
        file="ext/shm_segment.cpp",
        edits=[("    const int64_t hi = std::min(len, lo + part);",
                "    const int64_t hi = std::min(len, lo + part - per_line);")],
        why="each rank sums one cache line less than its part of the chunk: those elements keep "
            "whatever the result slot held before (another chunk's sums)",
        tests=["tests/test_shm_transport.py::test_sums_match_float64_and_gloo_across_chunks_and_replicas_are_identical"],
    ),
    dict(
        id="shm-no-bucket-size-check",
        file="ext/shm_segment.cpp",
        edits=[("    if (peer_numel != bucket.check_numel || peer_dtype != bucket.check_dtype) {",
                "    if (false) {")],
        why="ranks reducing buckets of different sizes (models that differ) are not told: the "
            "sums silently mix unrelated gradients, or ranks fall out of step and time out",
        tests=["tests/test_shm_transport.py::test_different_buckets_across_ranks_raise_on_every_rank_naming_the_sizes"],
    ),
    dict(
        id="shm-zombie-peer-alive",
        file="ext/shm_segment.cpp",
        edits=[("  if (state == 'Z' || state == 'X') return false;    // exited, not yet reaped",
                "")],
        why="a peer that exited but is not yet reaped (a zombie: kill() still succeeds) counts "
            "as alive: the survivor waits out the whole timeout (10 minutes) instead of raising",
        tests=["tests/test_errors.py::test_peer_dying_mid_step_makes_survivor_raise_promptly_naming_the_bucket"],
    ),
    dict(
        id="shm-close-leaves-peers-waiting",
        file="ext/shm_transport.cpp",
        edits=[("  rt.worker.join();\n  // Peers still waiting for this rank fail at once instead of at their timeout.\n  segment_->stop(rank_);",
                "  rt.worker.join();")],
        why="a rank that closes its FusedReducer does not mark the segment: peers blocked on it "
            "wait out their timeout instead of failing at once naming it",
        tests=["tests/test_shm_transport.py::test_a_peer_that_closes_makes_the_waiting_ranks_raise_promptly_naming_it"],
    ),
    dict(
        id="shm-auto-no-fallback",
        file="python/fused_reducer/transports/transport.py",
        edits=[("        if requested == name:\n            raise RuntimeError(",
                "        if True:\n            raise RuntimeError(")],
        why="backend='auto' raises where shared memory cannot be used (ranks on several hosts, a "
            "full /dev/shm) instead of using the process group: multi-node CPU training breaks",
        tests=["tests/test_shm_transport.py::test_auto_falls_back_to_the_process_group_across_hosts_and_shm_raises"],
    ),
    # -- the shared-memory transport: issue 20 (shared hosts, forks, timeouts, small containers) --
    dict(
        id="shm-forked-child-destroys-runtime",
        file="ext/shm_transport.cpp",
        edits=[("    (void)segment_.release();\n    runtime_ = nullptr;\n    return;\n  }",
                "    (void)segment_.release();\n  }")],
        why="a forked child (a DataLoader worker) that drops its copy of the model destroys the "
            "parent's runtime: a joinable std::thread aborts the child (SIGABRT), or "
            "~condition_variable waits forever for the parent's waiter",
        tests=[SHM + "test_a_forked_child_dropping_the_model_exits_cleanly_and_does_not_disturb_training"],
    ),
    dict(
        id="shm-timeout-does-not-cancel",
        file="ext/shm_transport.cpp",
        edits=[("      // Under the job's lock: the worker is not inside the bucket now and never enters it again.\n      job_->cancel();",
                "      // Under the job's lock: the worker is not inside the bucket now and never enters it again.")],
        why="a wait that timed out leaves its job running: the late sum is written into the "
            "bucket after the caller was told it failed, and the peers take it for a success. "
            "(The worker checks the cancellation three times: in its waits, before it arrives "
            "for the sums and under the job's lock before the copy-out; removing one alone "
            "changes nothing a test can time, so only the cancellation itself is mutated.)",
        tests=[SHM + "test_a_timed_out_wait_cancels_its_all_reduce_on_every_rank"],
    ),
    dict(
        id="shm-attach-ignores-mode",
        file="ext/shm_segment.cpp",
        edits=[("  } else if ((info.st_mode & 07777) != 0600) {", "  } else if (false) {")],
        why="a segment that others can read or write (mode widened by another process, or made "
            "by another user's process under a guessed name) is attached to without complaint",
        tests=[SHM + "test_a_header_rewritten_by_another_process_moves_no_slot_and_a_wide_mode_is_refused"],
    ),
    dict(
        id="shm-slots-from-shared-header",
        file="ext/shm_segment.h",
        edits=[("  char* slot(int set, int index) { return base_ + layout_.slot_offset(set, index); }",
                "  char* slot(int set, int index) {\n"
                "    Layout shared = layout_;\n"
                "    shared.world = header_->world;\n"
                "    shared.chunk_bytes = header_->chunk_bytes;\n"
                "    return base_ + shared.slot_offset(set, index);\n"
                "  }")],
        why="slot offsets are recomputed from the world size and chunk size in the shared "
            "header: a process that rewrites them makes every rank read and write out of bounds",
        tests=[SHM + "test_a_header_rewritten_by_another_process_moves_no_slot_and_a_wide_mode_is_refused"],
    ),
    dict(
        id="shm-close-twice-joins-twice",
        file="ext/shm_transport.cpp",
        edits=[("    if (rt.closing) {  // another thread closes: return once it has",
                "    if (rt.closed) {  // another thread closes: return once it has")],
        why="close() from a second thread while the first still joins the worker joins it again "
            "(std::system_error, or blocks forever)",
        tests=[SHM + "test_close_from_two_threads_at_once_returns_in_both"],
    ),
    dict(
        id="shm-timeout-inf-unclamped",
        file="python/fused_reducer/transports/transport.py",
        edits=[("    return min(seconds, MAX_TIMEOUT_S)", "    return seconds")],
        why="timeout=inf or timedelta.max reach the C++ conversion unclamped: the clamp there "
            "keeps the shm and process-group waits right, but FusedReducer reports and stores a "
            "timeout no wait honours",
        tests=[SHM + "test_infinite_timeouts_mean_no_timeout_and_nan_is_refused"],
    ),
    dict(
        id="shm-parse-outside-rank-error-path",
        file="python/fused_reducer/transports/transport.py",
        edits=[("            try:\n                name, chunk = _parse_created(created)\n",
                "            name, chunk = _parse_created(created)\n            try:\n")],
        why="a malformed segment name from the store raises on that rank outside the per-rank "
            "error path: the other ranks wait for its answer until the store times out",
        tests=[SHM + "test_a_malformed_store_value_on_rank_1_gives_every_rank_an_answer"],
    ),
    dict(
        id="shm-keys-ignore-restart-attempt",
        file="python/fused_reducer/transports/transport.py",
        edits=[('    prefix = f"fused_reducer/{token}/{topic}/{key}/{round_}/"',
                '    prefix = f"fused_reducer/{topic}/{key}/{round_}/"')],
        why="after a torchrun restart the new attempt reads the dead attempt's values from the "
            "launcher's store (a segment name that is gone: silent fallback, or a hang)",
        tests=[SHM + "test_store_keys_of_a_restarted_attempt_do_not_collide_with_the_last_ones"],
    ),
    dict(
        id="shm-sweep-live-segments",
        file="python/fused_reducer/transports/transport.py",
        edits=[("            if os.lstat(path).st_uid != os.geteuid() or not _process_exited(int(match.group(2))):",
                "            if os.lstat(path).st_uid != os.geteuid():")],
        why="the sweep removes segments of live processes too: a job starting on the host "
            "deletes another job's segment during its rendezvous",
        tests=[SHM + "test_segments_of_dead_processes_of_this_user_are_swept_and_live_ones_kept"],
    ),

    # -- issue 19, point 5: slips no test caught ---------------------------------------------
    dict(
        id="unused-here-keeps-bucket-dtype",
        file=REDUCER_CPP,
        edits=[("      grad = at::empty_strided(view.sizes(), view.strides(), params_[index].options());",
                "      grad = at::empty_strided(view.sizes(), view.strides(), view.options());")],
        why="find_unused_parameters with reduce_dtype=bf16: a parameter unused on this rank but used on another gets a bf16 gradient instead of one in its own dtype (the optimizer then mixes dtypes)",
        tests=[UNUSED + "test_unused_here_used_elsewhere_gets_the_average_in_the_parameters_own_dtype"],
    ),
    dict(
        id="rebuild-drops-accumulated-view-grad",
        file="ext/bucket_layout.cpp",
        edits=[("          bucket.views.back().copy_(grad);\n",
                "")],
        why="gradient_as_bucket_view: a rebuild (a limit set by hand or by autotune) between a no_sync micro-step and the synchronised step moves param.grad into the new bucket without its accumulated value",
        tests=[NO_SYNC + "test_bucket_view_limit_change_inside_no_sync_window_keeps_the_accumulated_gradient"],
    ),
    dict(
        id="pickle-swaps-first-and-cap",
        file=COPIES_PY,
        edits=[("            reducer.bucket_caps_bytes, reducer.last_bucket_bytes,",
                "            list(reducer.bucket_caps_bytes)[::-1], reducer.last_bucket_bytes,")],
        why="pickling or deepcopy reverses the list of limits (swaps the first bucket and the cap): the copy trains with other limits than the original",
        tests=[COPIES + "test_pickle_and_deepcopy_keep_first_cap_last_and_reduce_dtype"],
    ),
    dict(
        id="join-forgets-buffer-sync-rule",
        file="python/fused_reducer/core/join.py",
        edits=[("        model.require_forward_param_sync = should_sync\n",
                "")],
        why="join with no_sync accumulation: a joined rank forgets whether the others' forward synchronised, so the BatchNorm buffer broadcasts of joined and training ranks differ from DDP's",
        tests=[JOIN + "test_join_with_no_sync_accumulation_and_batchnorm_matches_ddp_join"],
    ),
    dict(
        id="lightning-timeout-dropped",
        file="python/fused_reducer/lightning.py",
        edits=[('                reducer_kwargs.setdefault("timeout", timeout)',
                '                pass')],
        why="FusedReducerStrategy(timeout=...) never reaches the reducer: a dead peer is waited for 10 minutes instead of the user's timeout",
        tests=[LIGHTNING + "test_lightning_strategy_timeout_reaches_the_reducer_and_its_transport"],
    ),
    # -- the import graph (tests/test_import_layers.py) --------------------------------------------
    dict(
        id="import-circle-lazy",
        file="python/fused_reducer/core/module_states.py",
        edits=[("    ignored = _ignored(module)\n    states = [",
                "    from .wrapper import FusedReducer  # unwrap a wrapped model\n"
                "    module = module.module if isinstance(module, FusedReducer) else module\n"
                "    ignored = _ignored(module)\n    states = [")],
        why="a lazy import inside a function closes a circle (core.wrapper -> core.module_states -> core.wrapper): it imports today, and the next top-level import on that circle fails with a partly initialised module",
        tests=["tests/test_import_layers.py::test_package_modules_import_each_other_without_a_circle"],
    ),
    dict(
        id="import-chain-too-deep",
        file="python/fused_reducer/tuning/costmodel.py",
        edits=[("        from .. import _C\n", "        from ..core.wrapper import _C\n")],
        why="the cost model reaches the extension through the module wrapper: the planner's chain (fused_reducer -> autotune -> plan -> profile -> probe -> costmodel) grows by the whole core, 9 modules deep",
        tests=["tests/test_import_layers.py::test_longest_import_chain_is_at_most_six_modules"],
    ),
    dict(
        id="root-module-an-alias",
        file="python/fused_reducer/plan.py",
        edits=[('if __name__ == "__main__":\n    sys.exit(main())\n',
                'if __name__ == "__main__":\n    sys.exit(main())\n'
                'from .tuning import plan as _module\n\nsys.modules[__name__] = _module\n')],
        why="fused_reducer.plan made a sys.modules alias of tuning/plan.py again: the root's entry point is no longer a module of its own (its __all__ and file are tuning/plan.py's)",
        tests=["tests/test_import_layers.py::test_the_root_holds_the_base_and_the_entry_points_each_a_real_module"],
    ),
    dict(
        id="profile-stretch-inverted",
        file="python/fused_reducer/tuning/profile.py",
        edits=[('stretch = phases["backward_end_us"] / local_backward_us',
                'stretch = local_backward_us / phases["backward_end_us"]')],
        why="export_profile on the faster rank shrinks its ready times instead of stretching them to the slowest rank: the planner sees a backward shorter than the real step",
        tests=[PROFILE + "test_export_profile_on_the_faster_rank_scales_ready_times_to_the_slowest_rank"],
    ),
    dict(
        id="tree-latency-ceil",
        file="python/fused_reducer/tuning/costmodel.py",
        edits=[("int(math.log2(nodes))",
                "math.ceil(math.log2(nodes))")],
        why="the planner's tree latency rounds log2(nodes) up for node counts that are not powers of two: one inter-node hop too many at 3, 5, 6, 7 nodes",
        tests=[PLAN + "test_tree_latency_for_a_node_count_not_a_power_of_two_is_floor_log2_inter_hops"],
    ),
    dict(
        id="comm-hook-list-unwrapped",
        file="python/fused_reducer/core/comm_hooks.py",
        edits=[("        if isinstance(result, (list, tuple)):\n",
                "        if isinstance(result, (list, tuple)) and len(result) == 1:\n            result = result[0]\n        if isinstance(result, (list, tuple)):\n")],
        why="a comm hook whose future holds a one-element list is silently unwrapped where DDP refuses it: code that works here breaks under DDP",
        tests=[HOOKS + "test_comm_hook_future_holding_a_one_element_list_is_refused_like_ddp"],
    ),
    # -- issue 22: DDP 2.14's constructor arguments, per-bucket limits at runtime ---------------
    dict(
        id="caps-list-truncated-at-rebuild",
        file="ext/bucket_layout.cpp",
        edits=[("      std::min<int64_t>(static_cast<int64_t>(limits.bucket_caps_bytes.size()), count);",
                "      std::min<int64_t>(static_cast<int64_t>(limits.bucket_caps_bytes.size()), 2);")],
        why="a rebuild keeps only the first two limits of a longer list: bucket_cap_mb_list / bucket_caps_bytes lose their third entry at the first rebuild",
        tests=["tests/test_ddp_arguments.py::test_bucket_caps_bytes_set_while_training_persists_across_rebuilds_and_rank0_wins"],
    ),
    dict(
        id="first-bucket-setter-drops-the-list",
        file="ext/reducer_settings.cpp",
        edits=[("  caps.front() = bytes;", "  caps = {bytes, caps.back()};")],
        why="setting first_bucket_bytes replaces a list of limits with [first, cap]: the middle limits of bucket_caps_bytes are lost",
        tests=["tests/test_ddp_arguments.py::test_bucket_caps_bytes_set_while_training_persists_across_rebuilds_and_rank0_wins"],
    ),
    dict(
        id="list-first-layout-not-ddps",
        file="ext/bucket_layout.cpp",
        edits=[("  if (ddp_first_layout_) {", "  if (false) {")],
        why="bucket_cap_mb_list's first layout applies the list in launch order instead of DDP's (from the first registered parameter): the first step's buckets differ from DDP's",
        tests=["tests/test_ddp_arguments.py::test_bucket_cap_mb_list_gives_ddps_layout_at_the_first_step_and_after_the_rebuild"],
    ),
    dict(
        id="explicit-cap-keeps-1mib-first-bucket",
        file="python/fused_reducer/settings.py",
        edits=[("    return [cap, cap] if bucket_cap_mb is not None else [DEFAULT_FIRST_BUCKET_BYTES, cap]",
                "    return [DEFAULT_FIRST_BUCKET_BYTES, cap]")],
        why="an explicit bucket_cap_mb keeps a 1 MiB first bucket where torch 2.14's DDP makes it the cap: two all-reduces where DDP does one",
        tests=["tests/test_ddp_arguments.py::test_bucket_cap_mb_list_gives_ddps_layout_at_the_first_step_and_after_the_rebuild"],
    ),
    dict(
        id="forward-sync-buffers-false-skips-init-broadcast",
        file=VALIDATION_PY,
        edits=[("        return bool(forward_sync_buffers), True",
                "        return bool(forward_sync_buffers), bool(forward_sync_buffers)")],
        why="forward_sync_buffers=False also skips the broadcast at construction (DDP's broadcast_buffers=False rule): rank-local buffers where DDP starts from rank 0's",
        tests=["tests/test_ddp_arguments.py::test_broadcast_buffers_and_forward_sync_buffers_combine_as_in_ddp"],
    ),
    dict(
        id="deprecated-broadcast-buffers-wins",
        file=VALIDATION_PY,
        edits=[("    if forward_sync_buffers is not None:\n        return",
                "    if forward_sync_buffers is not None and broadcast_buffers is None:\n        return")],
        why="with both broadcast_buffers and forward_sync_buffers, the deprecated one wins where DDP ignores it",
        tests=["tests/test_ddp_arguments.py::test_broadcast_buffers_and_forward_sync_buffers_combine_as_in_ddp"],
    ),
    dict(
        id="init-sync-false-ignored",
        file=ATTACHMENT_PY,
        edits=[("        if init_sync:\n", "        if True:\n")],
        why="init_sync=False still broadcasts rank 0's parameters at construction: rank-local initialisations are overwritten where DDP keeps them",
        tests=["tests/test_ddp_arguments.py::test_init_sync_false_keeps_rank_local_parameters_like_ddp"],
    ),
    dict(
        id="skipped-bucket-still-reduced",
        file=REDUCER_CPP,
        edits=[("      telemetry_.bucket_skipped(index);\n      continue;  // no collective",
                "      telemetry_.bucket_skipped(index);\n      (void)0;  // no collective")],
        why="skip_all_reduce_unused_params=True still all-reduces the buckets of parameters no rank uses: the bytes it promises to save move anyway",
        tests=["tests/test_ddp_arguments.py::test_skip_all_reduce_unused_params_drops_their_bytes_and_raises_when_the_set_changes"],
    ),
    dict(
        id="skipped-parameter-used-later-ignored",
        file=REDUCER_CPP,
        edits=[("  if (used != nullptr && unused_.any_skipped()) {\n    unused_.check_skipped_still_unused(",
                "  if (false) {\n    unused_.check_skipped_still_unused(")],
        why="a parameter skipped as unused that a rank uses later is silently left unreduced (each rank keeps its own gradient) instead of raising",
        tests=["tests/test_ddp_arguments.py::test_skip_all_reduce_unused_params_drops_their_bytes_and_raises_when_the_set_changes"],
    ),
    dict(
        id="buckets-from-malloc",
        file="ext/bucket_layout.cpp",
        edits=[("  if (!options.device().is_cpu()) {\n    return at::zeros({numel}, options);",
                "  if (true) {\n    return at::zeros({numel}, options);")],
        why="CPU buckets taken from malloc: after limit changes the freed buckets stay resident in glibc's heap (tens of MiB more than DDP's)",
        tests=["tests/test_memory.py::test_cpu_buckets_are_mapped_pages_of_their_own",
               "tests/test_memory.py::test_limit_changes_leave_nothing_resident_behind"],
    ),
    # -- issue 21: the CUDA path's second review ---------------------------------------------------
    dict(
        id="abort-outside-the-communicator-lock",
        file="cuda/nccl_comm.cpp",
        edits=[("void NcclComm::abort() {\n  std::lock_guard<std::mutex> lock(mutex_);\n  abort_locked();",
                "void NcclComm::abort() {\n  abort_locked();")],
        why="the watchdog aborts the communicator while the hook thread is inside ncclAllReduce or "
            "ncclCommGetAsyncError: a use-after-free on exactly the timeout path instead of a clean error",
        tests=["tests/test_cuda_core_fake_nccl.py::test_cuda_core_against_a_fake_nccl"],
    ),
    dict(
        id="aborted-flag-set-after-the-release",
        file="cuda/nccl_comm.cpp",
        edits=[("  aborted_.store(true);  // before the release: see Note [Who may touch the communicator]\n"
                "  comm_ = nullptr;\n  api_->abort(comm);",
                "  comm_ = nullptr;\n  api_->abort(comm);\n  aborted_.store(true);")],
        why="the aborted flag is set only after ncclCommAbort: a thread that checks it in between "
            "calls into a released communicator",
        tests=["tests/test_cuda_core_fake_nccl.py::test_cuda_core_against_a_fake_nccl"],
    ),
    dict(
        id="watchdog-ignores-a-failed-device-selection",
        file="cuda/nccl_comm.cpp",
        edits=[("select_device_(comm_->device()); selected != cudaSuccess) {",
                "select_device_(comm_->device()); false) {")],
        why="the watchdog thread cannot select the communicator's device and goes on silently: its "
            "event queries and abort run on the wrong device, or nothing is watched",
        tests=["tests/test_cuda_core_fake_nccl.py::test_cuda_core_against_a_fake_nccl"],
    ),
    dict(
        id="used-map-read-back-with-a-stream-sync",
        file="ext/used_map.cpp",
        edits=[("  calls_.to_host(host_, map, /*non_blocking=*/true);",
                "  calls_.to_host(host_, map, /*non_blocking=*/false);")],
        why="find_unused_parameters on CUDA reads the used map back with a blocking copy: the host "
            "synchronises the whole stream (cudaStreamSynchronize) instead of one event. CUDA only "
            "(on CPU, tests/cpp/test_core.cpp's fake device catches it under ctest)",
        tests=["tests/test_gpu_ordering.py::test_find_unused_waits_once_on_an_event_for_the_used_map"],
        gpu=True,
    ),
    dict(
        id="nccl-collective-launched-under-capture",
        file="ext/nccl_transport.cpp",
        edits=[("  refuse_under_capture(current.stream(), device_);\n", "")],
        why="a backward under CUDA graph capture records the NCCL all-reduce into the graph; the "
            "watchdog's event queries then break the capture and abort the communicator. CUDA only",
        tests=["tests/test_gpu_ordering.py::test_backward_under_cuda_graph_capture_is_refused_naming_the_fix"],
        gpu=True,
    ),
    # -- issue 23: the sharded optimizer --------------------------------------------------------
    dict(
        id="sharded-shard-offset-off-by-one",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("            lo, hi = rank * shard, (rank + 1) * shard",
                "            lo, hi = rank * shard + 1, (rank + 1) * shard + 1")],
        why="each rank's fragments start one element past its shard: the last element it updates "
            "was reduced by the next rank, so it reads an unreduced gradient there",
        tests=["tests/test_sharded.py::test_every_elementwise_optimizer_matches_ddp_through_a_layout_change"],
    ),
    dict(
        id="sharded-state-not-moved-on-rebuild",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("        if pieces is not None:\n            self._move(pieces)",
                "        if False:\n            self._move(pieces)")],
        why="when the buckets are rebuilt (after the first step, a limit change) the optimizer "
            "state is not moved to the new fragments: momentum and Adam's moments restart",
        tests=["tests/test_sharded.py::test_every_elementwise_optimizer_matches_ddp_through_a_layout_change"],
    ),
    dict(
        id="sharded-clip-norm-without-the-cross-rank-sum",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("            dist.all_reduce(total, group=self.model.process_group)\n", "")],
        why="clip_grad_norm_ clips by this rank's shard's norm, not the global one: every rank "
            "scales its shard differently",
        tests=["tests/test_sharded.py::test_clip_grad_norm_is_ddps_global_norm_and_torch_utilities_reading_param_grad_raise"],
    ),
    dict(
        id="sharded-all-gather-of-a-stale-bucket",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("            mine = self._by_bucket[b]\n", "            mine = []\n")],
        why="the all-gather sends a parameter buffer this rank never filled with its updated "
            "shard: every rank receives stale (uninitialised) parameters",
        tests=["tests/test_sharded.py::test_every_elementwise_optimizer_matches_ddp_through_a_layout_change"],
    ),
    dict(
        id="sharded-local-gradients-kept",
        file=REDUCER_CPP,
        edits=[("  if (sharded_) {\n    release_local_gradients(bucket);\n    return;\n  }",
                "  if (sharded_) {\n    return;\n  }")],
        why="after a sharded backward param.grad keeps this rank's unreduced gradient: "
            "clip_grad_norm_ over model.parameters() silently clips by a local norm",
        tests=["tests/test_sharded.py::test_clip_grad_norm_is_ddps_global_norm_and_torch_utilities_reading_param_grad_raise"],
    ),
    dict(
        id="sharded-released-gradient-left-none",
        file=REDUCER_CPP,
        edits=[("    if (released_gradients_.empty()) {\n      grad.reset();",
                "    if (true) {\n      grad.reset();")],
        why="after a sharded backward param.grad is None: clip_grad_norm_ over model.parameters() "
            "silently returns a zero norm and clips nothing",
        tests=["tests/test_sharded.py::test_clip_grad_norm_is_ddps_global_norm_and_torch_utilities_reading_param_grad_raise"],
    ),
    dict(
        id="sharded-compiled-module-hooks-trusted",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("        self._hooks_traced = _compiled_inside(self.model.module)",
                "        self._hooks_traced = False")],
        why="FusedReducer(torch.compile(module)) with overlap_param_gather: the module pre-hooks "
            "are traced into the graph, so the forward reads parameters whose all-gather is still "
            "in flight",
        tests=["tests/test_sharded.py::test_torch_compile_with_a_sharded_optimizer_matches_compiled_ddp"],
    ),
    dict(
        id="sharded-clip-coefficient-not-clamped",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)",
                "coefficient = max_norm / (total + 1e-6)")],
        why="gradients whose norm is below max_norm are scaled UP to max_norm: small updates "
            "become large ones (survived the whole of test_sharded.py; issue 30)",
        tests=["tests/test_health.py::test_clip_grad_norm_every_norm_type_below_and_above_max_norm_equals_torch_under_ddp[world2]"],
    ),
    dict(
        id="sharded-clip-inf-norm-summed",
        file="python/fused_reducer/sharded/optimizer.py",
        edits=[("dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.model.process_group)",
                "dist.all_reduce(total, group=self.model.process_group)")],
        why="the inf-norm of the shards is summed over ranks instead of maxed: clip_grad_norm_"
            "(norm_type=inf) clips by up to world_size times the real norm (issue 30)",
        tests=["tests/test_health.py::test_clip_grad_norm_every_norm_type_below_and_above_max_norm_equals_torch_under_ddp[world2]"],
    ),
    dict(
        id="clip-from-copy-forgets-the-max",
        file=NORMS_PY,
        edits=[("    return torch.tensor(max_abs, dtype=torch.float64)",
                "    return torch.tensor(sum_abs, dtype=torch.float64)")],
        why="model.clip_grad_norm_(norm_type=inf) from the copy returns the 1-norm",
        tests=["tests/test_health.py::test_clip_grad_norm_every_norm_type_below_and_above_max_norm_equals_torch_under_ddp[world2]"],
    ),
    dict(
        id="nonfinite-not-counted-in-the-cpu-copy",
        file="ext/bucket_copy.cpp",
        edits=[("      if constexpr (kCount) local += std::isfinite(x) ? 0 : 1;\n", "")],
        why="check_finite misses NaN/Inf in fp32 gradients on CPU: the poisoned average spreads "
            "silently, as in DDP",
        tests=["tests/test_health.py::test_a_nonfinite_local_gradient_is_named_on_every_rank_then_training_goes_on_as_ddp[world2]"],
    ),
    dict(
        id="second-backward-of-one-forward-stays-local",
        file=ARMING_PY,
        edits=[("            if synced and (first[0] or model.require_backward_grad_sync):",
                "            if synced and first[0]:")],
        why="backward(retain_graph=True) twice after one forward: the second backward is not "
            "reduced, as under DDP, so param.grad = avg(g) + local g differs across ranks and the "
            "replicas diverge silently",
        tests=["tests/test_errors.py::test_second_backward_of_one_forward_is_averaged_unless_inside_no_sync",
               ROUTE + "test_prepare_for_backward_averages_one_more_backward_of_the_same_forward"],
    ),
    dict(
        id="second-backward-inside-no-sync-reduced",
        file=ARMING_PY,
        edits=[("            if synced and (first[0] or model.require_backward_grad_sync):",
                "            if synced:")],
        why="a second backward of one forward run inside no_sync() is reduced anyway: the "
            "gradient the user asked to keep local is averaged",
        tests=["tests/test_errors.py::test_second_backward_of_one_forward_is_averaged_unless_inside_no_sync",
               ROUTE + "test_prepare_for_backward_averages_one_more_backward_of_the_same_forward"],
    ),
    dict(
        id="model-wrapped-twice-accepted",
        file=REDUCER_PY,
        edits=[("        refuse_wrapped_twice(module, FusedReducer)\n", "")],
        why="FusedReducer(FusedReducer(m)) or FusedReducer(DDP(m)) is accepted: each wrapper "
            "reduces every gradient, twice the traffic per step, no word",
        tests=["tests/test_errors.py::test_a_model_wrapped_twice_is_refused_naming_the_inner_wrapper"],
    ),
    dict(
        id="model-wrapped-twice-seen-only-at-the-root",
        file=VALIDATION_PY,
        edits=[("    for name, sub in module.named_modules():\n        if isinstance(sub, (wrapper_class,",
                "    for name, sub in [('', module)]:\n        if isinstance(sub, (wrapper_class,")],
        why="a FusedReducer inside a submodule of the wrapped model is not seen: its gradients are "
            "reduced twice",
        tests=["tests/test_errors.py::test_a_model_wrapped_twice_is_refused_naming_the_inner_wrapper"],
    ),
]

# Entries kept by area, one file each (same format).
from mutations_norms import MUTATIONS as _NORMS  # noqa: E402
from mutations_checkpoints_profile_elastic import MUTATIONS as _CHECKPOINTS  # noqa: E402
from mutations_health_reports import MUTATIONS as _HEALTH_REPORTS  # noqa: E402
from mutations_sharded_checkpoints import MUTATIONS as _SHARDED_CHECKPOINTS  # noqa: E402
from mutations_large_models import MUTATIONS as _LARGE_MODELS  # noqa: E402
from mutations_fault_tolerance import MUTATIONS as _FAULT_TOLERANCE  # noqa: E402

MUTATIONS += (_NORMS + _CHECKPOINTS + _HEALTH_REPORTS + _SHARDED_CHECKPOINTS + _LARGE_MODELS
              + _FAULT_TOLERANCE)
