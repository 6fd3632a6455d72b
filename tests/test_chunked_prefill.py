"""Chunked prefill never cuts inside a request's encoder span: the real ``PrefillAdder`` under every budget.

Real sglang objects: ``PrefillAdder`` (the scheduler's admission logic), ``Req`` with ``MultimodalInputs``
(``num_image_tokens`` = encoder tokens at the start of the prompt, as MOSS-VL sets it), a real token allocator
(page size 1, and the paged allocator at the NPU page size 128) and a disabled ``RadixCache`` for the budget
bookkeeping; the scheduler's runtime configuration is published from a real ``prepare_server_args``. Both stock
admission paths are covered: ``_select_prefill_admission`` and, for ``ignore_eos`` requests without a prefix cache
(the NPU default), ``add_one_req_ignore_eos``.

The oracle is the invariant ``ScheduleBatch.prepare_encoder_info_extend`` relies on, written out
independently: an admitted first chunk ends after the encoder plus at least one text row, on a page boundary or
at the prompt's end; a budget below that makes a request that shares the batch wait and admits a lone request
with exactly the smallest such chunk. A control runs the unhooked stock selection on the same input to show the
cut it would make lies inside the encoder.
"""

import inspect
import json
from array import array

import pytest
import torch

from mossvl_ascend.patches import chunked_prefill
from support.hooks import patches_applied

ENCODER_LEN = 20
PROMPT_LEN = 50
PAGED_ENCODER_LEN = 200
PAGED_PROMPT_LEN = 300


@pytest.fixture(scope="module", autouse=True)
def plugin_hook_applied():
    with patches_applied(*chunked_prefill.PATCHES):
        yield


@pytest.fixture(scope="module", autouse=True)
def scheduler_context(tmp_path_factory):
    """Publish a real scheduler runtime configuration (PrefillAdder reads it)."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import prepare_server_args

    model_dir = tmp_path_factory.mktemp("model")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512,
    }  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    args = prepare_server_args(["--model-path", str(model_dir), "--device", "cpu"])
    with use_context(create_context(args, role="scheduler")):
        yield


def make_req(rid, prompt_len, encoder_len, ignore_eos=False):
    from sglang.srt.managers.schedule_batch import MultimodalInputs, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    token_ids = array("q", [7] * encoder_len + list(range(prompt_len - encoder_len)))
    req = Req(rid, "", token_ids, SamplingParams(max_new_tokens=4, ignore_eos=ignore_eos))
    if encoder_len:
        req.multimodal_inputs = MultimodalInputs(mm_items=[], num_image_tokens=encoder_len)
    return req


def make_adder(page_size, budget):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if page_size == 1:
        allocator = TokenToKVPoolAllocator(8192, torch.float32, "cpu", None, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(8192, page_size, torch.float32, "cpu", None, False)
    cache = RadixCache.create_simulated(disable=True, mock_allocator=allocator, page_size=page_size)
    return PrefillAdder(page_size, cache, allocator, ScheduleBatch(reqs=[]), 0.5, 8192, budget), cache


def admit(adder, cache, req):
    req.init_next_round_input(cache)
    result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    admitted = req in adder.can_run_list
    return result, admitted, req.extend_end


def smallest_first_chunk(encoder_len, page_size, prompt_len):
    """The encoder plus one text row, rounded up to a page, capped at the prompt (the oracle's own arithmetic)."""
    end = encoder_len + 1
    while end % page_size:
        end += 1
    return min(end, prompt_len)


@pytest.mark.parametrize(
    "page_size,encoder_len,prompt_len", [(1, ENCODER_LEN, PROMPT_LEN), (128, PAGED_ENCODER_LEN, PAGED_PROMPT_LEN)]
)
def test_lone_request_first_chunk_holds_the_encoder_and_a_text_row_for_every_budget(page_size, encoder_len, prompt_len):
    smallest = smallest_first_chunk(encoder_len, page_size, prompt_len)
    for budget in range(1, encoder_len + 3):
        adder, cache = make_adder(page_size, budget)
        req = make_req(f"r{budget}", prompt_len, encoder_len)
        _, admitted, end = admit(adder, cache, req)
        stock_cut = budget // page_size * page_size
        if stock_cut == 0:
            # Below one page stock admits no chunk at all (no cut, so nothing to split).
            assert not admitted, budget
            continue
        assert admitted, budget
        assert end > encoder_len, (budget, end)
        assert end % page_size == 0 or end == prompt_len, (budget, end)
        assert end == max(stock_cut, smallest), (budget, end)
        assert adder.new_chunked_req is req  # the prompt continues in later chunks


def test_budget_too_small_for_the_encoder_waits_when_the_batch_already_has_a_request():
    from sglang.srt.managers.schedule_policy import AddReqResult

    text_len = 10
    for budget in range(text_len + 1, text_len + ENCODER_LEN + 3):
        adder, cache = make_adder(1, budget)
        admit(adder, cache, make_req(f"text{budget}", text_len, 0))
        req = make_req(f"vision{budget}", PROMPT_LEN, ENCODER_LEN)
        result, admitted, end = admit(adder, cache, req)
        left = budget - text_len
        if left <= ENCODER_LEN:
            assert (result, admitted) == (AddReqResult.OTHER, False), budget
        else:
            assert admitted and end == left > ENCODER_LEN, (budget, end)


@pytest.mark.parametrize(
    "page_size,encoder_len,prompt_len", [(1, ENCODER_LEN, PROMPT_LEN), (128, PAGED_ENCODER_LEN, PAGED_PROMPT_LEN)]
)
def test_ignore_eos_path_first_chunk_holds_the_encoder_and_a_text_row_for_every_budget(
    page_size, encoder_len, prompt_len
):
    # Without a prefix cache, stock admits ignore_eos requests through its own path: it cuts at the budget itself.
    smallest = smallest_first_chunk(encoder_len, page_size, prompt_len)
    for budget in range(1, encoder_len + 3):
        adder, cache = make_adder(page_size, budget)
        req = make_req(f"r{budget}", prompt_len, encoder_len, ignore_eos=True)
        _, admitted, end = admit(adder, cache, req)
        assert admitted, budget
        assert end == (budget if budget > encoder_len else smallest), (budget, end)
        assert adder.new_chunked_req is req
        # The budget is charged what was admitted (page-rounded), so nothing else fits in this batch.
        assert adder.rem_chunk_tokens == budget - -(-end // page_size) * page_size, budget


def test_ignore_eos_path_budget_too_small_for_the_encoder_waits_when_the_batch_already_has_a_request():
    from sglang.srt.managers.schedule_policy import AddReqResult

    text_len = 10
    for budget in range(text_len + 1, text_len + ENCODER_LEN + 3):
        adder, cache = make_adder(1, budget)
        admit(adder, cache, make_req(f"text{budget}", text_len, 0, ignore_eos=True))
        req = make_req(f"vision{budget}", PROMPT_LEN, ENCODER_LEN, ignore_eos=True)
        result, admitted, end = admit(adder, cache, req)
        left = budget - text_len
        if left <= ENCODER_LEN:
            assert (result, admitted) == (AddReqResult.OTHER, False), budget
        else:
            assert admitted and end == left > ENCODER_LEN, (budget, end)


def test_later_chunks_start_after_the_encoder_and_cut_anywhere():
    adder, cache = make_adder(1, 3)
    req = make_req("r", PROMPT_LEN, ENCODER_LEN)
    admit(adder, cache, req)
    ends = [req.extend_end]
    while ends[-1] < PROMPT_LEN:
        req.prefix_len = ends[-1]  # the chunk ran: its tokens are the cached prefix of the next one
        adder, _ = make_adder(1, 3)
        adder.add_chunked_req(req)
        ends.append(req.extend_end)
    assert ends[0] == ENCODER_LEN + 1
    assert all(b - a == min(3, PROMPT_LEN - a) for a, b in zip(ends, ends[1:]))


@pytest.mark.parametrize(
    "stock_method,ignore_eos", [("_select_prefill_admission", False), ("add_one_req_ignore_eos", True)]
)
def test_stock_selection_cuts_inside_the_encoder(monkeypatch, stock_method, ignore_eos):
    from sglang.srt.managers.schedule_policy import PrefillAdder

    monkeypatch.setattr(PrefillAdder, stock_method, inspect.unwrap(getattr(PrefillAdder, stock_method)))
    adder, cache = make_adder(1, 10)
    _, admitted, end = admit(adder, cache, make_req("control", PROMPT_LEN, ENCODER_LEN, ignore_eos=ignore_eos))
    assert admitted and 0 < end < ENCODER_LEN


def test_smallest_first_chunk_arithmetic():
    assert chunked_prefill.first_chunk_end(20, 1, 50) == smallest_first_chunk(20, 1, 50) == 21
    assert chunked_prefill.first_chunk_end(200, 128, 300) == smallest_first_chunk(200, 128, 300) == 256
    assert chunked_prefill.first_chunk_end(200, 128, 230) == 230
