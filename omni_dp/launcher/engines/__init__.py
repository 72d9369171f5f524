"""Engine adapters: one module per engine behind the protocol in base.py.

The supervisor and the router never look inside an engine. Adding one means a module here and
an entry in ENGINES; the plan, bring-up, restarts and teardown stay as they are.
"""

from __future__ import annotations

from omni_dp.launcher.engines.base import (
    EngineAdapter,
    EngineSizing,
    EngineUnreadable,
    KvPlan,
    KvRequest,
    ModelFacts,
    ReplicaLaunch,
    flag_problems,
    flag_value,
    split_model,
)
from omni_dp.launcher.engines.builtin import BuiltinEngine
from omni_dp.launcher.engines.sglang import SglangEngine
from omni_dp.launcher.engines.sglang_omni import SglangOmniEngine
from omni_dp.launcher.engines.vllm import VllmEngine
from omni_dp.launcher.engines.vllm_omni import VllmOmniEngine

ENGINES: dict[str, EngineAdapter] = {
    "builtin": BuiltinEngine(),
    "vllm": VllmEngine(),
    "sglang": SglangEngine(),
    "sglang-omni": SglangOmniEngine(),
    "vllm-omni": VllmOmniEngine(),
}

__all__ = [
    "ENGINES",
    "BuiltinEngine",
    "EngineAdapter",
    "EngineSizing",
    "EngineUnreadable",
    "KvPlan",
    "KvRequest",
    "ModelFacts",
    "ReplicaLaunch",
    "SglangEngine",
    "SglangOmniEngine",
    "VllmEngine",
    "VllmOmniEngine",
    "flag_problems",
    "flag_value",
    "reserved_flag_problems",
    "split_model",
]


def reserved_flag_problems(engine: EngineAdapter, engine_args: tuple[str, ...]) -> list[str]:
    """The user's engine arguments that would override what the launcher sets (exit 2)."""
    return flag_problems(engine.reserved_flags, engine_args, engine.name)
