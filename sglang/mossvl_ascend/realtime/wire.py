"""The contract between the HTTP process (:mod:`.engine`) and the scheduler (:mod:`.sessions`) for realtime steps:
how a step's rid is spelled, the abort messages both sides recognise, the sampling and info keys a step carries.
No torch, no sglang: both processes import it.

A session is driven as a chain of ordinary requests, one per **step** (rid ``mossvl-realtime:<session>:<n>``);
``mossvl-realtime:<session>:close`` frees the session's KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

RID_PREFIX = "mossvl-realtime:"
# The abort message that asks a running step to end at its next token, keeping its KV (barge-in).
INTERRUPT_MESSAGE = "mossvl-realtime-interrupt"
CLOSE_STEP = "close"
# A session's first step (the engine numbers them from 0): it creates the session in the scheduler.
FIRST_STEP = "0"
# In a windowed step's sampling ``custom_params``: per new frame, the first frame still in the window after it.
WINDOW_STARTS_PARAM = "mossvl_window_first_frames"
# The abort message of a step its session's context cannot hold (the session is full; the client's error code
# `context_exhausted`, the real server's).
CONTEXT_EXHAUSTED = "realtime context exhausted"
# An interrupt may offer the step the rows of prompts that arrived while it ran (:class:`PromptOffer`): the
# interrupt's message is then the marker, this separator, and the offer as JSON.
OFFER_SEPARATOR = " offer "
# A step's ``customized_info`` key (reaches the HTTP side in its first output's ``meta_info``): the session's context
# account when the step starts (:func:`usage_after`).
USAGE_INFO_KEY = "mossvl_realtime_context"
# In that account: how many rows of an interrupt's prompt offer the step took (0: none; its prompts stay pending).
OFFER_TAKEN_KEY = "offered_rows_taken"


@dataclass(frozen=True)
class PromptOffer:
    """Prompts for a step that has not started its extend: their rows (each prompt's splice, then the
    ``<|silence|>`` opener) go right after the step's first row, the token generated last, as if they had been
    drained with the step's own inputs (prompts before frames, the reference's order), and the step then runs as
    the turn they open, with ``max_new_tokens``. A step already under way is interrupted instead."""

    rows: list[int]
    max_new_tokens: int


def interrupt_message(offer: Optional[PromptOffer] = None) -> str:
    if offer is None:
        return INTERRUPT_MESSAGE
    fields = {"rows": offer.rows, "max_new_tokens": offer.max_new_tokens}
    return INTERRUPT_MESSAGE + OFFER_SEPARATOR + json.dumps(fields)


def parse_interrupt(message) -> tuple[bool, Optional[PromptOffer]]:
    """(is it an interrupt, the prompt offer it carries if any) of an abort message."""
    if not isinstance(message, str) or not message.startswith(INTERRUPT_MESSAGE):
        return False, None
    rest = message[len(INTERRUPT_MESSAGE) :]
    if not rest:
        return True, None
    if not rest.startswith(OFFER_SEPARATOR):
        return False, None
    fields = json.loads(rest[len(OFFER_SEPARATOR) :])
    return True, PromptOffer([int(row) for row in fields["rows"]], int(fields["max_new_tokens"]))


def whole_pages(tokens: int, page_size: int) -> int:
    """``tokens`` rounded up to whole pages."""
    return -(-tokens // page_size) * page_size


def usage_after(account: dict, generated: int) -> dict:
    """``session.usage`` once a step generated ``generated`` tokens, from the account at its start: ``decoder_tokens``
    (text positions, the token sampled last included), ``encoder_tokens`` (every vision token appended, windowed-out
    ones included), ``encoder_kv_tokens`` (those still held), ``token_space_used`` (what counts against the context
    here: encoder rows, whole pages, plus text positions), ``context_limit``, ``context_remaining``; and ``kv_tokens``:
    the KV slots the session holds (whole pages), what ``/v1/loads`` counts for it."""
    decoder = account["text_rows"] + generated
    used = account["encoder_rows"] + decoder
    return {
        "decoder_tokens": decoder,
        "encoder_tokens": account["encoder_tokens"],
        "encoder_kv_tokens": account["encoder_kv_tokens"],
        "token_space_used": used,
        "context_limit": account["context_limit"],
        "context_remaining": max(0, account["context_limit"] - used),
        "kv_tokens": whole_pages(used - 1, account["page_size"]),
    }


def step_rid(session_id: str, step: int | str) -> str:
    return f"{RID_PREFIX}{session_id}:{step}"


def names_a_step(rid) -> bool:
    """A request id (one, or a batch's list) that claims the realtime steps' prefix."""
    rids = rid if isinstance(rid, list) else [rid]
    return any(isinstance(one, str) and one.startswith(RID_PREFIX) for one in rids)


def parse_step_rid(rid) -> tuple[str, str] | None:
    """(session id, step) of a realtime step's rid, else None."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    session_id, _, step = rid[len(RID_PREFIX) :].rpartition(":")
    return (session_id, step) if session_id else None
