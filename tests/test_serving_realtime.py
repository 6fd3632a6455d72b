"""MOSS-VL-Realtime sessions on the sglang engine (`mossvl_ascend.realtime.engine` over the scheduler hooks of
`mossvl_ascend.patches.realtime_sessions`), against the reference stream (`moss_vl_reference.realtime_moss_vl`).

Oracle: the reference session driven by the same event script (each input pushed while the stream is parked, then
run until it parks again), greedy, fp32; every token the served session chose must equal the reference's. The
engine runs in this process (`sglang.Engine`: tokenizer manager here, scheduler in a child process), so the session
is driven without the WebSocket layer (tested on its own in `test_realtime_protocol.py`).
"""

import asyncio

import pytest
from transformers import AutoProcessor

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from support.realtime import TURN_LIMIT, noise_image, reference_generated
from support.serving import load_reference

WAIT = 120.0
SCRIPT = (("frame", 0.0, 1), ("frame", 1.0, 2), ("prompt", "What moved?"), ("frame", 2.0, 3))


@pytest.fixture(scope="module")
def realtime_checkpoint():
    return build_or_reuse("tiny-realtime")


@pytest.fixture(scope="module")
def reference_tokens(realtime_checkpoint):
    model, processor = load_reference(realtime_checkpoint)
    return reference_generated(model, processor, SCRIPT)


async def served_tokens(engine) -> tuple[list[int], list[str]]:
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import Frame, SessionConfig

    session = await ServedRealtimeEngine(lambda: engine.tokenizer_manager).open(
        SessionConfig(max_new_tokens=TURN_LIMIT)
    )
    kinds = []

    async def settle():
        while True:
            output = await asyncio.wait_for(session.outputs.get(), WAIT)
            kinds.append(output.kind)
            assert output.kind not in ("error", "closed"), output
            if output.kind in ("silence", "turn_done") and not session.pending_inputs:
                return

    await settle()
    for action in SCRIPT:
        if action[0] == "frame":
            session.push_frame(Frame(noise_image(action[2]), action[1]))
        else:
            session.push_prompt(action[1])
        await settle()
    await session.close()
    return list(session.generated), kinds


def test_one_session_equals_the_reference_stream(realtime_checkpoint, reference_tokens):
    import sglang

    engine = sglang.Engine(
        model_path=str(realtime_checkpoint),
        trust_remote_code=True,
        enable_multimodal=True,
        dtype="float32",
        device="cpu",
        max_total_tokens=4096,
        page_size=1,
        disable_overlap_schedule=True,
        sleep_on_idle=True,
    )
    try:
        tokens, kinds = engine.loop.run_until_complete(served_tokens(engine))
    finally:
        engine.shutdown()
    silence = AutoProcessor.from_pretrained(
        realtime_checkpoint, trust_remote_code=True
    ).tokenizer.convert_tokens_to_ids("<|silence|>")
    assert reference_tokens.count(silence) == len(SCRIPT) + 1, "every reference turn ends on <|silence|>"
    assert tokens == reference_tokens
    assert kinds[0] == "ready" and kinds.count("silence") == len(SCRIPT) + 1


class _Manager:
    """A stand-in tokenizer manager with only what the checks at open read (no engine behind it)."""

    def __init__(self, context_len: int, max_running_requests=None):
        from types import SimpleNamespace

        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["MossVLForConditionalGeneration"]))
        self.context_len = context_len
        self.server_args = SimpleNamespace(max_running_requests=max_running_requests)


@pytest.mark.parametrize(
    "pool, context, code",
    [(4096, 8192, "insufficient_kv_capacity"), (None, 8192, "unsupported_model")],
)
def test_open_refuses_what_the_engine_cannot_carry(pool, context, code):
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import RealtimeError, SessionConfig

    manager = _Manager(context)
    if code == "unsupported_model":
        manager.model_config.hf_config.architectures = ["Qwen3ForCausalLM"]
    engine = ServedRealtimeEngine(lambda: manager, lambda: {"max_total_num_tokens": pool})
    with pytest.raises(RealtimeError) as refused:
        asyncio.run(engine.open(SessionConfig()))
    assert refused.value.code == code
    assert not engine.sessions
