"""What each served test module costs: its wall seconds (setup + call + teardown of its tests), the seconds its
servers took to start, how many it started and how many it borrowed from the pool (``support.server_pool``).

``tests/conftest.py`` feeds it (``current_module`` before each test, every server start through the wrapped
``SglangServer.start``, every reuse through the pool) and writes ``build/test-timings.json`` at the session's end;
under pytest-xdist each worker keeps its own and the controller merges them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


class SuiteTimings:
    def __init__(self):
        self.current_module = "(no test)"
        self.from_workers = False  # an xdist controller: the rows are the workers', merged
        self.modules = defaultdict(
            lambda: {"wall_s": 0.0, "startup_s": 0.0, "servers_started": 0, "servers_reused": 0, "served": False}
        )

    def add_test_phase(self, module: str, seconds: float, served: bool) -> None:
        row = self.modules[module]
        row["wall_s"] += seconds
        row["served"] |= served

    def add_server_start(self, seconds: float) -> None:
        row = self.modules[self.current_module]
        row["startup_s"] += seconds
        row["servers_started"] += 1

    def add_server_reuse(self) -> None:
        self.modules[self.current_module]["servers_reused"] += 1

    def rows(self) -> dict[str, dict]:
        return {module: dict(row) for module, row in self.modules.items()}

    def merge(self, rows: dict[str, dict]) -> None:
        """Add another process's rows (an xdist worker's) to these."""
        for module, other in rows.items():
            row = self.modules[module]
            for key, value in other.items():
                row[key] = row[key] | value if key == "served" else row[key] + value

    def served_rows(self) -> list[tuple[str, dict]]:
        """Modules that ran a served test or started a server, most expensive first."""
        rows = [(m, r) for m, r in self.modules.items() if r["served"] or r["servers_started"]]
        return sorted(rows, key=lambda item: -item[1]["wall_s"])

    def table(self) -> str:
        lines = ["| module | wall s | server start-up s | servers started | reused |", "|---|---:|---:|---:|---:|"]
        for module, row in self.served_rows():
            lines.append(
                f"| `{module}` | {row['wall_s']:.0f} | {row['startup_s']:.0f} | {row['servers_started']} "
                f"| {row['servers_reused']} |"
            )
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        rounded = {
            m: {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for m, r in self.modules.items()
        }
        path.write_text(json.dumps(rounded, indent=2, sort_keys=True) + "\n")
