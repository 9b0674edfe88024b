"""`fused_reducer.plan`: the what-if planner's entry point.

    python -m fused_reducer.plan PROFILE --world 8,64,512 --gpus-per-node 8 --network ib400

runs its command line (options: `python -m fused_reducer.plan --help`, docs/PLANNING.md). From
Python, `make_plan(...)` / `Planner` give the same predictions and `main(argv)` runs the command
line. The planner lives in the tuning layer (tuning/plan.py), next to the cost model and the
autotuner that reads its plans; this module only names it for users.
"""
import sys

from .tuning.plan import (PLAN_FORMAT, PLAN_VERSION, PlanInputError, Planner, build_network,
                          format_plan, main, make_plan)

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "PlanInputError", "Planner", "build_network", "format_plan",
           "main", "make_plan"]

if __name__ == "__main__":
    sys.exit(main())
