"""Old path of ``AgentScheduler``, kept because launch lines name it: ``--scheduler-cls
qwen4exp.vllm.scheduler.AgentScheduler`` (vLLM resolves the class by this dotted path). The scheduler lives in
``qwen4exp.serving.scheduler``, the documented path; this module only forwards the two class names to it, when asked
(so the model binding does not import the serving package at import time). No other old path is kept.
"""

from __future__ import annotations

_FORWARDED = ("AgentScheduler", "AsyncAgentScheduler")


def __getattr__(name: str):
    if name in _FORWARDED:
        from qwen4exp.serving import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the scheduler moved to "
                         f"qwen4exp.serving.scheduler)")
