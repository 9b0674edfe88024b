"""Coverage of the public API (issue 13, item 3): every row of README.md's API table, every row of
its "How it differs from DDP" table and every "same as DDP" / "Identical" / "Differs" promise has
tests that fail when the behaviour changes.

COVERAGE below maps each of them (the README's own words) to those tests, in this file and in the
others; test_every_readme_row_and_promise_names_existing_tests re-reads README.md and fails when a
row or promise has no entry, an entry no longer matches the README, or a named test does not
exist. docs/TESTING.md ("API coverage") shows the same map as a table.

The tests here close the gaps an audit of the suite found (rows whose only tests compared values
the library computes about itself, or that were not tested at all). Each compares with an
independent reference: torch's DistributedDataParallel on the same model and data, a float64
average of locally computed gradients made with plain all_reduce, the profiler's record of the
collectives gloo ran (count, sizes, dtypes), plain PyTorch hooks (gradient-ready order and time),
or the test's own count of what it did.

Speed: the checks of the selected tests run in ONE spawn of 2 gloo ranks (module fixture, as in
test_mutant_killers.py); two tests need no spawn and one runs a 1-rank subprocess.
"""
import ast
import gc
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from dist_utils import ALLREDUCE_EVENTS, SHAPED_ALLREDUCE_EVENTS, SelectedChecks, assert_small, observe_ready_order, results
from test_bucket_layout import expected_layout
from test_dropin_common import (
    ExtraNet, Net, StatNet, build, data, grads, local_average_grads, loss_of, max_diff, outcome,
    params, same_on_all_ranks, sgd, step)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ELEMENT = {"float": 4, "double": 8, "int": 4, "long int": 8, "c10::BFloat16": 2, "c10::Half": 2}
GLOO_DTYPE = {torch.float32: "float", torch.float64: "double", torch.int32: "int"}
ENV = "FUSED_REDUCER_FIRST_BUCKET_BYTES"
MiB = 1 << 20


# -- the map: README row or promise -> tests ------------------------------------------------------
# Keys are the README's words (whitespace normalised). "file.py::test" names a test function (a
# parametrised one by its function name). GPU-only tests are listed where the behaviour is
# CUDA's; they run in bench/gpu_check.sh.

A = "test_api_table.py::"
COVERAGE = {
    # API table (first column)
    "`first_bucket_bytes`, `bucket_cap_bytes`": [
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_mutant_killers.py::test_first_bucket_limit_survives_every_rebuild",
        "test_bucket_layout.py::test_limits_that_differ_by_rank_resolve_to_rank0_values_at_rebuild",
        "test_mutant_killers.py::test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves",
        "test_errors.py::test_setters_reject_bad_values_naming_the_setting_and_keep_the_old_value",
        A + "test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
        A + "test_a_limit_set_before_the_first_step_applies_at_the_next_forward",
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
        A + "test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "`autotune=True` / `autotune()` / `autotune_report()`": [
        "test_autotune.py::test_params_match_ddp_throughout_tuning_and_after",
        "test_autotune.py::test_ranks_agree_on_trials_and_choice_and_apply_it",
        "test_autotune.py::test_choice_persists_across_forced_rebuilds",
        "test_autotune.py::test_autotune_method_with_explicit_candidates",
        "test_autotune.py::test_report_format",
        "test_autotune.py::test_tuner_leaves_a_clearly_slow_configuration",
        "test_mutant_killers.py::test_autotune_plan_and_choice_are_rank0s",
    ],
    "`step_history()`, `export_trace(path)`": [
        "test_autotune.py::test_trace_is_chrome_json_with_a_row_per_bucket_and_the_backward_span",
        "test_mutant_killers.py::test_trace_steps_bounds_the_step_history",
        A + "test_step_history_and_trace_time_each_bucket_like_the_tests_own_clock",
    ],
    "`bucket_sizes()`, `bucket_parameter_names()`": [
        "test_bucket_layout.py::test_initial_layout_is_reverse_registration_order",
        "test_bucket_layout.py::test_rebuilt_layout_follows_rank0_ready_order_on_every_rank",
        A + "test_bucket_sizes_and_names_are_what_moves_in_launch_order",
    ],
    "`stats()`": [
        "test_collective_counts.py::test_fused_reducer_default_does_two_allreduces_per_step_after_rebuild",
        "test_collective_counts.py::test_the_health_exchange_is_counted_apart_from_the_gradients_all_reduces",
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_autotune.py::test_stats_have_per_bucket_telemetry_of_the_last_step",
        A + "test_defaults_and_stats_step_count_synchronised_backwards",
        A + "test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused",
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
    ],
    "`no_sync()`": [
        "test_equivalence_ddp.py::test_no_sync_accumulation_then_synced_step_matches_ddp_no_sync",
        "test_equivalence_ddp.py::test_no_sync_with_gradient_as_bucket_view_matches_ddp",
        "test_dropin_behaviours.py::test_no_sync_applies_to_the_forward_it_wraps_like_ddp",
        "test_mutant_killers.py::test_exception_inside_no_sync_leaves_sync_on",
    ],
    "`join(divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False)`": [
        "test_dropin_join.py::test_fused_reducer_is_a_joinable_with_hook_group_and_device",
        "test_dropin_join.py::test_join_uneven_inputs_dividing_by_initial_world_size_matches_ddp",
        "test_dropin_join.py::test_join_uneven_inputs_dividing_by_current_world_size_matches_ddp",
        "test_dropin_join.py::test_join_uneven_inputs_with_find_unused_parameters_matches_ddp",
        "test_dropin_join.py::test_join_uneven_inputs_with_batchnorm_buffers_matches_ddp",
        "test_dropin_join.py::test_join_composes_with_zero_redundancy_optimizer_like_ddp",
        "test_dropin_join.py::test_join_disabled_with_even_inputs_trains_like_ddp",
        "test_dropin_join.py::test_join_throw_on_early_termination_raises_runtime_error_on_every_rank",
        "test_mutant_killers.py::test_a_joined_rank_shadows_each_bucket_then_the_unused_map",
    ],
    "`register_comm_hook(state, hook)`": [
        "test_dropin_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets",
        "test_dropin_hooks.py::test_two_bucket_model_has_ddps_two_buckets_with_the_same_parameters",
        "test_dropin_hooks.py::test_hook_sees_a_gradbucket_with_ddps_interface",
        "test_dropin_hooks.py::test_registering_a_comm_hook_twice_raises_runtime_error",
        "test_dropin_hooks.py::test_hook_returning_tensor_instead_of_future_raises_on_every_rank",
        A + "test_powersgd_hook_on_a_channels_last_model_trains_like_ddp",
    ],
    "`prepare_for_backward()`": [
        A + "test_prepare_for_backward_averages_one_more_backward_of_the_same_forward",
        "test_lightning.py::test_manual_optimization_two_backward_passes_per_step",
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
        "test_mutant_killers.py::test_close_is_idempotent_and_final",
        "test_cuda_path_cpu.py::test_close_is_final_and_idempotent_and_no_cycle_keeps_a_reducer_alive",
        A + "test_close_and_garbage_collection_remove_the_hooks",
        A + "test_close_runs_on_garbage_collection_and_at_exit",
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
        "test_mutant_killers.py::test_set_default_first_bucket_bytes_wins_over_the_environment",
        "test_errors.py::test_set_default_first_bucket_bytes_rejects_bad_values_naming_the_setting",
        "test_errors.py::test_bad_env_var_raises_value_error_naming_the_variable",
        A + "test_defaults_and_stats_step_count_synchronised_backwards",
    ],
    "`backend`": [
        "test_backend.py::test_auto_tries_shared_memory_for_cpu_parameters",
        "test_backend.py::test_auto_picks_nccl_for_cuda_parameters_only_in_a_cuda_build",
        "test_backend.py::test_nccl_for_cpu_parameters_is_refused_naming_the_device",
        A + "test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused",
        "test_shm_transport.py::test_auto_falls_back_to_the_process_group_across_hosts_and_shm_raises",
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
        "test_gpu_ordering.py::test_two_ranks_on_one_gpu_over_gloo_match_ddp",
    ],
    "`fused_reducer.build_info()`": [
        "test_backend.py::test_build_info_reports_what_was_built",
    ],
    # The constructor's signature (the line above the table)
    "FusedReducer(module, ...) signature and defaults": [
        A + "test_constructor_signature_and_defaults_are_the_readmes",
        A + "test_defaults_and_stats_step_count_synchronised_backwards",
        A + "test_process_group_argument_is_the_group_averaged_over",
    ],
    # "How it differs from DDP" table (first column)
    "first bucket": [
        "test_collective_counts.py::test_first_bucket_16mib_at_construction_gives_one_allreduce_per_step",
        "test_collective_counts.py::test_process_wide_default_16mib_gives_one_allreduce_per_step_also_after_rebuild",
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        "test_mutant_killers.py::test_first_bucket_limit_survives_every_rebuild",
    ],
    "layout before the first step": [
        "test_bucket_layout.py::test_initial_layout_is_reverse_registration_order",
        A + "test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "rebuild": [
        "test_bucket_layout.py::test_rebuilt_layout_follows_rank0_ready_order_on_every_rank",
        "test_mutant_killers.py::test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves",
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        A + "test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "CUDA copies": [
        "test_gpu.py::test_fused_copy_matches_torch_on_odd_sizes_and_misaligned_offsets",
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
    ],
    "collectives": [
        "test_gpu.py::test_fused_reducer_on_nccl_matches_ddp",
        "test_gpu_ordering.py::test_allreduce_waits_for_the_filling_stream_and_readers_wait_for_it",
        A + "test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused",
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
        A + "test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes",
    ],
    "a bucket closes when it reaches its limit": [
        "test_bucket_assignment.py::test_assignment_matches_python_reference",
        A + "test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes",
    ],
    "parameters are never split": [
        "test_bucket_assignment.py::test_param_larger_than_cap_gets_its_own_bucket",
        "test_equivalence_ddp.py::test_fp32_grads_match_ddp_with_tiny_cap_one_bucket_per_param",
        A + "test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes",
    ],
    "bucket slots keep each parameter's strides (channels_last copies as one block)": [
        "test_mutant_killers.py::test_bucket_view_grads_are_16_byte_aligned_and_keep_the_parameters_strides",
        A + "test_bucket_slots_keep_the_parameters_strides_like_ddps",
    ],
    "buckets launch strictly in order as soon as complete (overlapping backward)": [
        "test_mutant_killers.py::test_buckets_launch_in_layout_order_when_ranks_complete_them_differently",
        "test_bucket_layout.py::test_buckets_launch_while_backward_is_still_running",
        A + "test_bucket_sizes_and_names_are_what_moves_in_launch_order",
        A + "test_step_history_and_trace_time_each_bucket_like_the_tests_own_clock",
    ],
    "gradients are scaled by 1/world size in the copy, then summed, on every transport (never "
    "NCCL's `ncclAvg`)": [
        "test_dropin_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets",
        "test_equivalence_ddp.py::test_fp32_grads_match_ddp_with_default_cap",
        A + "test_gradients_are_scaled_before_they_are_summed_like_ddp",
        "test_exactness.py::test_fp32_averages_are_ddps_arithmetic_scaled_in_the_copy_then_summed",
        "test_exactness.py::test_half_precision_averages_are_no_further_from_float64_than_ddps",
    ],
    "parameters and buffers broadcast from rank 0 at construction, buffers before each forward "
    "that follows a synchronised one (`broadcast_buffers`; not after `no_sync`/`no_grad` forwards; "
    "re-read every time, without bumping version counters)": [
        "test_equivalence_ddp.py::test_initial_weights_differing_by_rank_start_from_rank0_and_match_ddp",
        "test_mutant_killers.py::test_buffer_broadcast_rules_match_ddp",
        "test_dropin_behaviours.py::test_eval_and_no_grad_forwards_mixed_into_training_match_ddp",
        "test_dropin_behaviours.py::test_buffer_reassigned_after_construction_is_broadcast_from_rank0_at_next_forward",
        "test_mutant_killers.py::test_two_forwards_then_backward_with_a_buffer_saved_for_backward",
        A + "test_buffers_are_broadcast_at_construction_like_ddp",
        A + "test_broadcast_buffers_false_keeps_rank_local_buffers_at_construction_like_ddp",
    ],
    "unused parameters need `find_unused_parameters=True` (one extra small all-reduce per step, as "
    "in DDP; usage is remembered across `no_sync` steps)": [
        "test_errors.py::test_unused_parameter_without_find_unused_raises_at_next_forward_on_every_rank",
        "test_equivalence_ddp.py::test_unused_and_rank_dependent_params_match_ddp_find_unused",
        "test_mutant_killers.py::test_usage_inside_no_sync_counts_for_find_unused_parameters",
        A + "test_find_unused_parameters_runs_ddps_collectives",
    ],
    "a backward that no synchronised forward armed (the wrapped module called directly, a second "
    "backward of one graph) stays local": [
        "test_mutant_killers.py::test_backward_of_the_inner_module_stays_local",
        "test_errors.py::test_second_backward_of_one_forward_stays_local_like_ddp_then_training_recovers",
        "test_dropin_behaviours.py::test_backward_through_inner_module_after_training_is_local_and_does_not_raise",
    ],
    "`no_sync()` nests (leaving it restores the previous setting, also when its body raises)": [
        "test_exactness.py::test_no_sync_nests_like_ddp_and_restores_the_previous_setting_when_the_body_raises",
        "test_mutant_killers.py::test_exception_inside_no_sync_leaves_sync_on",
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
        "test_dropin.py::test_state_dict_keys_are_exactly_ddps_with_module_prefix",
        "test_dropin.py::test_ddp_checkpoint_loads_into_fused_reducer_and_resumes_like_ddp",
        "test_dropin.py::test_fused_reducer_checkpoint_loads_into_ddp_and_resumes_identically",
    ],
    "`.module`": [
        "test_dropin.py::test_module_and_parameters_and_buffers_are_the_users_objects",
    ],
    "`no_sync()`|identical": [
        "test_equivalence_ddp.py::test_no_sync_accumulation_then_synced_step_matches_ddp_no_sync",
        "test_dropin_behaviours.py::test_batchnorm_running_stats_after_no_sync_window_equal_ddps",
    ],
    "`join()`": [
        "test_dropin_join.py::test_join_uneven_inputs_dividing_by_initial_world_size_matches_ddp",
        "test_dropin_join.py::test_join_composes_with_zero_redundancy_optimizer_like_ddp",
    ],
    "`register_comm_hook()` with DDP's hooks": [
        "test_dropin_hooks.py::test_ddp_comm_hook_gives_ddps_parameters_with_the_same_buckets",
        A + "test_powersgd_hook_on_a_channels_last_model_trains_like_ddp",
    ],
    "`torch.compile` in either order": [
        "test_dropin_compile.py::test_fused_reducer_around_compiled_model_eager_backend_trains_like_ddp",
        "test_dropin_compile.py::test_compiled_fused_reducer_eager_backend_trains_like_compiled_ddp",
        "test_dropin_compile.py::test_fused_reducer_around_compiled_model_inductor_trains_like_ddp",
        "test_dropin_compile.py::test_compiled_fused_reducer_inductor_trains_like_compiled_ddp",
    ],
    "autocast and `GradScaler`": [
        "test_dropin.py::test_autocast_bf16_training_loop_matches_ddp",
        A + "test_grad_scaler_skips_the_same_steps_on_every_rank_like_ddp",
        "test_gpu_ordering.py::test_syncbatchnorm_and_cuda_amp_train_as_under_ddp",
    ],
    "`SyncBatchNorm`": [
        "test_dropin.py::test_syncbatchnorm_converted_model_trains_like_ddp_on_cuda",
        "test_gpu_ordering.py::test_syncbatchnorm_and_cuda_amp_train_as_under_ddp",
    ],
    "gradient clipping after backward": [
        "test_dropin.py::test_clip_grad_norm_after_backward_sees_averaged_grads_like_ddp",
    ],
    "pickling (the process group and reducer are dropped and re-attached at the first forward)": [
        "test_dropin.py::test_pickled_or_copied_model_reloads_and_trains_like_ddp",
        "test_mutant_killers.py::test_pickled_and_deep_copied_models_train_like_ddp",
    ],
    # "Switching from DDP": Differs
    "the tuning knobs above": [
        "test_collective_counts.py::test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds",
        A + "test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist",
    ],
    "errors are raised where DDP hangs": [
        "test_errors.py::test_peer_dying_mid_step_makes_survivor_raise_promptly_naming_the_bucket",
        "test_errors.py::test_shape_mismatch_across_ranks_names_first_parameter_and_both_shapes_on_every_rank",
        "test_mutant_killers.py::test_timeout_bounds_the_wait_for_a_stalled_peer",
    ],
    "compiled autograd is refused with a clear error (FusedReducer's C++ hooks are not traced by it)": [
        "test_dropin_compile.py::test_compiled_autograd_gives_averaged_grads_or_raises_runtime_error_at_once",
    ],
    "`static_graph=True` is refused (not needed for reentrant checkpointing)": [
        "test_dropin_behaviours.py::test_static_graph_raises_clear_error_naming_static_graph_and_alternative",
        "test_dropin_behaviours.py::test_reentrant_checkpoint_with_unused_param_matches_ddp_static_graph_without_it",
    ],
    "`delay_all_reduce_named_params` / `param_to_hook_all_reduce` and `mixed_precision`'s "
    "`param_dtype` / `buffer_dtype` are refused naming what to use instead (`FusedReducerError`)": [
        "test_ddp_arguments.py::test_refused_arguments_raise_naming_the_argument_and_the_alternative",
        "test_ddp_arguments.py::test_mixed_precision_param_and_buffer_dtypes_are_refused_naming_them",
    ],
}


# -- reading the API reference (docs/API.md; the README links to it) --------------------------------

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


# -- models ----------------------------------------------------------------------------------------

class Ladder(nn.Module):
    """One dtype, odd layer sizes: with a 700-byte limit some buckets hold several parameters and
    some parameters are larger than the limit on their own."""

    def __init__(self):
        super().__init__()
        widths = (8, 12, 20, 16, 24, 4)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Mixed(nn.Module):
    """float32 and float64 layers interleaved; every numel a multiple of 4 (no slot padding, so a
    bucket's flat buffer is exactly its parameters' bytes)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 32)
        self.d = nn.Linear(32, 16).double()
        self.e = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.double())).float()
        h = torch.tanh(self.c(h))
        h = torch.tanh(self.d(h.double())).float()
        return self.e(h)


class Flip(nn.Module):
    """a and b are computed in an order chosen by `flip`: autograd makes their gradients ready in
    that order reversed, so the observed gradient order changes with the argument."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x, flip=False):
        h = torch.tanh(self.inp(x))
        if flip:
            yb, ya = self.b(h), self.a(h)
        else:
            ya, yb = self.a(h), self.b(h)
        return self.head(torch.tanh(ya) * torch.sigmoid(yb))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(y.mean(dim=(2, 3)))


class Huge(nn.Module):
    """loss = sum(w * c): the gradient of w is c, near float32's largest value."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, c):
        return (self.w * c).sum()


SLEEP_S = 0.25


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sleep):
        ctx.sleep = sleep
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.sleep:
            time.sleep(SLEEP_S)
        return g, None


class Slow(nn.Module):
    """Backward makes out.* and mid.* ready, sleeps SLEEP_S (when asked), then makes inp.* ready."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, sleep=False):
        h = _SleepInBackward.apply(torch.tanh(self.inp(x)), sleep)
        return self.out(torch.tanh(self.mid(h)))


# -- helpers ---------------------------------------------------------------------------------------

def fused(module, **kwargs):
    from fused_reducer import FusedReducer
    return FusedReducer(module, **kwargs)


def collectives(fn):
    """What fn ran, from the profiler: (number of all-reduces, sorted (bytes, dtype) of each);
    see dist_utils.ALLREDUCE_EVENTS."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    count, moved = 0, []
    for e in prof.events():
        count += e.name in ALLREDUCE_EVENTS
        if e.name in SHAPED_ALLREDUCE_EVENTS:
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            moved.append((numel * ELEMENT[e.input_dtypes[0]], e.input_dtypes[0]))
    return count, sorted(moved)


def rank0(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values[0]


def recording_hook(module, log):
    """DDP's allreduce_hook, recording at each call (= launch) the bucket's parameter names."""
    names = {p.data_ptr(): n for n, p in module.named_parameters()}

    def hook(state, bucket):
        log.append((bucket.index(), [names[p.data_ptr()] for p in bucket.parameters()]))
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def raised(fn):
    """("ok",) or ("raised", type name, message, is RuntimeError, is ValueError)."""
    res = outcome(fn)
    return res[:1] if res[0] == "ok" else res


# -- checks (run on every rank) --------------------------------------------------------------------

def check_defaults_and_stats(rank, world):
    """All defaults; stats()['step'] counts the synchronised backward passes the test ran."""
    os.environ.pop(ENV, None)  # nothing set: the documented 1 MiB
    m = fused(build(Net))
    out = {"limits": (m.first_bucket_bytes, m.bucket_cap_bytes, m.last_bucket_bytes,
                      m.reduce_dtype),
           "autotune": m.autotune_report()["state"], "transport": m.stats()["transport"],
           "step_before": m.stats()["step"]}
    opt = sgd(m)
    step(m, opt, rank, 0)
    step(m, opt, rank, 1)
    with m.no_sync():  # accumulates, not a synchronised step
        step(m, opt, rank, 2)
    x, y = data(rank, 3)
    loss_of(m.module(x), y, rank).backward()  # not armed: local, not a step
    state = {k: v.clone() for k, v in m.module.state_dict().items()}
    step(m, opt, rank, 4)
    out["step"] = m.stats()["step"]
    out["history_steps"] = [s["step"] for s in m.step_history()]
    out["vs_reference"] = max_diff(local_average_grads(state, Net, rank, 4), grads(m))
    out["grads_are_views"] = [n for n, p in m.module.named_parameters() if p.grad._base is not None]
    return out


def check_backend(rank, world):
    """backend="auto" (shared memory: both ranks on this host) and "process_group" with CPU
    parameters: one all-reduce per bucket (profiler); "nccl" for CPU parameters and an unknown
    name are refused."""
    out = {}
    limit = 600 / MiB  # Net in 2 buckets
    for backend in ("auto", "process_group"):
        m = fused(build(Net), backend=backend, first_bucket_mb=limit, bucket_cap_mb=limit)
        opt = sgd(m)
        step(m, opt, rank, 0)  # the first-step rebuild happens at the next forward
        state = {k: v.clone() for k, v in m.module.state_dict().items()}
        count, moved = collectives(lambda: step(m, opt, rank, 1))
        out[backend] = {"transport": m.stats()["transport"], "backend": m.backend,
                        "count": count, "moved": moved,
                        "sizes": m.bucket_sizes(),
                        "vs_reference": max_diff(local_average_grads(state, Net, rank, 1),
                                                 grads(m))}
    out["nccl"] = raised(lambda: fused(build(Net), backend="nccl"))
    out["unknown"] = raised(lambda: fused(build(Net), backend="mpi"))
    return out


def check_process_group(rank, world):
    """Each rank wraps its model with a process group of its own (world size 1): nothing is
    averaged with the other rank and its own initial weights are kept."""
    groups = [dist.new_group([r], backend="gloo") for r in range(world)]  # collective: all ranks
    module = build(Net, seed=100 + rank)
    initial = params(module)
    m = fused(module, process_group=groups[rank])
    out = {"weights_kept": max_diff(initial, params(m))}
    state = {k: v.clone() for k, v in m.module.state_dict().items()}
    x, y = data(rank, 0)
    loss_of(m(x), y, rank).backward()
    local = Net()
    local.load_state_dict(state)
    loss_of(local(x), y, rank).backward()
    out["vs_local"] = max_diff(grads(local), grads(m))
    out["ranks_differ"] = same_on_all_ranks([p.grad for p in m.parameters()])
    return out


def check_rebuilt_layout_vs_ddp(rank, world):
    """After DDP's rebuild (first step), DDP(bucket_cap_mb=L) buckets with limits (L, L) in the
    ready order; FusedReducer(first_bucket_mb=L, bucket_cap_mb=L) must make the same buckets.
    DDP's buckets are read from a recording comm hook."""
    limit = 700 / MiB
    out = {}
    for cls in (Ladder, Mixed):
        log = []
        models = {"ddp": DDP(build(cls), bucket_cap_mb=limit),
                  "fr": fused(build(cls), first_bucket_mb=limit, bucket_cap_mb=limit)}
        models["ddp"].register_comm_hook(None, recording_hook(models["ddp"].module, log))
        opts = {k: sgd(m) for k, m in models.items()}
        diffs = []
        for i in range(3):
            del log[:]
            for kind, m in models.items():
                step(m, opts[kind], rank, i)
            diffs.append(max_diff(grads(models["ddp"]), grads(models["fr"])))
        out[cls.__name__] = {"ddp": [names for _, names in sorted(log)],
                             "fr": models["fr"].bucket_parameter_names(), "grads": diffs,
                             "params": max_diff(params(models["ddp"]), params(models["fr"]))}
    return out


def check_layout_is_what_moves(rank, world):
    """bucket_parameter_names() and bucket_sizes() against what each step launched (a recording
    comm hook wrapping DDP's allreduce_hook: called at each launch, in launch order) and what gloo
    moved (profiler: bytes and dtype of every all-reduce)."""
    limit = 700 / MiB
    m = fused(build(Mixed), first_bucket_mb=limit, bucket_cap_mb=limit)
    module = m.module
    launches = []
    m.register_comm_hook(None, recording_hook(module, launches))
    size_of = {n: p.numel() * p.element_size() for n, p in module.named_parameters()}
    dtype_of = {n: GLOO_DTYPE[p.dtype] for n, p in module.named_parameters()}
    opt = sgd(m)
    step(m, opt, rank, 0)

    def profiled(i):
        del launches[:]
        count, moved = collectives(lambda: step(m, opt, rank, i))
        layout = m.bucket_parameter_names()
        return {"launched": [names for _, names in launches],
                "indices": [index for index, _ in launches],
                "layout": layout, "sizes": m.bucket_sizes(), "count": count, "moved": moved,
                "expected_sizes": [sum(size_of[n] for n in b) for b in layout],
                "expected_moved": sorted((sum(size_of[n] for n in b), dtype_of[b[0]])
                                         for b in layout)}
    out = {"steps": [profiled(1), profiled(2)]}
    m.first_bucket_bytes = 3000
    m.bucket_cap_bytes = 5000
    out["right_after_set"] = (m.bucket_parameter_names(), m.bucket_sizes())
    out["steps"].append(profiled(3))
    return out


def check_rebuild_from_last_observed_order(rank, world):
    """Rebuilds (automatic, rebuild_buckets(), a limit set) use the gradient order observed in
    the last step (plain PyTorch hooks, rank 0's), at the next forward, and nothing else does."""
    first, cap = 300, 300
    m = fused(build(Flip), first_bucket_mb=first / MiB, bucket_cap_mb=cap / MiB)
    module = m.module
    order, handles = observe_ready_order(module)
    opt = sgd(m)
    n = len(list(module.parameters()))
    out = {"initial": m.bucket_parameter_names(),
           "initial_expected": expected_layout(module, list(range(n - 1, -1, -1)), first, cap),
           "steps": []}

    def run(i, flip):
        del order[:]
        state = {k: v.clone() for k, v in module.state_dict().items()}
        x, y = data(rank, i)
        opt.zero_grad(set_to_none=True)
        output = m(x, flip=flip)  # a rebuild happens in this forward, if any
        layout = m.bucket_parameter_names()
        loss_of(output, y, rank).backward()
        ref = local_average_grads(state, Flip, rank, i, flip=flip)
        opt.step()
        observed = rank0(list(order))
        out["steps"].append({"layout": layout, "order": observed,
                             "limits": (m.first_bucket_bytes, m.bucket_cap_bytes,
                                        m.stats()["first_bucket_bytes"],
                                        m.stats()["bucket_cap_bytes"]),
                             "vs_reference": max_diff(ref, grads(m))})
        return layout, observed

    _, order_a = run(0, False)
    layout1, _ = run(1, True)  # automatic rebuild after the first step: from order_a
    out["after_first_step_expected"] = expected_layout(module, order_a, first, cap)
    layout2, order_b = run(2, True)
    out["order_changed"] = (order_a, order_b)
    out["no_rebuild_unasked"] = (layout1, layout2)
    m.rebuild_buckets()
    out["pending_after_rebuild_buckets"] = m.bucket_parameter_names()
    layout3, order_a2 = run(3, False)
    out["rebuild_buckets"] = (layout3, expected_layout(module, order_b, first, cap))
    m.first_bucket_bytes = 600
    m.bucket_cap_bytes = 100
    out["pending_after_set"] = m.bucket_parameter_names()
    layout4, order_b2 = run(4, True)
    out["limits_set"] = (layout4, expected_layout(module, order_a2, 600, 100))
    m.rebuild_buckets()
    layout5, _ = run(5, False)
    out["limits_kept"] = (layout5, expected_layout(module, order_b2, 600, 100))
    for h in handles:
        h.remove()
    return out


def check_limit_before_first_step(rank, world):
    """A limit set right after construction, before any step: the README says the layout is
    rebuilt at the next forward (there is no observed order yet: the initial one)."""
    m = fused(build(Flip))  # default limits: one bucket
    module = m.module
    n = len(list(module.parameters()))
    m.first_bucket_bytes = 300
    m.bucket_cap_bytes = 300
    opt = sgd(m)
    count, _ = collectives(lambda: step(m, opt, rank, 0))
    return {"allreduces": count, "in_force": m.stats()["first_bucket_bytes"],
            "layout": m.bucket_parameter_names(),
            "expected": expected_layout(module, list(range(n - 1, -1, -1)), 300, 300)}


def check_prepare_for_backward(rank, world):
    """Two backward passes of one forward (manual optimization): with prepare_for_backward()
    before the second, both are averaged; without it the second stays local (control)."""
    m = fused(build(Net))
    opt = sgd(m)
    step(m, opt, rank, 0)
    step(m, opt, rank, 1)
    out = {}
    for arm in (True, False):
        state = {k: v.clone() for k, v in m.module.state_dict().items()}
        x, y = data(rank, 5 + arm)
        m.zero_grad(set_to_none=True)
        output = m(x)
        loss_of(output, y, rank).backward(retain_graph=True)
        if arm:
            m.prepare_for_backward()
        count, _ = collectives(lambda: ((output ** 2).mean() * (1 + rank)).backward())
        # References: each backward's local gradients, averaged in float64 with all_reduce.
        ref = Net()
        ref.load_state_dict(state)
        o = ref(x)
        ps = list(ref.parameters())
        g1 = torch.autograd.grad(loss_of(o, y, rank), ps, retain_graph=True)
        g2 = torch.autograd.grad((o ** 2).mean() * (1 + rank), ps)
        names = [name for name, _ in ref.named_parameters()]
        averaged, local = {}, {}
        for name, a, b in zip(names, g1, g2):
            a, b = a.double(), b.double()
            dist.all_reduce(a)
            both = b.clone()
            dist.all_reduce(both)
            averaged[name] = ((a + both) / world).float()
            local[name] = (a / world + b).float()
        out[arm] = {"allreduces": count, "vs_both_averaged": max_diff(averaged, grads(m)),
                    "vs_second_local": max_diff(local, grads(m))}
    return out


def check_close_and_gc_remove_hooks(rank, world):
    """A graph built by the reducer's forward, then close() (or the model garbage collected),
    then its backward: no hook is left to reduce it (profiler: no collective), the gradients are
    this rank's own, as if the module had never been wrapped."""
    out = {}
    for how in ("close", "garbage collection"):
        m = fused(build(Net))
        opt = sgd(m)
        step(m, opt, rank, 0)
        module = m.module
        state = {k: v.clone() for k, v in module.state_dict().items()}
        x, y = data(rank, 1)
        module.zero_grad(set_to_none=True)
        output = m(x)  # armed: this graph's backward would be averaged
        r = {}
        if how == "close":
            m.close()
        else:
            ref = weakref.ref(m)
            del m, opt
            gc.collect()
            r["freed"] = ref() is None
        r["allreduces"], _ = collectives(lambda: loss_of(output, y, rank).backward())
        local = Net()
        local.load_state_dict(state)
        loss_of(local(x), y, rank).backward()
        r["vs_local"] = max_diff(grads(local), grads(module))
        r["ranks_differ"] = same_on_all_ranks([p.grad for p in module.parameters()])
        out[how] = r
    return out


def check_step_history_timing(rank, world):
    """Per-bucket times of step_history() and export_trace() against the gradient-ready times
    the test itself records (time.monotonic in plain PyTorch hooks), with a SLEEP_S pause in
    backward between the first bucket's gradients and the last bucket's."""
    m = fused(build(Slow), first_bucket_mb=1000 / MiB, bucket_cap_mb=1000 / MiB)
    module = m.module
    seen = {}
    handles = [p.register_post_accumulate_grad_hook(
        lambda p, n=n: seen.__setitem__(n, time.monotonic() * 1e6))
        for n, p in module.named_parameters()]
    opt = sgd(m)
    step(m, opt, rank, 0)
    step(m, opt, rank, 1)
    seen.clear()
    step(m, opt, rank, 2, sleep=True)
    for h in handles:
        h.remove()
    layout = m.bucket_parameter_names()
    origin = min(seen.values())
    history = m.step_history()[-1]
    out = {"layout": layout, "buckets": []}
    for names, b in zip(layout, history["buckets"]):
        out["buckets"].append({
            "names": names,
            "ready_first": (b["ready_first_us"], min(seen[n] for n in names) - origin),
            "ready_last": (b["ready_last_us"], max(seen[n] for n in names) - origin),
            "launch": b["launch_us"]})
    with tempfile.TemporaryDirectory() as tmp:
        path = m.export_trace(os.path.join(tmp, "trace_{rank}.json"), steps=1)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "thread_name"}
    out["fills"] = {rows[e["tid"]]: e["ts"] for e in events if e.get("name") == "fill"}
    return out


def check_slot_strides(rank, world):
    """channels_last convolutions, with and without gradient_as_bucket_view: param.grad has
    DDP's strides (with the view: the bucket slot's own), the values are DDP's."""
    out = {}
    for view in (False, True):
        models = {}
        for kind in ("ddp", "fr"):
            module = build(ConvNet).to(memory_format=torch.channels_last)
            models[kind] = (DDP(module, gradient_as_bucket_view=view) if kind == "ddp"
                            else fused(module, gradient_as_bucket_view=view,
                                       first_bucket_mb=1000 / MiB, bucket_cap_mb=1000 / MiB))
        opts = {k: sgd(m) for k, m in models.items()}
        for i in range(2):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + i))
            for kind, m in models.items():
                opts[kind].zero_grad()
                m(x.to(memory_format=torch.channels_last)).square().mean().mul(1 + rank).backward()
                opts[kind].step()
        r = {kind: {n: (tuple(p.grad.stride()), tuple(p.stride()),
                        p.grad._base is not None)
                    for n, p in m.module.named_parameters()} for kind, m in models.items()}
        r["buckets"] = len(models["fr"].bucket_sizes())
        r["params"] = max_diff(params(models["ddp"]), params(models["fr"]))
        out[view] = r
    return out


def check_powersgd_channels_last(rank, world):
    """DDP's PowerSGD hook on a model with channels_last convolutions, under DDP and under
    FusedReducer (compressing from step 2 on)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    models, out = {}, {}
    for kind in ("ddp", "fr"):
        module = build(ConvNet).to(memory_format=torch.channels_last)
        m = DDP(module) if kind == "ddp" else fused(module, first_bucket_mb=1)
        state = ps.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=1,
                                 start_powerSGD_iter=2, min_compression_rate=0.5)
        m.register_comm_hook(state, ps.powerSGD_hook)
        opt = sgd(m)

        def train_steps(m=m, opt=opt):
            for i in range(4):
                opt.zero_grad()
                x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + i))
                m(x.to(memory_format=torch.channels_last)).square().mean().mul(1 + rank).backward()
                opt.step()
        out[kind] = outcome(train_steps)[:3]
        models[kind] = m
    if out["ddp"][0] == out["fr"][0] == "ok":
        out["params"] = max_diff(params(models["ddp"]), params(models["fr"]))
    return out


def check_scaled_before_summed(rank, world):
    """Gradients near float32's largest value (3e38 on rank 0, 2e38 on rank 1): scaled by 1/2
    and then summed, the average 2.5e38 is finite; summed first, 5e38 overflows to inf."""
    c = (3.0 - rank) * 1e38
    out = {}
    for kind in ("ddp", "fr"):
        m = DDP(build(Huge)) if kind == "ddp" else fused(build(Huge))
        for _ in range(2):
            m.zero_grad()
            m(c).backward()
        out[kind] = m.module.w.grad.clone()
    return {"finite": bool(torch.isfinite(out["fr"]).all()),
            "ddp_finite": bool(torch.isfinite(out["ddp"]).all()),
            "vs_ddp": max_diff({"w": out["ddp"]}, {"w": out["fr"]}),
            "value": out["fr"][0].item()}


def check_buffers_at_construction(rank, world):
    """A buffer that differs by rank before wrapping: what each rank holds right after the
    wrapper's construction, under DDP and FusedReducer, for broadcast_buffers True and False."""
    out = {}
    for flag in (True, False):
        for kind in ("ddp", "fr"):
            module = build(StatNet)
            module.stat.fill_(rank + 1.0)
            with warnings.catch_warnings():  # torch 2.14 deprecates broadcast_buffers in DDP
                warnings.simplefilter("ignore")
                DDP(module, broadcast_buffers=flag) if kind == "ddp" else \
                    fused(module, broadcast_buffers=flag)
            out[f"{flag}/{kind}"] = module.stat[0].item()
    return out


def check_find_unused_collectives(rank, world):
    """find_unused_parameters=True ('extra' never used): the collectives of a step (profiler:
    count, bytes and dtype of each) are DDP's: the buckets plus one small int32 map."""
    out = {}
    for kind in ("ddp", "fr", "fr_all_used"):
        if kind == "ddp":
            m = DDP(build(ExtraNet), find_unused_parameters=True)
        else:
            m = fused(build(ExtraNet), find_unused_parameters=kind == "fr")
        fwd = {"use_extra": kind == "fr_all_used"}
        opt = sgd(m)
        for i in range(2):
            step(m, opt, rank, i, **fwd)
        count, moved = collectives(lambda: step(m, opt, rank, 2, **fwd))
        out[kind] = {"count": count, "moved": moved,
                     "buckets": None if kind == "ddp" else len(m.bucket_sizes()),
                     "params": len(list(m.parameters()))}
    return out


def check_grad_scaler(rank, world):
    """GradScaler with a non-finite loss on rank 1 at step 1: the averaged gradients are not
    finite on every rank, so every rank skips that step and lowers the scale, as under DDP."""
    models = {"ddp": DDP(build(Net)), "fr": fused(build(Net))}
    opts = {k: sgd(m) for k, m in models.items()}
    scalers = {k: torch.amp.GradScaler("cpu", init_scale=1024.0) for k in models}
    out = {"params": [], "scale": {k: [] for k in models}, "skipped": {k: [] for k in models}}
    for i in range(4):
        for kind, m in models.items():
            before = params(m)
            opts[kind].zero_grad()
            x, y = data(rank, i)
            loss = loss_of(m(x), y, rank)
            if i == 1 and rank == 1:
                loss = loss * float("inf")
            scalers[kind].scale(loss).backward()
            scalers[kind].step(opts[kind])
            scalers[kind].update()
            out["scale"][kind].append(scalers[kind].get_scale())
            out["skipped"][kind].append(max_diff(before, params(m)) == 0.0)
        out["params"].append(max_diff(params(models["ddp"]), params(models["fr"])))
    out["synced"] = same_on_all_ranks(list(models["fr"].parameters()))
    return out


# -- the spawn: only the checks of the selected tests ----------------------------------------------

CHECKS = SelectedChecks()
uses = CHECKS.uses


@pytest.fixture(scope="module")
def outcomes(request):
    return CHECKS.run(request, 2, timeout=180)


# -- tests -----------------------------------------------------------------------------------------

@uses(check_defaults_and_stats)
def test_defaults_and_stats_step_count_synchronised_backwards(outcomes):
    for r in results(outcomes, check_defaults_and_stats):
        # bucket_cap_mb=25, first bucket 1 MiB when nothing is set, last bucket off, own dtype
        assert r["limits"] == (MiB, 25 * MiB, 0, None), r["limits"]
        assert r["autotune"] == "not started"
        assert r["transport"] == "shm"  # CPU ranks of one host
        assert r["step_before"] == 0
        # 3 synchronised backward passes; neither the no_sync one nor the unarmed one counts
        assert r["step"] == 3, r
        assert r["history_steps"] == [1, 2, 3], r
        assert_small([r["vs_reference"]], "grads vs float64 average")
        assert r["grads_are_views"] == [], "gradient_as_bucket_view is off by default"


@uses(check_backend)
def test_backend_routes_buckets_through_shared_memory_or_the_process_group_or_is_refused(
        outcomes):
    import fused_reducer
    for r in results(outcomes, check_backend):
        assert (r["auto"]["transport"], r["auto"]["backend"]) == ("shm", "shm"), r["auto"]
        assert r["process_group"]["transport"] == "process_group(gloo)", r["process_group"]
        assert r["process_group"]["backend"] == "process_group", r["process_group"]
        for backend in ("auto", "process_group"):
            s = r[backend]
            assert len(s["sizes"]) == 2, (backend, s)
            assert s["count"] == 2, f"{backend}: {s['count']} all-reduces"
            assert s["moved"] == sorted((b, "float") for b in s["sizes"]), (backend, s)
            assert_small([s["vs_reference"]], f"{backend}: grads vs float64 average")
        assert r["nccl"][0] == "raised", "backend='nccl' with CPU parameters was accepted"
        kind, message = r["nccl"][1:3]
        if fused_reducer.build_info()["cuda"]:
            assert kind == "ValueError" and "nccl" in message and "cpu" in message, r["nccl"]
        else:
            assert kind == "RuntimeError" and "without CUDA" in message, r["nccl"]
        assert r["unknown"][:2] == ("raised", "ValueError") and "'mpi'" in r["unknown"][2], r


@uses(check_process_group)
def test_process_group_argument_is_the_group_averaged_over(outcomes):
    for rank, r in enumerate(results(outcomes, check_process_group)):
        assert r["weights_kept"] == 0.0, "weights broadcast from outside the group"
        assert_small([r["vs_local"]], "grads vs this rank's local grads (a group of one)")
        if rank == 1:
            assert r["ranks_differ"] > 0, "gradients were averaged across the two ranks"


@uses(check_rebuilt_layout_vs_ddp)
def test_rebuilt_layout_is_ddps_for_one_and_for_mixed_dtypes(outcomes):
    for r in results(outcomes, check_rebuilt_layout_vs_ddp):
        one, mixed = r["Ladder"], r["Mixed"]
        assert len(one["ddp"]) >= 4 and any(len(b) > 1 for b in one["ddp"]), one["ddp"]
        assert one["fr"] == one["ddp"], "one dtype: same buckets, same launch order"
        # Mixed dtypes: the same buckets (each one dtype); DDP orders them by when they closed.
        assert sorted(mixed["fr"]) == sorted(mixed["ddp"]), (mixed["fr"], mixed["ddp"])
        for s in (one, mixed):
            assert_small(s["grads"], "grads vs DDP", 1e-5)
            assert_small([s["params"]], "params vs DDP", 1e-5)


@uses(check_layout_is_what_moves)
def test_bucket_sizes_and_names_are_what_moves_in_launch_order(outcomes):
    for r in results(outcomes, check_layout_is_what_moves):
        s1, s2, s3 = r["steps"]
        for s in r["steps"]:
            assert len(s["layout"]) >= 3, s
            assert s["launched"] == s["layout"], "launch order is not bucket_parameter_names()"
            assert s["indices"] == list(range(len(s["layout"]))), s["indices"]
            assert s["sizes"] == s["expected_sizes"], s
            assert s["count"] == len(s["layout"]) and s["moved"] == s["expected_moved"], s
        assert s1["layout"] == s2["layout"]
        # Set, not yet in force: the layout of the last step until the next forward.
        assert r["right_after_set"] == (s2["layout"], s2["sizes"])
        assert s3["layout"] != s2["layout"], "the new limits changed nothing"


@uses(check_rebuild_from_last_observed_order)
def test_limits_and_rebuild_buckets_rebuild_from_the_last_observed_order_and_persist(outcomes):
    for r in results(outcomes, check_rebuild_from_last_observed_order):
        order_a, order_b = r["order_changed"]
        assert order_a != order_b, "precondition: flip must change the gradient order"
        assert r["initial"] == r["initial_expected"]
        layout1, layout2 = r["no_rebuild_unasked"]
        assert layout1 == r["after_first_step_expected"], "rebuild after the first step"
        assert layout2 == layout1, "rebuilt although nothing asked for it"
        assert r["pending_after_rebuild_buckets"] == layout2, "rebuilt before the next forward"
        got, expected = r["rebuild_buckets"]
        assert expected != layout2, "precondition: the new order must change the layout"
        assert got == expected, "rebuild_buckets(): not from the last observed order"
        assert r["pending_after_set"] == got
        assert r["limits_set"][1] != expected, "precondition: the limits must change the layout"
        got, expected = r["limits_set"]
        assert got == expected, "setting the limits: not from the last observed order"
        got, expected = r["limits_kept"]
        assert got == expected, "a later rebuild did not keep the limits"
        assert r["steps"][-1]["limits"] == (600, 100, 600, 100), r["steps"][-1]
        assert_small([s["vs_reference"] for s in r["steps"]], "grads vs float64 average")


@uses(check_limit_before_first_step)
def test_a_limit_set_before_the_first_step_applies_at_the_next_forward(outcomes):
    for r in results(outcomes, check_limit_before_first_step):
        assert r["in_force"] == 300, f"limit in force after the next forward: {r['in_force']}"
        assert r["layout"] == r["expected"]
        assert r["allreduces"] == len(r["expected"]), r


@uses(check_prepare_for_backward)
def test_prepare_for_backward_averages_one_more_backward_of_the_same_forward(outcomes):
    for r in results(outcomes, check_prepare_for_backward):
        armed, control = r[True], r[False]
        assert armed["allreduces"] >= 1, armed
        assert_small([armed["vs_both_averaged"]], "both backward passes averaged")
        # Without prepare_for_backward() the second backward stays local, as documented.
        assert control["allreduces"] == 0, control
        assert_small([control["vs_second_local"]], "control: second backward local")
        assert armed["vs_second_local"] > 1e-4 and control["vs_both_averaged"] > 1e-4, r


@uses(check_close_and_gc_remove_hooks)
def test_close_and_garbage_collection_remove_the_hooks(outcomes):
    for rank, r in enumerate(results(outcomes, check_close_and_gc_remove_hooks)):
        assert r["garbage collection"]["freed"], "the model was not garbage collected"
        for how, s in r.items():
            assert s["allreduces"] == 0, f"{how}: a hook still reduced: {s}"
            assert_small([s["vs_local"]], f"{how}: grads vs this rank's local grads")
            if rank == 1:
                assert s["ranks_differ"] > 0, f"{how}: gradients were averaged"


AT_EXIT_SCRIPT = r"""
import gc, sys
import torch, torch.distributed as dist
from torch import nn
from fused_reducer import FusedReducer
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
original = FusedReducer.close
def close(self):  # is_finalizing(): False in atexit handlers, True in the teardown after them
    print("close", self.tag, "while finalizing" if sys.is_finalizing() else "", flush=True)
    original(self)
FusedReducer.close = close
kept = FusedReducer(nn.Linear(4, 4))
kept.tag = "kept"
dropped = FusedReducer(nn.Linear(4, 4))
dropped.tag = "dropped"
for model in (kept, dropped):
    model(torch.randn(2, 4)).sum().backward()
del model, dropped
gc.collect()
print("end of script", flush=True)
"""


def test_close_runs_on_garbage_collection_and_at_exit(tmp_path):
    """A 1-rank subprocess: close() runs when a model is garbage collected, and, for a model
    still alive when the interpreter exits, at exit (an atexit handler: before the interpreter's
    teardown, not from __del__ during it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(ENV, None)
    result = subprocess.run([sys.executable, "-c", AT_EXIT_SCRIPT, str(tmp_path / "store")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    assert lines == ["close dropped", "end of script", "close kept"], (lines, result.stderr[-2000:])


@uses(check_step_history_timing)
def test_step_history_and_trace_time_each_bucket_like_the_tests_own_clock(outcomes):
    tol = 0.3 * SLEEP_S * 1e6  # µs: room for a loaded 2-core machine, well below the pause
    for r in results(outcomes, check_step_history_timing):
        first, last = r["buckets"][0], r["buckets"][-1]
        assert len(r["buckets"]) == 2 and set(last["names"]) == {"inp.weight", "inp.bias"}, r
        for b in r["buckets"]:
            for what in ("ready_first", "ready_last"):
                got, expected = b[what]
                assert abs(got - expected) < tol, (b["names"], what, got, expected)
        assert last["ready_first"][1] - first["ready_last"][1] > 0.9 * SLEEP_S * 1e6, r
        # The first bucket was launched before the pause ended: overlapping backward.
        assert first["launch"] < last["ready_first"][0] - 0.5 * SLEEP_S * 1e6, r
        gap = r["fills"]["bucket 1"] - r["fills"]["bucket 0"]
        expected_gap = last["ready_first"][1] - first["ready_first"][1]
        assert abs(gap - expected_gap) < tol, (r["fills"], expected_gap)


@uses(check_slot_strides)
def test_bucket_slots_keep_the_parameters_strides_like_ddps(outcomes):
    for r in results(outcomes, check_slot_strides):
        for view, s in r.items():
            assert s["buckets"] > 1, s
            conv = s["ddp"]["conv1.weight"]
            assert conv[0] == conv[1] != (27, 9, 3, 1), f"DDP side changed: {conv}"
            assert s["fr"] == s["ddp"], f"gradient_as_bucket_view={view}: strides (grad, " \
                f"param, is a view) differ from DDP's: {s['fr']} vs {s['ddp']}"
            assert_small([s["params"]], f"gradient_as_bucket_view={view}: params vs DDP", 1e-5)


@uses(check_powersgd_channels_last)
def test_powersgd_hook_on_a_channels_last_model_trains_like_ddp(outcomes):
    for r in results(outcomes, check_powersgd_channels_last):
        assert r["ddp"] == ("ok", None), f"DDP side changed: {r['ddp']}"
        assert r["fr"] == ("ok", None), r["fr"]
        assert_small([r["params"]], "params vs DDP", 1e-5)


@uses(check_scaled_before_summed)
def test_gradients_are_scaled_before_they_are_summed_like_ddp(outcomes):
    for r in results(outcomes, check_scaled_before_summed):
        assert r["ddp_finite"], "DDP side changed"
        assert r["finite"], "the sum overflowed: gradients were summed before scaling"
        assert r["vs_ddp"] == 0.0, r
        assert r["value"] == pytest.approx(2.5e38, rel=1e-6)


@uses(check_buffers_at_construction)
def test_buffers_are_broadcast_at_construction_like_ddp(outcomes):
    for r in results(outcomes, check_buffers_at_construction):
        assert r["True/ddp"] == 1.0, "DDP side changed"
        assert r["True/fr"] == r["True/ddp"], "rank 0's buffer was not broadcast at construction"


@uses(check_buffers_at_construction)
def test_broadcast_buffers_false_keeps_rank_local_buffers_at_construction_like_ddp(outcomes):
    for rank, r in enumerate(results(outcomes, check_buffers_at_construction)):
        assert r["False/ddp"] == rank + 1.0, "DDP side changed"
        assert r["False/fr"] == r["False/ddp"], f"rank {rank}: {r}"


@uses(check_find_unused_collectives)
def test_find_unused_parameters_runs_ddps_collectives(outcomes):
    for r in results(outcomes, check_find_unused_collectives):
        ddp, fr, plain = r["ddp"], r["fr"], r["fr_all_used"]
        assert plain["count"] == plain["buckets"], plain
        assert fr["count"] == fr["buckets"] + 1, fr  # one extra all-reduce per step
        assert fr["count"] == ddp["count"], (fr, ddp)
        assert fr["moved"] == ddp["moved"], (fr["moved"], ddp["moved"])
        assert (4 * fr["params"], "int") in fr["moved"], fr["moved"]  # small: one int32/param


@uses(check_grad_scaler)
def test_grad_scaler_skips_the_same_steps_on_every_rank_like_ddp(outcomes):
    for r in results(outcomes, check_grad_scaler):
        assert r["skipped"]["ddp"] == [False, True, False, False], "DDP side changed"
        assert r["skipped"]["fr"] == r["skipped"]["ddp"], r["skipped"]
        assert r["scale"]["fr"] == r["scale"]["ddp"], r["scale"]
        assert_small(r["params"], "params vs DDP", 1e-5)
        assert r["synced"] == 0.0
