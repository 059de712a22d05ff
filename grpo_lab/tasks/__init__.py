"""Prompt sources: reasoning-gym generators, local files and HF datasets.

Public API::

    TaskItem(prompt: str, answer: str, solution: str, fields: dict)
    Task(name: str, splits: {"train"|"dev"|"test": list[TaskItem]}, info: dict); .alphabet() -> str
    TASKS: Registry("task source"), fn(**kwargs) -> Task
        reasoning_gym (grpo_lab.tasks.reasoning_gym_source)
        local_dataset (grpo_lab.tasks.local_dataset)
        or a plug-in factory "package.module:function" (task.source)
    build_task(task_cfg) -> Task: the task a `task` config section describes
    task_label(task_cfg) -> str: what run names and tags call it (a local dataset: its file stem)
"""

from . import local_dataset as _local_dataset  # noqa: F401  (registers "local_dataset")
from . import reasoning_gym_source as _reasoning_gym_source  # noqa: F401  (registers "reasoning_gym")
from .base import SPLITS, TASKS, Task, TaskItem, build_task, task_label
from .reasoning_gym_source import COMPACT_FORMATS

__all__ = ["COMPACT_FORMATS", "SPLITS", "TASKS", "Task", "TaskItem", "build_task", "task_label"]
