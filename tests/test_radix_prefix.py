"""A prefix-cache match never ends inside a request's encoder (vision) span.

Real sglang objects: ``RadixCache`` (page size 1 and 128), ``Req`` with ``MultimodalInputs``,
``Req.init_next_round_input`` and the ``match_kv_cache`` copies imported by ``SchedulePolicy``
and the disaggregation decode worker. The oracle is the invariant
``ScheduleBatch.prepare_encoder_info_extend`` asserts: a request's cached prefix is either 0
or at least its encoder length. Control cases run the unhooked stock function
(``inspect.unwrap`` of the hooked function) on the same inputs to show the scenario is real.
"""

import importlib
import inspect
from array import array

import pytest

from mossvl_ascend.patches import radix_prefix
from support.hooks import patches_applied

ENCODER_LEN = 200


@pytest.fixture(scope="module", autouse=True)
def plugin_hook_applied():
    with patches_applied(*radix_prefix.PATCHES):
        yield


def make_req(rid, token_ids, encoder_len):
    from sglang.srt.managers.schedule_batch import MultimodalInputs, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", token_ids), SamplingParams(max_new_tokens=4))
    if encoder_len:
        req.multimodal_inputs = MultimodalInputs(mm_items=[], num_image_tokens=encoder_len)
    return req


def cache_holding(page_size, *prompts):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache.create_simulated(page_size=page_size)
    for prompt in prompts:
        cache.insert(InsertParams(key=RadixKey(array("q", prompt))))
    return cache


def text(start, n):
    return list(range(start, start + n))


# (page size, cached prompt, new prompt): both share vision tokens, and the stock match ends
# inside the 200-token encoder span.
#  - page 1: the second image differs (first 120 vision tokens shared);
#  - page 128: same image, different question; the match is cut to the 128-token page.
PARTIAL_CASES = {
    1: ([7] * 120 + [8] * 80 + text(1000, 50), [7] * 120 + [9] * 80 + text(1000, 50)),
    128: ([7] * 200 + text(1000, 100), [7] * 200 + text(2000, 100)),
}


def stock_match_kv_cache():
    from sglang.srt.mem_cache import common

    return inspect.unwrap(common.match_kv_cache)


@pytest.mark.parametrize("page_size", sorted(PARTIAL_CASES))
def test_stock_match_ends_inside_encoder_span(page_size):
    cached, new = PARTIAL_CASES[page_size]
    req = make_req("control", new, ENCODER_LEN)
    stock_match_kv_cache()(req, cache_holding(page_size, cached))
    assert 0 < req.prefix_len < ENCODER_LEN


@pytest.mark.parametrize("page_size", sorted(PARTIAL_CASES))
def test_partial_encoder_match_is_dropped(page_size):
    cached, new = PARTIAL_CASES[page_size]
    cache = cache_holding(page_size, cached)
    req = make_req("new", new, ENCODER_LEN)
    req.init_next_round_input(cache)
    assert req.prefix_len == 0
    assert req.host_hit_length == 0
    assert req.last_node is cache.root_node
    assert req.kv.cache_protected_len == 0


# Modules that call their own ``from ... import match_kv_cache`` copy: the cache-aware
# scheduling policy and the PD-disaggregation decode worker (``_match_prefix_and_lock``).
IMPORTING_MODULES = ["sglang.srt.managers.schedule_policy", "sglang.srt.disaggregation.decode"]


@pytest.mark.parametrize("module_name", IMPORTING_MODULES)
@pytest.mark.parametrize("page_size", sorted(PARTIAL_CASES))
def test_imported_bindings_drop_partial_encoder_match(module_name, page_size):
    module = importlib.import_module(module_name)
    cached, new = PARTIAL_CASES[page_size]
    req = make_req("binding", new, ENCODER_LEN)
    module.match_kv_cache(req, cache_holding(page_size, cached))
    assert req.prefix_len == 0


@pytest.mark.parametrize("page_size", [1, 128])
def test_match_covering_whole_encoder_is_kept(page_size):
    shared = [7] * ENCODER_LEN + text(1000, 100)
    cache = cache_holding(page_size, shared + text(5000, 20))
    req = make_req("follow-up", shared + text(6000, 20), ENCODER_LEN)
    req.init_next_round_input(cache)
    expected = len(shared) // page_size * page_size  # 300 with page 1, 256 with page 128
    assert req.prefix_len == expected
    assert req.prefix_len >= ENCODER_LEN


def test_text_only_request_keeps_short_match():
    cache = cache_holding(1, [7] * 120 + text(1000, 50))
    req = make_req("text", [7] * 120 + text(3000, 50), encoder_len=0)
    req.init_next_round_input(cache)
    assert req.prefix_len == 120
