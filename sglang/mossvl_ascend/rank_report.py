"""One log line per scheduler rank saying the plugin is active there (issue 14, item 14).

Catalog
-------
**Hook: per-rank plugin report** (item 14)

- *target*: ``sglang.srt.managers.scheduler.configure_scheduler_process`` (AFTER).
- *why*: with ``--tp-size``/``--dp-size`` > 1 every rank is its own scheduler process, and a hook that is
  missing in one of them gives wrong answers only on that rank's share of the heads or requests. sglang runs
  ``load_plugins()`` in each of them, but before the scheduler's logger is configured, so the server log
  shows nothing per rank. This line is the evidence the multi-rank tests (and an operator) read.
- *how*: after stock ``configure_scheduler_process`` has set the rank prefix of the log format (``DP1``,
  ``TP0``), log the process's TP/DP/PP ranks, its pid and this plugin's patch modules. Registered on NPU
  and on the CPU engine only; it changes no behaviour.
- *upstream status / when to remove*: a diagnostic, not a fix. Remove when sglang logs the loaded plugins
  per scheduler rank.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler.configure_scheduler_process"


def report_rank(result, *args, **kwargs) -> None:
    """AFTER hook: one INFO line naming this scheduler's ranks and the active patch modules."""
    from sglang.srt.runtime_context import get_parallel

    from mossvl_ascend import PATCH_MODULES, PLUGIN_NAME

    parallel = get_parallel()
    logger.info(
        "%s active in scheduler pid %d: tp_rank=%d/%d dp_rank=%s pp_rank=%d; patch modules %s",
        PLUGIN_NAME, os.getpid(), parallel.tp_rank, parallel.tp_size, parallel.dp_rank, parallel.pp_rank,
        ", ".join(PATCH_MODULES),
    )


def register() -> None:
    from sglang.srt.utils import is_cpu, is_npu

    if is_cpu() or is_npu():
        HookRegistry.register(TARGET, report_rank, HookType.AFTER)
