"""`distill.py --plan`: the tokens, disk, memory per device and time of every stage, before
anything runs (plan/estimate.py)."""

from plan.estimate import DEVICES, Plan, StagePlan, make_plan

__all__ = ["DEVICES", "Plan", "StagePlan", "make_plan"]
