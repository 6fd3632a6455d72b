"""Did the engine compute only each realtime step's new rows? Read from stock sglang's own prefill log lines.

The plugin logs each finished step (``realtime step <rid>: extended R rows, ... session holds E encoder + T text
rows``) from its step plan; a check on those counts alone cannot see a step that silently re-prefilled the whole
session. Stock's ``Prefill batch`` line (``support.serving.engine_prefills``: ``#new-token`` what the engine
extended, ``#cached-token`` the prefix it reused) can: a step after a session's first must appear there as a batch
that extended exactly its R new rows on a cached prefix of exactly the session's rows so far (its encoder rows at
this step, grown for new frames before the prefill, plus its text rows when the step before it finished). A full
re-prefill shows as a batch of the whole row with nothing cached, and leaves the step unmatched.

Steps are matched by value, not by their place in the log (with sglang's overlapped scheduling a step's prefill can
be logged after the previous step's finish line, or before): first to batches of one sequence, then steps prefilled
together to a batch of several whose totals they make up (exactly, or beside requests that are not steps and took
nothing from the cache). Every TP rank logs each step; each is counted once. A step cut by chunked prefill has no
such batch and stays unmatched: use this on servers without chunked prefill.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from itertools import combinations

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
    """Each step once, in log order (every TP rank logs it)."""
    steps = {}
    for session, index, rows, encoder, text in STEP_LINE.findall(log_text):
        steps.setdefault((session, int(index)), LoggedStep(session, int(index), int(rows), int(encoder), int(text)))
    return list(steps.values())


def expected_engine_counts(log_text: str) -> list[tuple[LoggedStep, tuple[int, int]]]:
    """(step, (its new rows, the session's rows so far)) for every step after each session's first."""
    previous: dict[str, LoggedStep] = {}
    expected = []
    for step in logged_steps(log_text):
        before = previous.get(step.session)
        previous[step.session] = step
        if before is not None:
            expected.append((step, (step.rows, step.encoder_rows + before.text_rows)))
    return expected


def steps_the_engine_did_not_extend_alone(log_text: str) -> list[LoggedStep]:
    """The steps (after each session's first) that no prefill batch of the engine's log accounts for exactly: a batch
    of one sequence with (their rows new, the session's rows so far cached), or a batch of n sequences whose totals
    n such steps make up; [] when the engine did only the new work of every step."""
    batches = engine_prefills(log_text)
    single = Counter((b.new_tokens, b.cached_tokens) for b in batches if b.new_seqs == 1)
    unmatched = []
    for step, counts in expected_engine_counts(log_text):
        if single[counts] > 0:
            single[counts] -= 1
        else:
            unmatched.append((step, counts))
    for batch in (b for b in batches if b.new_seqs > 1):
        group = _steps_making_up(batch, [counts for _, counts in unmatched])
        unmatched = [entry for i, entry in enumerate(unmatched) if i not in group]
    return [step for step, _ in unmatched]


def _steps_making_up(batch, counts: list[tuple[int, int]]) -> tuple[int, ...]:
    """Indexes of the steps prefilled in ``batch`` (several sequences): all its sequences, their totals exactly; or
    fewer, beside requests that are not steps and took nothing from the cache (the steps' cached rows are then the
    batch's, and their new rows fewer than its). () when no group fits."""
    for size in range(batch.new_seqs, 0, -1):
        for group in combinations(range(len(counts)), size):
            rows = sum(counts[i][0] for i in group)
            cached = sum(counts[i][1] for i in group)
            whole = size == batch.new_seqs and rows == batch.new_tokens
            if cached == batch.cached_tokens and (whole or (size < batch.new_seqs and rows < batch.new_tokens)):
                return group
    return ()
