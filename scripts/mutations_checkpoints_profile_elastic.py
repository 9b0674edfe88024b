"""Mutation entries for one area (issue 38); same format as scripts/mutations.py's MUTATIONS:
what export_profile records across ranks, fused_reducer.transports.elastic's store keys and
attribution, and the Hugging Face Trainer adapter's checkpoints of a ShardedOptimizer."""

PROFILE = "python/fused_reducer/tuning/profile.py"
ELASTIC = "python/fused_reducer/transports/elastic.py"
HF = "python/fused_reducer/transformers.py"
PE = "tests/test_profile_export.py::"
EL = "tests/test_elastic.py::"
HFT = "tests/test_hf.py::"

MUTATIONS = [
    # -- export_profile across ranks ---------------------------------------------------------------
    dict(
        id="profile-phases-own-rank",
        file=PROFILE,
        edits=[("    slowest = control_allreduce([phases[k] for k in _PHASES], dist.ReduceOp.MAX, "
                "group, control)\n",
                "    slowest = [phases[k] for k in _PHASES]\n")],
        why="each rank's profile holds its own step phases instead of the slowest rank's: rank "
            "0's profile (the one written) plans for a forward and copy back faster than the "
            "step every collective waits for",
        tests=[PE + "test_profile_phases_are_the_slowest_ranks_medians_on_every_rank"],
    ),
    dict(
        id="profile-bucket-waits-max",
        file=PROFILE,
        edits=[("summed = control_allreduce(waits + copy_backs, dist.ReduceOp.SUM, group, control)",
                "summed = control_allreduce(waits + copy_backs, dist.ReduceOp.MAX, group, control)"),
               ("[v / world for v in summed[:len(waits)]]", "[v for v in summed[:len(waits)]]"),
               ("else v / world\n", "else v\n")],
        why="the per-bucket waits after backward are the slowest rank's instead of the mean over "
            "ranks (docs/PLANNING.md): the planner charges every late bucket the worst rank's "
            "wait, which the anchor already holds, and over-predicts layouts with late buckets",
        tests=[PE + "test_profile_bucket_waits_are_the_mean_over_ranks_of_each_ranks_median"],
    ),
    dict(
        id="profile-late-bytes-inverted",
        file=PROFILE,
        edits=[("zip(s[\"buckets\"], _late_buckets(s)) if late)",
                "zip(s[\"buckets\"], _late_buckets(s)) if not late)")],
        why="late_bytes counts the buckets unpacked during backward instead of those after it: "
            "the planner scales the copy back by the wrong bytes",
        tests=[PE + "test_profile_phases_are_the_slowest_ranks_medians_on_every_rank"],
    ),
    dict(
        id="profile-world-size-global",
        file=PROFILE,
        edits=[("        \"world_size\": world,\n",
                "        \"world_size\": dist.get_world_size(),\n")],
        why="the profile records the job's world size, not the DP group's the FusedReducer "
            "reduces over: under tensor/pipeline parallelism the planner plans a ring of the "
            "wrong size",
        tests=[PE + "test_profile_records_the_dp_groups_world_size_and_its_rank_0_writes"],
    ),
    dict(
        id="profile-writer-global-rank",
        file=PROFILE,
        edits=[("    rank = dist.get_rank(group)\n", "    rank = dist.get_rank()\n")],
        why="the writing rank is the job's rank 0, not the DP group's: a DP group without global "
            "rank 0 writes no profile at all (and {rank} names clash across groups otherwise)",
        tests=[PE + "test_profile_records_the_dp_groups_world_size_and_its_rank_0_writes"],
    ),
    dict(
        id="profile-names-all-parameters",
        file=PROFILE,
        edits=[("zip(model.attachment.param_names, info.sizes, info.groups, ready)",
                "zip([n for n, _ in model.module.named_parameters()], info.sizes, info.groups, "
                "ready)")],
        why="names paired from all the module's parameters while sizes are the reduced ones: "
            "with a DDP ignore list every name after the ignored one carries its neighbour's "
            "bytes",
        tests=[PE + "test_profile_params_and_buckets_are_the_reduced_parameters_with_their_measured_sizes"],
    ),
    dict(
        id="profile-buckets-reversed",
        file=PROFILE,
        edits=[("for b in reducer.bucket_params()]", "for b in reversed(reducer.bucket_params())]")],
        why="the layout is written last bucket first (parameter order instead of launch order): "
            "the planner's recorded layout puts the big late bucket first",
        tests=[PE + "test_profile_params_and_buckets_are_the_reduced_parameters_with_their_measured_sizes"],
    ),
    # -- fused_reducer.transports.elastic ----------------------------------------------------------
    dict(
        id="elastic-removes-one-key-too-few",
        file=ELASTIC,
        edits=[("        for key in removed:\n", "        for key in removed[1:]:\n")],
        why="one of the dead attempt's keys of torch's group stays in the store (and is still "
            "reported removed): the restarted gloo group can connect to that dead peer",
        tests=[EL + "test_forget_dead_attempt_keys_removes_exactly_torchs_group_keys_of_the_dead_attempt"],
    ),
    dict(
        id="elastic-removes-fused-reducer-keys",
        file=ELASTIC,
        edits=[(" and FUSED_REDUCER_MARK not in k)", ")")],
        why="FusedReducer's own keys under default_pg/ are removed too, though their namespace "
            "is per attempt: a rank still reading them (another group) loses them",
        tests=[EL + "test_forget_dead_attempt_keys_removes_exactly_torchs_group_keys_of_the_dead_attempt"],
    ),
    dict(
        id="elastic-prefix-anywhere",
        file=ELASTIC,
        edits=[("if k.startswith(DEFAULT_GROUP_PREFIX) and", "if DEFAULT_GROUP_PREFIX in k and")],
        why="a key is taken for torch's group when default_pg/ appears anywhere in it: the job's "
            "own keys that spell it are deleted",
        tests=[EL + "test_forget_dead_attempt_keys_removes_exactly_torchs_group_keys_of_the_dead_attempt"],
    ),
    dict(
        id="elastic-attributes-without-agent-store",
        file=ELASTIC,
        edits=[("    if attempt == 0 or os.environ.get(\"TORCHELASTIC_USE_AGENT_STORE\") != \"True\":\n"
                "        return None\n",
                "    if attempt == 0:\n        return None\n")],
        why="any restarted attempt's failure is blamed on torch's stale keys, also with a fresh "
            "store per attempt (no stale keys): a real failure is explained away",
        tests=[EL + "test_restart_failure_attributes_to_torch_only_in_a_restarted_attempt_over_the_agent_store"],
    ),
    dict(
        id="elastic-advice-any-earlier-removal",
        file=ELASTIC,
        edits=[("    if _forgotten_in_attempt == attempt:\n",
                "    if _forgotten_in_attempt is not None:\n")],
        why="a removal in an earlier attempt counts for this one: the user is told the keys were "
            "removed and to read the peers' logs, while this attempt never removed them",
        tests=[EL + "test_restart_failure_attributes_to_torch_only_in_a_restarted_attempt_over_the_agent_store"],
    ),
    # -- the Hugging Face Trainer adapter with a ShardedOptimizer ----------------------------------
    dict(
        id="hf-checkpoint-state-kept-from-first-save",
        file=HF,
        edits=[("            try:\n                return super()._save_optimizer_and_scheduler(output_dir)\n"
                "            finally:\n                del sharded.state_dict\n",
                "            return super()._save_optimizer_and_scheduler(output_dir)\n")],
        why="the consolidated state computed for one checkpoint stays patched in: every later "
            "checkpoint saves the first checkpoint's optimizer state (a resume from it restarts "
            "the moments from an earlier step)",
        tests=[HFT + "test_trainer_checkpoints_of_a_sharded_optimizer_hold_ddps_full_adamw_state_at_that_step"],
    ),
    dict(
        id="hf-checkpoint-local-state",
        file=HF,
        edits=[("            state = sharded.state_dict()\n",
                "            state = super(ShardedOptimizer, sharded).state_dict()\n")],
        why="the checkpoint takes torch.optim.Optimizer's state_dict of the ShardedOptimizer (no "
            "consolidation across ranks, no collective): the saved state lacks the moments",
        tests=[HFT + "test_trainer_checkpoints_of_a_sharded_optimizer_hold_ddps_full_adamw_state_at_that_step"],
    ),
    dict(
        id="hf-sharded-request-not-sharded",
        file=HF,
        edits=[("            self.accelerator.shard_when_prepared(optimizer, **sharded)\n", "")],
        why="optimizer_cls_and_kwargs=(ShardedOptimizer, ...) trains a plain optimizer_class on "
            "every rank: no memory saved, and no error saying so",
        tests=[HFT + "test_trainer_checkpoints_of_a_sharded_optimizer_hold_ddps_full_adamw_state_at_that_step"],
    ),
]
