"""One log line per scheduler rank saying the plugin is active there.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
import os

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, PATCH_MODULES, PLUGIN_NAME, Patch

logger = logging.getLogger(__name__)


def report_rank(result, *args, **kwargs) -> None:
    """AFTER hook: one INFO line naming this scheduler's ranks and the active patch modules."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    logger.info(
        "%s active in scheduler pid %d: tp_rank=%d/%d dp_rank=%s pp_rank=%d; patch modules %s",
        PLUGIN_NAME,
        os.getpid(),
        parallel.tp_rank,
        parallel.tp_size,
        parallel.dp_rank,
        parallel.pp_rank,
        ", ".join(PATCH_MODULES),
    )


PATCHES = (
    Patch(
        title="One log line per scheduler rank",
        target="sglang.srt.managers.scheduler.configure_scheduler_process",
        kind=HookType.AFTER,
        hook=report_rank,
        platforms=ON_NPU_AND_CPU,
        why=(
            "with `--tp-size`/`--dp-size` > 1 every rank is its own scheduler process, and a patch missing in one "
            "of them gives wrong answers only on that rank's share of the heads or requests. sglang runs "
            "`load_plugins()` in each of them before the scheduler's logger is configured, so the server log shows "
            "nothing per rank; this line is the evidence the multi-rank tests and operators read."
        ),
        how=(
            "after stock `configure_scheduler_process` has set the rank prefix of the log format (`DP1`, `TP0`), "
            "log the process's TP/DP/PP ranks, its pid and the plugin's patch modules. Changes no behaviour."
        ),
        upstream="a diagnostic, not a fix",
        remove_when="sglang logs the loaded plugins per scheduler rank",
    ),
)
