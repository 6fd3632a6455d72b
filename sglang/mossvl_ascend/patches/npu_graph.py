"""NPU decode graphs for MOSS-VL: stock's NPU graph runner captures a decode step whose attention is
``attention.decode_graph`` (static inputs filled outside the graph, tables built inside it, KV lengths per recorded
call through ``NPUGraph.update``).

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend import side_channel
from mossvl_ascend.attention.decode_graph import capture_kv_lengths, host_kv_lengths, per_record_update, step_tables
from mossvl_ascend.attention.decode_step import DecodeBuffers, DecodeRows
from mossvl_ascend.attention.kv_layout import addressing_of_pool
from mossvl_ascend.patch_record import NPU, Patch

logger = logging.getLogger(__name__)

ASCEND_BACKEND = "sglang.srt.hardware_backend.npu.attention.ascend_backend.AscendAttnBackend"
ASCEND_BACKEND_MODULE = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
NPU_RUNNER = "sglang.srt.hardware_backend.npu.graph_runner.npu_graph_runner.NPUGraphRunner"
NPU_GRAPH_BACKEND = "sglang.srt.hardware_backend.npu.graph_runner.npu_cudagraph_backend.NPUCudaGraphBackend"
DECODE_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
NO_ROWS = DecodeRows([], [], [], [], [])
# What stock's encoder test sees for a MOSS-VL batch: a host tensor, so the test reads nothing from the device.
_EVERY_ROW_HAS_AN_ENCODER = torch.ones(1, dtype=torch.int64)


def _encoder_decode(forward_batch) -> bool:
    return forward_batch.encoder_lens is not None and forward_batch.forward_mode.is_decode()


def allocate_decode_buffers(original, backend, max_bs: int, max_num_tokens: int, *args, **kwargs):
    """AROUND ``AscendAttnBackend.init_cuda_graph_state``: stock's graph state, and the decode step's static inputs."""
    result = original(backend, max_bs, max_num_tokens, *args, **kwargs)
    side_channel.DECODE_BUFFERS.set(backend, DecodeBuffers(max_bs, backend.device))
    return result


def select_the_step_view(original, backend, forward_batch, in_capture: bool = False, *args, **kwargs):
    """AROUND ``init_forward_metadata_out_graph`` (outside the recording): the view of the bucket's columns; at
    capture the columns are padding rows (the recording reads them as tensors, never these values)."""
    result = original(backend, forward_batch, in_capture, *args, **kwargs)
    buffers = side_channel.DECODE_BUFFERS.get(backend)
    if buffers is not None and _encoder_decode(forward_batch):
        bs = forward_batch.batch_size
        side_channel.DECODE_VIEW.set(backend, buffers.fill(NO_ROWS, bs) if in_capture else buffers.view(bs))
    return result


def build_tables_in_graph(original, backend, forward_batch, *args, **kwargs):
    """AROUND ``init_forward_metadata_in_graph`` (inside the recording): the step's tables, from tensors only."""
    result = original(backend, forward_batch, *args, **kwargs)
    view = side_channel.DECODE_VIEW.get(backend)
    if view is not None and _encoder_decode(forward_batch):
        tables = step_tables(
            view,
            backend.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            backend.page_size,
            addressing_of_pool(backend.token_to_kv_pool),
            capture_kv_lengths(forward_batch.batch_size),
        )
        side_channel.DECODE_TABLES.set(backend, tables)
    return result


def cross_layers_in_order(model_config) -> list[bool]:
    """Whether each decoder layer, in forward order, is a cross-attention layer: the order of the recorded
    fused-attention calls (one per layer)."""
    text = getattr(model_config.hf_config, "text_config", model_config.hf_config)
    cross = set(text.cross_attention_layers)
    return [layer in cross for layer in range(text.num_hidden_layers)]


def fill_the_bucket_stock_chose(original, runner, forward_batch, *args, **kwargs):
    """AROUND ``NPUGraphRunner.load_batch``: once stock has padded the batch into its buffers (which carry no
    request's multimodal inputs) and chosen the bucket (``runner.bs``: under DP attention the largest rank's batch
    decides it), the real rows go into the static inputs with one copy, zeros up to that bucket, and the replay's
    per-record KV lengths, one per row of that bucket, wait on the graph backend for ``replay_with_input_update``."""
    result = original(runner, forward_batch, *args, **kwargs)
    backend = runner.model_runner.attn_backend
    buffers = side_channel.DECODE_BUFFERS.get(backend)
    if buffers is None or not _encoder_decode(forward_batch):
        return result
    addressing = addressing_of_pool(backend.token_to_kv_pool)
    rows = DecodeRows.of_forward_batch(forward_batch, addressing)
    buffers.fill(rows, runner.bs)
    lengths = host_kv_lengths(rows, forward_batch.seq_lens_cpu.tolist(), runner.bs, backend.page_size, addressing)
    update = per_record_update(cross_layers_in_order(runner.model_runner.model_config), lengths)
    side_channel.GRAPH_UPDATE.set(runner.backend, update)
    return result


def update_every_record(original, graph_backend, shape_key, *args, **kwargs):
    """AROUND ``NPUCudaGraphBackend.replay_with_input_update``: a MOSS-VL replay passes one dict per recorded call
    (self- and cross-attention layers see different KV lengths) instead of stock's one dict for all; each update
    serves one replay."""
    update = side_channel.GRAPH_UPDATE.get(graph_backend)
    if update is not None:
        kwargs["cpu_update_input"] = update
        side_channel.GRAPH_UPDATE.set(graph_backend, None)
    return original(graph_backend, shape_key, *args, **kwargs)


class DecodeGraphCaptureFailed(Exception):
    """The NPU decode graph could not be captured; one line says where and how to start without it (not a
    RuntimeError: stock's runner would wrap that in its own multi-line advice)."""


def name_a_failed_capture(original, runner, *args, **kwargs):
    """AROUND ``NPUGraphRunner.capture``: a capture that fails on the card (a kernel or CANN version not foreseen)
    ends start-up with one line naming the bucket, the error and ``--disable-cuda-graph``; the error stays chained."""
    try:
        return original(runner, *args, **kwargs)
    except Exception as error:
        backend = runner.model_runner.attn_backend
        if side_channel.DECODE_BUFFERS.get(backend) is None:
            raise
        view = side_channel.DECODE_VIEW.get(backend)
        where = f"at batch size {view.vision.shape[0]}" if view is not None else "before its first batch size"
        lines = str(error).strip().splitlines()
        raise DecodeGraphCaptureFailed(
            f"MOSS-VL on NPU: capturing the decode graph failed {where} ({type(error).__name__}: "
            f"{lines[0] if lines else ''}); "
            "start the server with --disable-cuda-graph to decode without graphs (slower), and report the error."
        ) from error


def text_rows_in_the_graph(original, runner, forward_batch, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner.can_run_graph``: a MOSS-VL batch with a text-only request still replays (its
    row is gated in the graph), and the check reads no device value."""
    if side_channel.DECODE_BUFFERS.get(runner.model_runner.attn_backend) is None or forward_batch.encoder_lens is None:
        return original(runner, forward_batch, *args, **kwargs)
    encoder_lens = forward_batch.encoder_lens
    forward_batch.encoder_lens = _EVERY_ROW_HAS_AN_ENCODER
    try:
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        forward_batch.encoder_lens = encoder_lens


_WHY = (
    "on Ascend, decode without graphs is host-bound (every layer's kernels launched from Python; graphs halved "
    "Qwen3-VL's TPOT on 910B-class machines), and stock's Ascend graph decode ignores the encoder prefix and the "
    "cross-attention layers, so MOSS-VL ran with decode graphs forced off."
)
_UPSTREAM = "not upstream in 0.5.23 (stock's Ascend graph decode is text-only; no engine graphs cross-attention decode)"
_REMOVE_WHEN = "stock's NPU graph runner captures encoder-decoder decode with per-layer KV lengths"


def _graph_patch(title: str, target: str, hook, how: str, why: str = _WHY) -> Patch:
    return Patch(
        title=f"NPU decode graphs: {title}",
        target=target,
        kind=HookType.AROUND,
        hook=hook,
        platforms=frozenset({NPU}),
        requires_module=ASCEND_BACKEND_MODULE,
        why=why,
        how=how,
        upstream=_UPSTREAM,
        remove_when=_REMOVE_WHEN,
    )


PATCHES = (
    _graph_patch(
        "the decode step's static inputs in the graph state",
        f"{ASCEND_BACKEND}.init_cuda_graph_state",
        allocate_decode_buffers,
        "after stock's graph state, `attention.decode_step.DecodeBuffers` for the largest bucket: per row vision "
        "tokens, encoder slots, frame-window start, slot-major flag and row gate, int32, allocated once.",
    ),
    _graph_patch(
        "the bucket's view of the static inputs, outside the recording",
        f"{ASCEND_BACKEND}.init_forward_metadata_out_graph",
        select_the_step_view,
        "for an encoder-decoder decode batch, the view of the bucket's columns becomes the step's "
        "(`side_channel.DECODE_VIEW`); at capture they are written as padding rows first.",
    ),
    _graph_patch(
        "the step's block tables and masks, inside the recording",
        f"{ASCEND_BACKEND}.init_forward_metadata_in_graph",
        build_tables_in_graph,
        "`attention.decode_graph.step_tables` derives both kinds' tables on the device from the view, "
        "`req_pool_indices` and `req_to_token` (static widths, no host read); every layer of the step reads "
        "them (`patches.ascend_backend` routes a captured decode to `attention.decode_graph`).",
    ),
    _graph_patch(
        "each replay's rows from the real batch, in the bucket stock chose",
        f"{NPU_RUNNER}.load_batch",
        fill_the_bucket_stock_chose,
        "after stock's `load_batch` (which picks the bucket, `runner.bs`: under DP attention or MLP sync the largest "
        "rank's batch decides it), the real batch's rows (`DecodeRows.of_forward_batch`) go into the static inputs "
        "with one host-to-device copy, zeros for the bucket's padding rows; the replay's KV lengths per recorded "
        "call, one per row of that bucket (`decode_graph.host_kv_lengths`, `per_record_update` in layer order), "
        "wait on the graph backend.",
        why=_WHY + " The padded replay batch stock builds carries no request's multimodal inputs.",
    ),
    _graph_patch(
        "one update dict per recorded attention call",
        f"{NPU_GRAPH_BACKEND}.replay_with_input_update",
        update_every_record,
        "a MOSS-VL replay's `cpu_update_input` is the list of one dict per recorded call, in capture order (used "
        "once: the next replay brings its own).",
        why=(
            "stock passes one dict, which torch_npu's `NPUGraph.update` applies to every recorded fused-attention "
            "call; MOSS-VL's self- and cross-attention layers read different KV lengths."
        ),
    ),
    _graph_patch(
        "a failed capture ends start-up with one line",
        f"{NPU_RUNNER}.capture",
        name_a_failed_capture,
        "an error in the capture of a backend with MOSS-VL decode buffers becomes `DecodeGraphCaptureFailed`: one "
        "line naming the bucket being captured, the error's type and first line, and `--disable-cuda-graph`, the "
        "error chained. Chosen over a fallback to eager decode: a fallback would serve at eager speed (on Ascend, "
        "host-bound: about half the decode rate) behind one warning, and its cost cannot be measured without a card.",
        why=(
            "nothing of the captured path has run on an Ascend card; a kernel or CANN version we did not foresee "
            "fails inside stock's capture loop, which shows a traceback (a RuntimeError also gets stock's generic "
            "advice, which names neither MOSS-VL nor `--disable-cuda-graph`)."
        ),
    ),
    _graph_patch(
        "text-only rows replay in the graph",
        f"{DECODE_RUNNER}.can_run_graph",
        text_rows_in_the_graph,
        "for a batch of a backend with MOSS-VL decode buffers, stock's check sees a host tensor of ones; such a "
        "row is gated off in the graph (`decode_graph.zero_rows_without_keys`, the row gate from the buffers).",
        why=(
            "stock sends an encoder-decoder batch to eager decode when any request has no encoder "
            "(`torch.all(encoder_lens > 0)`, a device read every step): one text-only request makes the batch eager."
        ),
    ),
)
