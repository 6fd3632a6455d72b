"""MOSS-VL served with several ranks on CPU: tensor parallel (TP=2) and data parallel (DP=2), fp32.

Each configuration is stock ``python -m sglang.launch_server`` + the plugin for the whole module (module-scoped,
parametrized fixture: one configuration alive at a time), started through ``serving.launch`` exactly as
``make serve ARGS="--tp-size 2"`` starts it, with the core split per rank it chooses. Every answer is compared token
for token with the reference transformers model (fp32, greedy), computed before any server starts.

- ``tp2_two_nodes_page128``: the tiny checkpoint (4 query / 2 KV heads) at the NPU's page size, where a request's
  encoder and text share 128-slot pages, over two loopback "nodes" as a two-host deployment starts it
  (``--tp 2 --nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:P``, ``--tp`` being argparse's prefix of
  ``--tp-size``): one TP rank per launch, node 1 running its scheduler and a health-only HTTP server; each node gets
  one core's worth of OpenMP threads (both share this machine, where real nodes would not). Attention heads and KV
  heads split one KV head per rank, the vision tower sharded as sglang shards it, gloo collectives
  (``mossvl_ascend.patches.cpu_parallel``). TP at page 1 (the CPU default) is the same split with one-slot pages:
  ``tp2_mqa`` and ``dp2`` serve page 1, in one launch.
- ``tp2_mqa``: the ``tiny-mqa`` preset (4 query / 1 KV head): fewer KV heads than ranks. sglang's CPU engine pads the
  model to 2 KV / 8 query heads with zero heads (``configs.update_config.adjust_config_with_unaligned_cpu_tp``), so
  each rank holds one real or one padded KV head; the answers must not notice.
- ``dp2``: two replicas, each with its own radix cache and encoder-prefix keys; requests spread over both.

The per-rank plugin line (``mossvl_ascend.patches.rank_report``) proves the hooks ran in every rank's process.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend.patches import cpu_parallel, rank_report
from mossvl_ascend.patches.cpu_parallel import without_pynccl
from serving.launch import THREADS_BIND_ENV, SglangServer, cpu_threads_bind, free_port, rank_count
from support.serving import (
    CASES,
    FP32_REPORTING_ARGS,
    MAX_TOKENS,
    cached_tokens,
    load_reference,
    reference_ids,
    served_ids,
)

pytestmark = pytest.mark.timeout(1200)

PARITY_ORDER = [
    "image_data_url", "two_images", "three_turns", "video", "text_only", "same_images_shifted", "long_question"
]  # fmt: skip
# name -> (checkpoint preset, sglang arguments, ranks the logs must show as (tp_rank, dp_rank) pairs)
CONFIGURATIONS = {
    "tp2_two_nodes_page128": ("tiny", ["--tp", "2", "--page-size", "128"], {("0/2", "None"), ("1/2", "None")}),
    "tp2_mqa": ("tiny-mqa", ["--tp-size", "2"], {("0/2", "None"), ("1/2", "None")}),
    "dp2": ("tiny", ["--dp-size", "2"], {("0/1", "0"), ("0/1", "1")}),
}
RANK_LINE = re.compile(r"mossvl_ascend active in scheduler pid \d+: tp_rank=(\d+/\d+) dp_rank=(\w+) pp_rank=0")
# sglang prefixes each scheduler's log lines with its ranks, e.g. "[2026-11-30 23:58:51 DP1] Prefill batch, ..."
PREFILL_LINE = re.compile(r"^\[[^\]]*?(?: DP(\d+))?(?: TP\d+)?\] Prefill batch", re.MULTILINE)


@pytest.fixture(scope="module")
def references():
    """Reference (prompt ids, completion ids) per checkpoint preset and case, with no server running."""
    expected = {}
    for preset in sorted({preset for preset, _, _ in CONFIGURATIONS.values()}):
        model, processor = load_reference(build_or_reuse(preset))
        expected[preset] = {name: reference_ids(model, processor, CASES[name]) for name in PARITY_ORDER}
    return expected


def launches(name: str) -> list[SglangServer]:
    """The configuration's launches: one, or one per node (node 0 serves HTTP)."""
    preset, args, _ = CONFIGURATIONS[name]
    checkpoint, args = build_or_reuse(preset), FP32_REPORTING_ARGS + args
    if "two_nodes" not in name:
        return [SglangServer(checkpoint, extra_args=args, name=f"test-multirank-{name}")]
    args = [*args, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port(span=8)}"]
    return [
        SglangServer(checkpoint, extra_args=[*args, "--node-rank", str(rank)], name=f"test-multirank-{name}-node{rank}",
                     env={THREADS_BIND_ENV: str(rank), "OMP_NUM_THREADS": "1"})
        for rank in (0, 1)
    ]  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGURATIONS))
def served(request, references):
    name = request.param
    nodes = launches(name)
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:  # node 0 is healthy only once node 1 joined: start both at once
            list(pool.map(SglangServer.start, nodes))
        server = nodes[0]
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", max_retries=0, timeout=300)
        yield {
            "name": name,
            "server": server,
            "nodes": nodes,
            "client": client,
            "model": client.models.list().data[0].id,
            "expected": references[CONFIGURATIONS[name][0]],
            "ranks": CONFIGURATIONS[name][2],
        }
    finally:
        for node in nodes:  # node 0 first: its shutdown stops node 1's scheduler
            node.stop()


@pytest.mark.parametrize("args,ranks", [
    ([], 1), (["--tp-size", "2"], 2), (["--dp-size=2", "--tp-size", "2"], 4),
    (["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--data-parallel-size", "2"], 8),
])  # fmt: skip
def test_rank_count_reads_every_parallel_flag(args, ranks):
    assert rank_count(["--dtype", "float32", *args]) == ranks


@pytest.mark.parametrize("ranks,cores,expected", [
    (2, [0, 1], "0|1"),  # the 2-core CI machine: one core per TP rank
    (2, [3, 2, 1, 0, 7, 6, 5, 4], "0-3|4-7"),
    (3, [0, 1, 2, 3, 5, 6, 7], "0-2|3,5|6-7"),  # a gap in the affinity mask
    (4, [0, 1], "0|1|0|1"),  # more ranks than cores: shared round-robin
])  # fmt: skip
def test_threads_bind_gives_each_rank_its_own_cores(ranks, cores, expected):
    assert cpu_threads_bind(ranks, cores) == expected


def test_cpu_groups_default_to_no_pynccl_but_keep_an_explicit_choice():
    assert without_pynccl([[0, 1]], 0, "gloo") == (([[0, 1]], 0, "gloo"), {"use_pynccl": False})
    assert without_pynccl([[0, 1]], 0, "gloo", use_pynccl=True)[1] == {"use_pynccl": True}
    assert without_pynccl([[0, 1]], 0, "gloo", True)[1] == {}


def test_multi_rank_patches_apply_on_the_cpu_engine_only_and_the_rank_line_on_npu_too():
    """GPU hosts keep stock collectives and logging; an NPU keeps HCCL but logs its ranks."""
    from mossvl_ascend.registry import CPU, NPU, patches_for

    assert patches_for("gpu", cpu_parallel.PATCHES + rank_report.PATCHES) == []
    assert patches_for(CPU, cpu_parallel.PATCHES + rank_report.PATCHES) == [*cpu_parallel.PATCHES, *rank_report.PATCHES]
    assert patches_for(NPU, cpu_parallel.PATCHES + rank_report.PATCHES) == list(rank_report.PATCHES)


def test_plugin_is_active_in_every_rank(served):
    logs = [node.log_path.read_text(errors="replace") for node in served["nodes"]]
    found = {rank for log in logs for rank in RANK_LINE.findall(log)}
    assert found == served["ranks"], served["server"].log_tail()
    if len(logs) == 2:
        assert RANK_LINE.findall(logs[1]) == [("1/2", "None")], "node 1 runs TP rank 1 with the plugin"


@pytest.mark.parametrize("case", PARITY_ORDER)
def test_greedy_tokens_equal_the_reference_model(served, case):
    answer = served_ids(served["client"], served["model"], CASES[case])
    expected_prompt, expected_completion = served["expected"][case]
    assert answer["prompt_ids"] == expected_prompt
    assert len(answer["completion_ids"]) == MAX_TOKENS
    assert answer["completion_ids"] == expected_completion


def test_repeated_cases_hit_the_radix_cache_with_identical_output(served):
    """Every case again after it was cached: the last pass reads cached prefixes (per DP rank for dp2), which must
    not change any answer. The first passes are sent here, so the test does not depend on which tests ran before it:
    dp2's round robin sends the i-th request to rank i % 2, and with an odd number of cases a case changes rank from
    one pass to the next, so two first passes put every case in both ranks' trees."""
    for _ in range(2 if served["name"] == "dp2" else 1):
        for name in PARITY_ORDER:
            served_ids(served["client"], served["model"], CASES[name])
    answers = {name: served_ids(served["client"], served["model"], CASES[name]) for name in PARITY_ORDER}
    assert sum(cached_tokens(answer["usage"]) for answer in answers.values()) > 0
    for name, answer in answers.items():
        assert answer["completion_ids"] == served["expected"][name][1], name


def test_eight_concurrent_mixed_requests_each_equal_the_reference(served):
    names = (PARITY_ORDER * 2)[:8]
    log_before = len(served["server"].log_path.read_text(errors="replace"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda name: served_ids(served["client"], served["model"], CASES[name]), names))
    for name, answer in zip(names, answers):
        assert answer["completion_ids"] == served["expected"][name][1], name
    if served["name"] == "dp2":
        log = served["server"].log_path.read_text(errors="replace")[log_before:]
        assert set(PREFILL_LINE.findall(log)) == {"0", "1"}, "the 8 requests did not reach both DP ranks"
