"""The step scheduler: who runs this step and how much (``core``), from the waiting queue
(``engine/policy.py``, ``engine/fair_share.py``), under the step budget (``budget``), with
pages (``pages``) and preemption (``preemption``)."""

from engine.scheduler.budget import StepBudget, StepCosts
from engine.scheduler.core import Scheduler
from engine.scheduler.output import Drafter, ScheduledSeq, SchedulerOutput

__all__ = ["Drafter", "ScheduledSeq", "Scheduler", "SchedulerOutput", "StepBudget", "StepCosts"]
