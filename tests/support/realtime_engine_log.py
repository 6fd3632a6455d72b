"""Did the engine compute only each realtime step's new rows? Read from stock sglang's own prefill log lines.

The plugin logs each finished step (``realtime step <rid>: extended R rows, ... session holds E encoder + T text
rows``) from its step plan; a check on those counts alone cannot see a step that silently re-prefilled the whole
session. Stock's ``Prefill batch`` line (``support.serving.engine_prefills``: ``#new-token`` what the engine
extended, ``#cached-token`` the prefix it reused) can: a step after a session's first must appear there as a batch
that extended exactly its R new rows on a cached prefix of exactly the session's rows so far (its encoder rows at
this step, grown for new frames before the prefill, plus its text rows when the step before it finished). A full
re-prefill shows as a batch of the whole row with nothing cached, and leaves the step unmatched.

Steps are matched by value, not by their place in the log (with sglang's overlapped scheduling a step's prefill can
be logged after the previous step's finish line, or before). Only batches of one sequence are matched: a step
prefilled together with another request, or cut by chunked prefill, has no batch of its own and stays unmatched,
so use this on servers without chunked prefill and where sessions' steps do not coincide (one session at a time).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from support.serving import engine_prefills

STEP_LINE = re.compile(
    r"realtime step (\S+):(\d+): extended (\d+) rows, .*?; session holds (\d+) encoder \+ (\d+) text rows"
)


@dataclass(frozen=True)
class LoggedStep:
    session: str
    index: int
    rows: int  # new rows the step's plan extended
    encoder_rows: int  # the session's encoder rows after the step
    text_rows: int  # the session's text rows after the step (its generated tokens included)


def logged_steps(log_text: str) -> list[LoggedStep]:
    return [
        LoggedStep(session, int(index), int(rows), int(encoder), int(text))
        for session, index, rows, encoder, text in STEP_LINE.findall(log_text)
    ]


def steps_the_engine_did_not_extend_alone(log_text: str) -> list[LoggedStep]:
    """The steps (after each session's first) with no one-sequence prefill batch of exactly (their rows new, the
    session's rows so far cached) in the engine's log; [] when the engine did only the new work of every step."""
    batches = Counter(
        (batch.new_tokens, batch.cached_tokens) for batch in engine_prefills(log_text) if batch.new_seqs == 1
    )
    previous: dict[str, LoggedStep] = {}
    missing = []
    for step in logged_steps(log_text):
        before = previous.get(step.session)
        previous[step.session] = step
        if before is None:
            continue
        expected = (step.rows, step.encoder_rows + before.text_rows)
        if batches[expected] > 0:
            batches[expected] -= 1
        else:
            missing.append(step)
    return missing
