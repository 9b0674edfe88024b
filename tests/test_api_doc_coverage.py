"""Coverage of the public API: every row of docs/API.md's API table, every row
of its "How it differs from DDP" table and every "same as DDP" / "Identical" / "Differs" promise
has tests that fail when the behaviour changes.

COVERAGE below maps each of them (the page's own words) to those tests, in the files named by the
behaviour they check; test_every_readme_row_and_promise_names_existing_tests re-reads docs/API.md
and fails when a row or promise has no entry, an entry no longer matches the page, or a named test
does not exist. docs/TESTING.md ("API coverage") shows the same map as a table. No spawn.
"""
import ast
import inspect
import os
import re
from datetime import timedelta


HERE = os.path.dirname(os.path.abspath(__file__))


ROOT = os.path.dirname(HERE)


COVERAGE = {
    # API table (first column)
    "`first_bucket_bytes`, `bucket_cap_bytes`": [
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_bucket_rebuilds.py::test_first_bucket_limit_survives_every_rebuild",
        "test_bucket_layout.py::test_limits_that_differ_by_rank_resolve_to_rank0_values_at_rebuild",
        "test_rank0_decides.py::test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves",
        "test_errors.py::test_setters_reject_bad_values_naming_the_setting_and_keep_the_old_value",
        "test_bucket_rebuilds.py::test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
        "test_bucket_rebuilds.py::test_a_limit_set_before_the_first_step_applies_at_the_next_forward",
    ],
    "`bucket_caps_bytes`": [
        "test_ddp_arguments.py::test_bucket_caps_bytes_set_while_training_persists_across_rebuilds_and_rank0_wins",
        "test_bucket_assignment.py::test_a_list_of_limits_matches_python_reference",
    ],
    "`last_bucket_bytes`": [
        "test_autotune.py::test_last_bucket_layout_follows_the_rule_and_grads_match_ddp",
        "test_autotune.py::test_last_bucket_persists_across_rebuilds_and_rank0_value_wins",
        "test_autotune.py::test_last_bucket_bytes_validation",
        "test_bucket_assignment.py::test_assignment_with_last_bucket_matches_python_reference",
    ],
    "`reduce_dtype`": [
        "test_reduce_dtype.py::test_equivalence_with_ddp_compress_hooks",
        "test_reduce_dtype.py::test_allreduce_bytes_exactly_half",
        "test_reduce_dtype.py::test_bucket_limits_count_bytes_of_the_reduce_dtype",
        "test_reduce_dtype.py::test_property_semantics",
        "test_reduce_dtype.py::test_errors_bucket_view_and_bad_values",
        "test_reduce_dtype.py::test_no_sync_accumulates_in_grad_dtype",
        "test_reduce_dtype.py::test_accuracy",
    ],
    "`rebuild_buckets()`": [
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_bucket_rebuilds.py::test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "`autotune=True` / `autotune()` / `autotune_report()`": [
        "test_autotune.py::test_params_match_ddp_throughout_tuning_and_after",
        "test_autotune.py::test_ranks_agree_on_trials_and_choice_and_apply_it",
        "test_autotune.py::test_choice_persists_across_forced_rebuilds",
        "test_autotune.py::test_autotune_method_with_explicit_candidates",
        "test_autotune.py::test_report_format",
        "test_autotune.py::test_tuner_leaves_a_clearly_slow_configuration",
        "test_rank0_decides.py::test_autotune_plan_and_choice_are_rank0s",
        "test_3d_parallel.py::test_tp_dp_autotune_true_tunes_on_the_dp_group_and_stays_exact",
        "test_3d_parallel.py::test_autotune_on_a_pipeline_stage_measures_and_stays_exact",
    ],
    "`step_history()`, `export_trace(path)`": [
        "test_autotune.py::test_trace_is_chrome_json_with_a_row_per_bucket_and_the_backward_span",
        "test_step_history.py::test_trace_steps_bounds_the_step_history",
        "test_step_history.py::test_step_history_and_trace_time_each_bucket_like_the_tests_own_clock",
    ],
    "`bucket_sizes()`, `bucket_parameter_names()`": [
        "test_bucket_layout.py::test_initial_layout_is_reverse_registration_order",
        "test_bucket_layout.py::test_rebuilt_layout_follows_rank0_ready_order_on_every_rank",
        "test_bucket_rebuilds.py::test_bucket_sizes_and_names_are_what_moves_in_launch_order",
    ],
    "`stats()`": [
        "test_collective_counts.py::test_fused_reducer_default_does_two_allreduces_per_step_after_rebuild",
        "test_collective_counts.py::test_the_health_exchange_is_counted_apart_from_the_gradients_all_reduces",
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_autotune.py::test_stats_have_per_bucket_telemetry_of_the_last_step",
        "test_gradient_route.py::test_defaults_and_stats_step_count_synchronised_backwards",
        "test_gradient_route.py::test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused",
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
    ],
    "`no_sync()`": [
        "test_equivalence_ddp.py::test_no_sync_accumulation_then_synced_step_matches_ddp_no_sync",
        "test_equivalence_ddp.py::test_no_sync_with_gradient_as_bucket_view_matches_ddp",
        "test_implicit_ddp_behaviours.py::test_no_sync_applies_to_the_forward_it_wraps_like_ddp",
        "test_no_sync.py::test_exception_inside_no_sync_leaves_sync_on",
    ],
    "`join(divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False)`": [
        "test_join_uneven_inputs.py::test_fused_reducer_is_a_joinable_with_hook_group_and_device",
        "test_join_uneven_inputs.py::test_join_uneven_inputs_dividing_by_initial_world_size_matches_ddp",
        "test_join_uneven_inputs.py::test_join_uneven_inputs_dividing_by_current_world_size_matches_ddp",
        "test_join_uneven_inputs.py::test_join_uneven_inputs_with_find_unused_parameters_matches_ddp",
        "test_join_uneven_inputs.py::test_join_uneven_inputs_with_batchnorm_buffers_matches_ddp",
        "test_join_uneven_inputs.py::test_join_composes_with_zero_redundancy_optimizer_like_ddp",
        "test_join_uneven_inputs.py::test_join_disabled_with_even_inputs_trains_like_ddp",
        "test_join_uneven_inputs.py::test_join_throw_on_early_termination_raises_runtime_error_on_every_rank",
        "test_join_hook.py::test_a_joined_rank_shadows_each_bucket_then_the_unused_map",
    ],
    "`register_comm_hook(state, hook)`": [
        "test_ddp_comm_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets",
        "test_ddp_comm_hooks.py::test_two_bucket_model_has_ddps_two_buckets_with_the_same_parameters",
        "test_ddp_comm_hooks.py::test_hook_sees_a_gradbucket_with_ddps_interface",
        "test_ddp_comm_hooks.py::test_registering_a_comm_hook_twice_raises_runtime_error",
        "test_ddp_comm_hooks.py::test_hook_returning_tensor_instead_of_future_raises_on_every_rank",
        "test_comm_hook_results.py::test_powersgd_hook_on_a_channels_last_model_trains_like_ddp",
    ],
    "`prepare_for_backward()`": [
        "test_gradient_route.py::test_prepare_for_backward_averages_one_more_backward_of_the_same_forward",
        "test_lightning.py::test_manual_optimization_two_backward_passes_per_step",
    ],
    "`opt.sharded_state_dict()` / `opt.load_sharded_state_dict(sd)`, `fused_reducer.sharded.load_checkpoint(path, module, opt)`": [
        "test_sharded_checkpoint.py::test_a_checkpoint_resumes_exactly_at_another_world_size_and_layout",
        "test_sharded_checkpoint.py::test_a_checkpoint_that_does_not_fit_raises_naming_what_differs_and_loads_nothing",
        "test_sharded_checkpoint.py::test_each_ranks_file_holds_about_one_world_th_of_the_state",
        "test_sharded_checkpoint.py::test_a_sharded_checkpoint_loads_into_a_plain_optimizer_in_one_process",
        "test_sharded_checkpoint.py::test_a_ddp_jobs_plain_optimizer_checkpoint_resumes_in_a_sharded_optimizer",
        "test_sharded_checkpoint.py::test_async_save_holds_the_state_of_its_step",
        "test_torchrun_restart.py::test_a_sharded_optimizer_resumes_from_its_dcp_checkpoint_after_a_torchrun_restart",
    ],
    "`fused_reducer.ShardedOptimizer(model, optimizer_class, params=None, master_dtype=None, overlap_param_gather=False, **kwargs)`": [
        "test_sharded.py::test_every_elementwise_optimizer_matches_ddp_through_a_layout_change",
        "test_sharded.py::test_clip_grad_norm_is_ddps_global_norm_and_torch_utilities_reading_param_grad_raise",
        "test_sharded.py::test_state_per_rank_is_one_world_th_of_the_plain_optimizers",
        "test_sharded.py::test_a_ddp_checkpoint_resumes_here_and_back",
        "test_sharded.py::test_non_elementwise_optimizers_fp16_scaling_join_and_comm_hooks_are_refused",
        "test_sharded.py::test_fp32_master_weights_train_like_a_single_process_fp32_master",
        "test_sharded.py::test_gradient_as_bucket_view_matches_ddp_and_releases_param_grad",
        "test_sharded.py::test_torch_compile_with_a_sharded_optimizer_matches_compiled_ddp",
        "test_sharded.py::test_autotune_while_training_moves_shards_and_state_exactly",
        "test_sharded.py::test_a_sharded_checkpoint_resumes_at_another_world_size",
    ],
    "`close()`": [
        "test_close.py::test_close_is_idempotent_and_final",
        "test_cuda_path_cpu.py::test_close_is_final_and_idempotent_and_no_cycle_keeps_a_reducer_alive",
        "test_close.py::test_close_and_garbage_collection_remove_the_hooks",
        "test_close.py::test_close_runs_on_garbage_collection_and_at_exit",
        "test_gpu_ordering.py::test_close_is_bounded_and_final",
    ],
    "`fused_reducer.lightning.FusedReducerStrategy(**kwargs)`": [
        "test_lightning.py::test_trains_like_strategy_ddp",
        "test_lightning.py::test_runtime_tuning_from_a_callback",
        "test_lightning.py::test_checkpoint_save_and_resume",
        "test_lightning.py::test_strategy_registry_and_arguments",
    ],
    "`fused_reducer.set_default_first_bucket_bytes(n)` / `get_default_first_bucket_bytes()` / env `FUSED_REDUCER_FIRST_BUCKET_BYTES`": [
        "test_collective_counts.py::test_process_wide_default_16mib_gives_one_allreduce_per_step_also_after_rebuild",
        "test_collective_counts.py::test_env_var_first_bucket_16mib_gives_one_allreduce_per_step",
        "test_collective_counts.py::test_fused_reducer_default_does_two_allreduces_per_step_after_rebuild",
        "test_bucket_rebuilds.py::test_set_default_first_bucket_bytes_wins_over_the_environment",
        "test_errors.py::test_set_default_first_bucket_bytes_rejects_bad_values_naming_the_setting",
        "test_errors.py::test_bad_env_var_raises_value_error_naming_the_variable",
        "test_gradient_route.py::test_defaults_and_stats_step_count_synchronised_backwards",
    ],
    "`backend`": [
        "test_backend.py::test_auto_tries_shared_memory_for_cpu_parameters",
        "test_backend.py::test_auto_picks_nccl_for_cuda_parameters_only_in_a_cuda_build",
        "test_backend.py::test_nccl_for_cpu_parameters_is_refused_naming_the_device",
        "test_gradient_route.py::test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused",
        "test_shm_transport.py::test_auto_falls_back_to_the_process_group_across_hosts_and_shm_raises",
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
        "test_gpu_ordering.py::test_two_ranks_on_one_gpu_over_gloo_match_ddp",
    ],
    "`fused_reducer.build_info()`": [
        "test_backend.py::test_build_info_reports_what_was_built",
    ],
    # The constructor's signature (the line above the table)
    "FusedReducer(module, ...) signature and defaults": [
        "test_api_doc_coverage.py::test_constructor_signature_and_defaults_are_the_readmes",
        "test_gradient_route.py::test_defaults_and_stats_step_count_synchronised_backwards",
        "test_gradient_route.py::test_process_group_argument_is_the_group_averaged_over",
    ],
    # "How it differs from DDP" table (first column)
    "first bucket": [
        "test_collective_counts.py::test_first_bucket_16mib_at_construction_gives_one_allreduce_per_step",
        "test_collective_counts.py::test_process_wide_default_16mib_gives_one_allreduce_per_step_also_after_rebuild",
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_bucket_rebuilds.py::test_first_bucket_limit_survives_every_rebuild",
    ],
    "layout before the first step": [
        "test_bucket_layout.py::test_initial_layout_is_reverse_registration_order",
        "test_bucket_rebuilds.py::test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "rebuild": [
        "test_bucket_layout.py::test_rebuilt_layout_follows_rank0_ready_order_on_every_rank",
        "test_rank0_decides.py::test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves",
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_bucket_rebuilds.py::test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "CUDA copies": [
        "test_gpu.py::test_fused_copy_matches_torch_on_odd_sizes_and_misaligned_offsets",
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
    ],
    "collectives": [
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
        "test_gpu_ordering.py::test_allreduce_waits_for_the_filling_stream_and_readers_wait_for_it",
        "test_gradient_route.py::test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused",
        "test_shm_transport.py::test_sums_match_float64_and_gloo_across_chunks_and_replicas_are_identical",
    ],
    "shapes differing across ranks (gloo)": [
        "test_errors.py::test_shape_mismatch_across_ranks_names_first_parameter_and_both_shapes_on_every_rank",
        "test_errors.py::test_dtype_or_count_mismatch_across_ranks_raises_on_every_rank",
        "test_errors.py::test_model_errors_are_runtime_and_value_errors",
    ],
    "two ranks on one GPU": [
        "test_cuda_path_cpu.py::test_ranks_sharing_a_gpu_are_refused_on_every_rank_naming_ranks_host_device_and_fix",
        "test_cuda_path_cpu.py::test_shared_gpus_groups_ranks_by_host_and_physical_gpu",
        "test_gpu_ordering.py::test_fused_reducer_refuses_two_ranks_on_one_gpu_on_every_rank",
    ],
    "`bucket_cap_mb=0` or negative": [
        "test_errors.py::test_invalid_mb_sizes_raise_value_or_type_error_naming_the_argument_on_every_rank",
    ],
    "a process ending right after a collective (gloo)": [
        "test_lifecycle.py::test_every_ending_on_both_transports_ends_cleanly",
        "test_lifecycle.py::test_verdict_flags_an_abort_a_hang_a_silent_peer_and_a_leftover_segment",
    ],
    "`check_finite=True`": [
        "test_health.py::test_a_nonfinite_local_gradient_is_named_on_every_rank_then_training_goes_on_as_ddp",
    ],
    "`straggler_report()`": [
        "test_health.py::test_a_rank_sleeping_40_ms_is_named_within_10_steps_and_a_balanced_run_is_never_warned_about",
        "test_health.py::test_the_straggler_report_is_the_median_of_each_ranks_measured_slack",
    ],
    "`grad_norm(norm_type=2.0)`, `clip_grad_norm_(max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None)`": [
        "test_health.py::test_clip_grad_norm_every_norm_type_below_and_above_max_norm_equals_torch_under_ddp",
        "test_health.py::test_grad_norm_follows_param_grad_after_it_changed",
    ],
    "a NaN/Inf in one rank's gradients": [
        "test_health.py::test_a_nonfinite_local_gradient_is_named_on_every_rank_then_training_goes_on_as_ddp",
    ],
    "a slow rank": [
        "test_health.py::test_a_rank_sleeping_40_ms_is_named_within_10_steps_and_a_balanced_run_is_never_warned_about",
    ],
    "a peer process dead over gloo": [
        "test_lifecycle.py::test_every_ending_on_both_transports_ends_cleanly",
    ],
    "a torchrun restart (`--max-restarts`)": [
        "test_torchrun_restart.py::test_fused_reducer_resumes_on_shared_memory_after_a_torchrun_restart",
        "test_torchrun_restart.py::test_ddp_restarts_under_the_same_launcher_set_up",
        "test_shm_transport.py::test_store_keys_of_a_restarted_attempt_do_not_collide_with_the_last_ones",
        "test_elastic.py::test_a_failed_first_collective_in_a_restarted_attempt_names_torch_and_the_fix",
        "test_elastic.py::test_forget_dead_attempt_keys_does_nothing_outside_a_restart_and_refuses_after_init",
    ],
    # "Same as DDP:" (one entry per clause)
    "buckets per (dtype, device)": [
        "test_equivalence_ddp.py::test_mixed_dtypes_get_separate_buckets_and_match_ddp",
        "test_bucket_assignment.py::test_mixed_groups_never_share_a_bucket",
        "test_bucket_rebuilds.py::test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes",
    ],
    "a bucket closes when it reaches its limit": [
        "test_bucket_assignment.py::test_assignment_matches_python_reference",
        "test_bucket_rebuilds.py::test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes",
    ],
    "parameters are never split": [
        "test_bucket_assignment.py::test_param_larger_than_cap_gets_its_own_bucket",
        "test_equivalence_ddp.py::test_fp32_grads_match_ddp_with_tiny_cap_one_bucket_per_param",
        "test_bucket_rebuilds.py::test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes",
    ],
    "bucket slots keep each parameter's strides (channels_last copies as one block)": [
        "test_bucket_rebuilds.py::test_bucket_view_grads_are_16_byte_aligned_and_keep_the_parameters_strides",
        "test_bucket_rebuilds.py::test_bucket_slots_keep_the_parameters_strides_like_ddps",
    ],
    "buckets launch strictly in order as soon as complete (overlapping backward)": [
        "test_gradient_route.py::test_buckets_launch_in_layout_order_when_ranks_complete_them_differently",
        "test_bucket_layout.py::test_buckets_launch_while_backward_is_still_running",
        "test_bucket_rebuilds.py::test_bucket_sizes_and_names_are_what_moves_in_launch_order",
        "test_step_history.py::test_step_history_and_trace_time_each_bucket_like_the_tests_own_clock",
    ],
    "gradients are scaled by 1/world size in the copy, then summed, on every transport (never "
    "NCCL's `ncclAvg`)": [
        "test_ddp_comm_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets",
        "test_equivalence_ddp.py::test_fp32_grads_match_ddp_with_default_cap",
        "test_gradient_route.py::test_gradients_are_scaled_before_they_are_summed_like_ddp",
        "test_exactness.py::test_fp32_averages_are_ddps_arithmetic_scaled_in_the_copy_then_summed",
        "test_exactness.py::test_half_precision_averages_are_no_further_from_float64_than_ddps",
    ],
    "parameters and buffers broadcast from rank 0 at construction, buffers before each forward "
    "that follows a synchronised one (`broadcast_buffers`; not after `no_sync`/`no_grad` forwards; "
    "re-read every time, without bumping version counters)": [
        "test_equivalence_ddp.py::test_initial_weights_differing_by_rank_start_from_rank0_and_match_ddp",
        "test_buffers.py::test_buffer_broadcast_rules_match_ddp",
        "test_implicit_ddp_behaviours.py::test_eval_and_no_grad_forwards_mixed_into_training_match_ddp",
        "test_implicit_ddp_behaviours.py::test_buffer_reassigned_after_construction_is_broadcast_from_rank0_at_next_forward",
        "test_buffers.py::test_two_forwards_then_backward_with_a_buffer_saved_for_backward",
        "test_buffers.py::test_buffers_are_broadcast_at_construction_like_ddp",
        "test_buffers.py::test_broadcast_buffers_false_keeps_rank_local_buffers_at_construction_like_ddp",
    ],
    "unused parameters need `find_unused_parameters=True` (one extra small all-reduce per step, as "
    "in DDP; usage is remembered across `no_sync` steps)": [
        "test_errors.py::test_unused_parameter_without_find_unused_raises_at_next_forward_on_every_rank",
        "test_equivalence_ddp.py::test_unused_and_rank_dependent_params_match_ddp_find_unused",
        "test_no_sync.py::test_usage_inside_no_sync_counts_for_find_unused_parameters",
        "test_unused_parameters.py::test_find_unused_parameters_runs_ddps_collectives",
    ],
    "a backward through the wrapped module called directly stays local": [
        "test_gradient_route.py::test_backward_of_the_inner_module_stays_local",
        "test_implicit_ddp_behaviours.py::test_backward_through_inner_module_after_training_is_local_and_does_not_raise",
    ],
    "a second backward of one forward (`backward(retain_graph=True)` twice, or a backward per "
    "output)": [
        "test_errors.py::test_second_backward_of_one_forward_is_averaged_unless_inside_no_sync",
        "test_gradient_route.py::test_prepare_for_backward_averages_one_more_backward_of_the_same_forward",
    ],
    "a model wrapped twice (`FusedReducer(FusedReducer(m))`, `FusedReducer(DDP(m))`, a wrapper in a "
    "submodule)": [
        "test_errors.py::test_a_model_wrapped_twice_is_refused_naming_the_inner_wrapper",
    ],
    "`no_sync()` nests (leaving it restores the previous setting, also when its body raises)": [
        "test_exactness.py::test_no_sync_nests_like_ddp_and_restores_the_previous_setting_when_the_body_raises",
        "test_no_sync.py::test_exception_inside_no_sync_leaves_sync_on",
    ],
    # "Switching from DDP": Identical (one entry per item)
    "the constructor arguments of torch 2.14.1's DDP (`bucket_cap_mb_list` with DDP's layouts at "
    "the first step and after the rebuild, `forward_sync_buffers` and the deprecated "
    "`broadcast_buffers` combined as DDP combines them, `init_sync=False`, a 1-D `device_mesh`, "
    "`mixed_precision` with only a `reduce_dtype` (FusedReducer's `reduce_dtype`), `dim`, "
    "`batched_grad_copy` (FusedReducer always copies a bucket at once), `check_reduction`, "
    "`skip_all_reduce_unused_params` (the parameters no rank used in the first step get buckets "
    "that are never reduced; if a rank uses one later, every rank raises naming it, where DDP's "
    "ranks would disagree and hang))": [
        "test_ddp_arguments.py::test_skip_all_reduce_unused_params_drops_their_bytes_and_raises_when_the_set_changes",
        "test_ddp_arguments.py::test_every_ddp_constructor_argument_is_handled",
        "test_ddp_arguments.py::test_bucket_cap_mb_list_gives_ddps_layout_at_the_first_step_and_after_the_rebuild",
        "test_ddp_arguments.py::test_broadcast_buffers_and_forward_sync_buffers_combine_as_in_ddp",
        "test_ddp_arguments.py::test_init_sync_false_keeps_rank_local_parameters_like_ddp",
        "test_ddp_arguments.py::test_device_mesh_and_accepted_arguments_give_ddps_gradients",
    ],
    "`state_dict()` keys (`module.` prefix: DDP checkpoints load into FusedReducer and back)": [
        "test_module_surface_like_ddp.py::test_state_dict_keys_are_exactly_ddps_with_module_prefix",
        "test_module_surface_like_ddp.py::test_ddp_checkpoint_loads_into_fused_reducer_and_resumes_like_ddp",
        "test_module_surface_like_ddp.py::test_fused_reducer_checkpoint_loads_into_ddp_and_resumes_identically",
    ],
    "`.module`": [
        "test_module_surface_like_ddp.py::test_module_and_parameters_and_buffers_are_the_users_objects",
    ],
    "`no_sync()`|identical": [
        "test_equivalence_ddp.py::test_no_sync_accumulation_then_synced_step_matches_ddp_no_sync",
        "test_implicit_ddp_behaviours.py::test_batchnorm_running_stats_after_no_sync_window_equal_ddps",
    ],
    "`join()`": [
        "test_join_uneven_inputs.py::test_join_uneven_inputs_dividing_by_initial_world_size_matches_ddp",
        "test_join_uneven_inputs.py::test_join_composes_with_zero_redundancy_optimizer_like_ddp",
    ],
    "`register_comm_hook()` with DDP's hooks": [
        "test_ddp_comm_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets",
        "test_comm_hook_results.py::test_powersgd_hook_on_a_channels_last_model_trains_like_ddp",
    ],
    "`torch.compile` in either order": [
        "test_torch_compile.py::test_fused_reducer_around_compiled_model_eager_backend_trains_like_ddp",
        "test_torch_compile.py::test_compiled_fused_reducer_eager_backend_trains_like_compiled_ddp",
        "test_torch_compile.py::test_fused_reducer_around_compiled_model_inductor_trains_like_ddp",
        "test_torch_compile.py::test_compiled_fused_reducer_inductor_trains_like_compiled_ddp",
    ],
    "autocast and `GradScaler`": [
        "test_module_surface_like_ddp.py::test_autocast_bf16_training_loop_matches_ddp",
        "test_gradient_route.py::test_grad_scaler_skips_the_same_steps_on_every_rank_like_ddp",
        "test_gpu_ordering.py::test_syncbatchnorm_and_cuda_amp_train_as_under_ddp",
    ],
    "`SyncBatchNorm`": [
        "test_module_surface_like_ddp.py::test_syncbatchnorm_converted_model_trains_like_ddp_on_cuda",
        "test_gpu_ordering.py::test_syncbatchnorm_and_cuda_amp_train_as_under_ddp",
    ],
    "gradient clipping after backward": [
        "test_module_surface_like_ddp.py::test_clip_grad_norm_after_backward_sees_averaged_grads_like_ddp",
    ],
    "pickling (the process group and reducer are dropped and re-attached at the first forward)": [
        "test_module_surface_like_ddp.py::test_pickled_or_copied_model_reloads_and_trains_like_ddp",
        "test_pickle_and_copy.py::test_pickled_and_deep_copied_models_train_like_ddp",
    ],
    # "Switching from DDP": Differs
    "the tuning knobs above": [
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_bucket_rebuilds.py::test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "errors are raised where DDP hangs": [
        "test_errors.py::test_peer_dying_mid_step_makes_survivor_raise_promptly_naming_the_bucket",
        "test_errors.py::test_shape_mismatch_across_ranks_names_first_parameter_and_both_shapes_on_every_rank",
        "test_gradient_route.py::test_timeout_bounds_the_wait_for_a_stalled_peer",
    ],
    "compiled autograd is refused with a clear error (FusedReducer's C++ hooks are not traced by it)": [
        "test_torch_compile.py::test_compiled_autograd_gives_averaged_grads_or_raises_runtime_error_at_once",
    ],
    "`static_graph=True` is refused (not needed for reentrant checkpointing)": [
        "test_implicit_ddp_behaviours.py::test_static_graph_raises_clear_error_naming_static_graph_and_alternative",
        "test_implicit_ddp_behaviours.py::test_reentrant_checkpoint_with_unused_param_matches_ddp_static_graph_without_it",
    ],
    "`delay_all_reduce_named_params` / `param_to_hook_all_reduce` and `mixed_precision`'s "
    "`param_dtype` / `buffer_dtype` are refused naming what to use instead (`FusedReducerError`)": [
        "test_ddp_arguments.py::test_refused_arguments_raise_naming_the_argument_and_the_alternative",
        "test_ddp_arguments.py::test_mixed_precision_param_and_buffer_dtypes_are_refused_naming_them",
    ],
}


API_PAGE = os.path.join(ROOT, "docs", "API.md")  # the tables, promises and signature read below


def _api_page():
    with open(API_PAGE) as f:
        return f.read()


def _normal(text):
    return " ".join(text.split())


def _split_top_level(text, sep):
    """Split at `sep` outside parentheses and backticks (whitespace normalised first)."""
    text = _normal(text)
    parts, depth, code, start, i = [], 0, False, 0, 0
    while i < len(text):
        c = text[i]
        if c == "`":
            code = not code
        elif not code and c == "(":
            depth += 1
        elif not code and c == ")":
            depth -= 1
        elif not code and depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    parts.append(text[start:])
    return [_normal(p) for p in parts if p.strip()]


def _table_first_cells(readme, header):
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    cells = []
    for line in lines[start + 2:]:  # skip the header and |---| rows
        if not line.startswith("|"):
            break
        cells.append(_normal(line.split("|")[1]))
    return cells


def readme_rows_and_promises():
    """The API reference's table rows, how-it-differs rows and promises, as COVERAGE keys."""
    readme = _api_page()
    keys = _table_first_cells(readme, "| API |")
    keys += _table_first_cells(readme, "| | DDP | FusedReducer |")
    same = re.search(r"Same as DDP: (.*?)\n\n", readme, re.S)
    assert same, "docs/API.md: the 'Same as DDP:' paragraph is gone"
    keys += _split_top_level(same.group(1).strip().rstrip("."), "; ")
    switching = re.search(r"Identical: (.*?)\. Differs: (.*?)\. Details", readme, re.S)
    assert switching, "docs/API.md: the 'Identical: ... Differs: ...' sentences are gone"
    identical = _split_top_level(switching.group(1), ", ")
    keys += [k + "|identical" if k in keys else k for k in identical]
    keys += _split_top_level(switching.group(2), "; ")
    signature = re.search(r"`FusedReducer\(module, ", readme)
    assert signature, "docs/API.md: the constructor signature is gone"
    keys.append("FusedReducer(module, ...) signature and defaults")
    return keys


def _test_functions(filename):
    with open(os.path.join(HERE, filename)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_readme_row_and_promise_names_existing_tests():
    """No spawn. A new README row or promise needs an entry in COVERAGE (and its tests); an
    entry whose README text changed or went away must be revisited; every test named exists."""
    keys = readme_rows_and_promises()
    missing = [k for k in keys if k not in COVERAGE]
    stale = [k for k in COVERAGE if k not in keys]
    assert not missing, f"README rows/promises without tests in COVERAGE: {missing}"
    assert not stale, f"COVERAGE entries the README no longer has: {stale}"
    functions = {}
    for key, tests in COVERAGE.items():
        assert tests, key
        for name in tests:
            filename, test = name.split("::")
            if filename not in functions:
                functions[filename] = _test_functions(filename)
            assert test in functions[filename], f"{key}: {name} does not exist"


def test_testing_md_shows_the_same_map():
    """No spawn. docs/TESTING.md's "API coverage" table has a row per COVERAGE entry."""
    with open(os.path.join(ROOT, "docs", "TESTING.md")) as f:
        text = f.read()
    assert "\n## API coverage\n" in text, "docs/TESTING.md: no '## API coverage' section"
    section = text.split("\n## API coverage\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| README") and "---" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[_normal(cells[0])] = cells[1]
    for key, tests in COVERAGE.items():
        shown = key.split("|")[0] + (" (Identical)" if key.endswith("|identical") else "")
        assert _normal(shown) in rows, f"docs/TESTING.md: no row for {shown!r}"
        for name in tests:
            assert name.split("::")[1] in rows[_normal(shown)], (shown, name)


def test_constructor_signature_and_defaults_are_the_readmes():
    """No spawn. docs/API.md's `FusedReducer(module, ...)` line, parsed, is the constructor's
    signature: same arguments, same order, same defaults."""
    from fused_reducer import FusedReducer
    readme = _api_page()
    match = re.search(r"`(FusedReducer\(module, .*?\))`", readme, re.S)
    call = ast.parse(_normal(match.group(1)), mode="eval").body
    documented = [("module", inspect.Parameter.empty)]
    for kw in call.keywords:
        value = eval(compile(ast.Expression(kw.value), "README", "eval"),  # noqa: S307 - our README
                     {"timedelta": timedelta})
        documented.append((kw.arg, value))
    actual = [(name, p.default) for name, p in
              inspect.signature(FusedReducer.__init__).parameters.items() if name != "self"]
    assert actual == documented
