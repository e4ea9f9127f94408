"""`distill.py --plan`: the tokens, disk, memory per device and time of every stage, before
anything runs. The planner (plan/estimate.py) loops over the stages' own estimates
(distill/estimate.py, train/estimate.py, eval/estimate.py), which the entry script names."""

from plan.estimate import DEVICES, Plan, Sizing, StagePlan, make_plan

__all__ = ["DEVICES", "Plan", "Sizing", "StagePlan", "make_plan"]
