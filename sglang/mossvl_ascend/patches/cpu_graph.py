"""CPU decode graphs (``--enable-torch-compile``) for MOSS-VL: the CPU attention backend's graph state, and each
replayed step's static decode inputs filled from the real batch.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.layer_boundary.exit import ExitDecision
from sglang.srt.layers.layer_boundary.residual.stream import Contribution
from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend import side_channel
from mossvl_ascend.attention.decode_step import DecodeBuffers, DecodeRows
from mossvl_ascend.attention.kv_layout import addressing_of_pool
from mossvl_ascend.patch_record import CPU, Patch

logger = logging.getLogger(__name__)

TORCH_NATIVE_CLASS = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
CPU_GRAPH_RUNNER = "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner"
NO_ROWS = DecodeRows([], [], [], [], [])


class GraphReadyTorchNativeBackend(TorchNativeAttnBackend):
    """Stock ``torch_native`` plus the three methods stock's ``CPUGraphRunner`` calls on its attention backend.

    The graph state is the MOSS-VL decode step's static inputs (:class:`DecodeBuffers`); a captured step reads
    them through the view set here at capture and by :func:`fill_decode_inputs` at every replay.
    """

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        # A padding row decodes one text token of pool row 0 (stock keeps that row's slots at 0).
        return 1

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        side_channel.DECODE_BUFFERS.set(self, DecodeBuffers(max_bs, self.device))

    def init_forward_metadata_capture_cpu_graph(self, bs: int, num_tokens: int, *args, **kwargs) -> None:
        # The captured batch is all padding: compiled code reads the buffers as tensors, never these values.
        self.swa_out_cache_loc = None
        side_channel.DECODE_VIEW.set(self, side_channel.DECODE_BUFFERS.get(self).fill(NO_ROWS, bs))


def fill_decode_inputs(original, runner, forward_batch, skip: bool = False):
    """AROUND hook on ``CPUGraphRunner.prepare_replay``: every replay calls the compiled step with the ForwardBatch it
    was captured with, its static tensors refilled in place, and the real batch's decode rows (read on the host first:
    a padded bucket's batch no longer carries its requests) go into the static decode buffers."""
    backend = runner.model_runner.attn_backend
    buffers = side_channel.DECODE_BUFFERS.get(backend)
    if buffers is None or forward_batch.encoder_lens is None:
        return original(runner, forward_batch, skip=skip)
    rows = DecodeRows.of_forward_batch(forward_batch, addressing_of_pool(runner.model_runner.token_to_kv_pool))
    if forward_batch.batch_size in runner.graphs:
        prepared = refill_the_captured_batch(runner, forward_batch, skip)
    else:
        prepared = original(runner, forward_batch, skip=skip)
    side_channel.DECODE_VIEW.set(backend, buffers.fill(rows, prepared.batch_size))
    return prepared


def refill_the_captured_batch(runner, forward_batch, skip: bool):
    """A batch of a captured size copied into the ForwardBatch captured at that size, as stock does for a padded
    batch (with no padding rows to reset). Stock replays such a batch with the serving ForwardBatch itself, which the
    capture's guards reject (its ``mrope_positions`` is contiguous, the captured one a slice of a wider buffer; a
    logprob request's ``top_logprobs_nums`` is a list, the captured one None): dynamo compiled the step again at the
    first batch of each size and each logprob variant. Decode logprobs come from the returned logits, outside the
    compiled step (``Sampler``), so the captured batch's "no logprobs" is not a loss."""
    captured = (runner.captured_forward_batches if skip else runner.captured_forward_batches_cross)[
        forward_batch.batch_size
    ]
    for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions", "encoder_lens"):
        getattr(captured, name).copy_(getattr(forward_batch, name))
    if forward_batch.mrope_positions is not None:
        captured.mrope_positions.copy_(forward_batch.mrope_positions)
    if enable_num_token_non_padded():
        captured.num_token_non_padded.copy_(forward_batch.global_num_token_non_padded)
    captured.encoder_out_cache_loc = None
    runner.model_runner.attn_backend.init_forward_metadata(captured)
    return captured


def traceable_twin(struct: type) -> type:
    """A plain Python class with ``struct``'s fields (same order, same defaults) and its methods.

    Dynamo cannot construct or mutate a ``msgspec.Struct`` (``object.__new__`` of a C-defined type), so each
    layer's residual bookkeeping broke the compiled decode step into per-layer pieces with Python in between; the
    twin traces. Frozen-ness is not enforced (stock never assigns to the frozen ones after construction)."""
    fields = struct.__struct_fields__
    defaults = dict(zip(fields[len(fields) - len(struct.__struct_defaults__) :], struct.__struct_defaults__))

    def __init__(self, *args, **kwargs):
        given = dict(zip(fields, args), **kwargs)
        for name in fields:
            setattr(self, name, given[name] if name in given else defaults[name])

    methods = {name: value for name, value in vars(struct).items() if callable(value) and not name.startswith("__")}
    body = {"__slots__": fields, "__init__": __init__, "__doc__": struct.__doc__, "__module__": __name__, **methods}
    return type(struct.__name__, (), body)


def compile_without_freezing(result, *args, **kwargs):
    """AFTER hook on ``cpu_graph_runner.set_torch_compile_config``: inductor's freezing off again (stock turns it
    on), so the MOSS-VL decode step compiles as one graph; see the catalog entry."""
    import torch._inductor.config

    torch._inductor.config.freezing = False
    logger.info("MOSS-VL CPU decode graphs: inductor freezing off (its passes fail on the MOSS-VL step)")


def fake_only_what_exists(original, op_name: str):
    """AROUND hook on ``cpu_graph_runner.register_cpu_compile_fake``: a kernel the installed ``sgl_kernel`` does not
    define needs no compile-time fake (nothing can call it), so it gets none instead of failing the start-up."""
    if hasattr(torch.ops.sgl_kernel, op_name):
        return original(op_name)
    logger.debug("sgl_kernel::%s is not defined here: no torch.compile fake registered", op_name)
    return lambda fake: fake


TWIN_WHY = (
    "dynamo cannot construct or assign to a `msgspec.Struct`, so under `--enable-torch-compile` every layer's "
    "residual-stream bookkeeping was a graph break (TORCH_LOGS=graph_breaks: `object.__new__({name}) is not safe`) and "
    "the text model's forward fell back to eager: the compiled decode step was slower than eager."
)
TWIN_HOW = (
    "the struct is replaced by its traceable twin (`traceable_twin`): a plain Python class with the same fields, "
    "defaults and methods, which dynamo traces into the step's one graph."
)


def _twin_patch(struct: type, target: str) -> Patch:
    return Patch(
        title=f"CPU decode graphs: the layer boundary's {struct.__name__} as a plain class dynamo traces",
        target=target,
        kind=HookType.REPLACE,
        hook=traceable_twin(struct),
        platforms=frozenset({CPU}),
        why=TWIN_WHY.format(name=struct.__name__),
        how=TWIN_HOW,
        upstream="not upstream in 0.5.23",
        remove_when="dynamo traces msgspec structs, or stock's layer boundary stops using them on the decode path",
    )


PATCHES = (
    _twin_patch(Contribution, "sglang.srt.layers.layer_boundary.residual.stream.Contribution"),
    _twin_patch(ExitDecision, "sglang.srt.layers.layer_boundary.exit.ExitDecision"),
    Patch(
        title="CPU decode graphs: torch_native gets the CPU graph runner's methods",
        target=TORCH_NATIVE_CLASS,
        kind=HookType.REPLACE,
        hook=GraphReadyTorchNativeBackend,
        platforms=frozenset({CPU}),
        why=(
            "`--enable-torch-compile` on `--device cpu` runs stock's `CPUGraphRunner`, which calls "
            "`init_cpu_graph_state`, `get_cpu_graph_seq_len_fill_value` and `init_forward_metadata_capture_cpu_graph` "
            "on the attention backend; only `intel_amx` has them, so MOSS-VL (served on `torch_native`) failed at "
            "start-up with an AttributeError traceback."
        ),
        how=(
            "the class is replaced by a subclass with the three methods: the graph state is the MOSS-VL decode "
            "step's static inputs (`attention.decode_step.DecodeBuffers`: per row vision tokens, encoder slots, "
            "frame-window start, slot-major flag, row gate), a padding row decodes one token of pool row 0; a "
            "captured decode step's attention is the `mossvl::decode_attention` op over those buffers and the "
            "text-row gate reads them (`patches.text_row_gate`). Everything else is stock's class."
        ),
        upstream="not upstream in 0.5.23 (stock's CPU graphs serve encoder-decoder models on intel_amx only)",
        remove_when="stock's torch_native backend implements the CPU graph runner's interface",
    ),
    Patch(
        title="CPU decode graphs: every replay calls the captured step, its static inputs filled from the real batch",
        target=f"{CPU_GRAPH_RUNNER}.prepare_replay",
        kind=HookType.AROUND,
        hook=fill_decode_inputs,
        platforms=frozenset({CPU}),
        why=(
            "a compiled decode step must not read per-request Python values (each would be frozen into the graph "
            "or force a recompile), and when stock pads a batch to a captured size it replays the capture-time "
            "ForwardBatch, which carries no request's multimodal inputs (encoder rows, frame windows, visible-frame "
            "counts). A batch of exactly a captured size stock replays with the serving ForwardBatch instead, which "
            "fails the capture's guards (`mrope_positions` contiguous where the captured one is a slice of a wider "
            "buffer; `top_logprobs_nums` a list on a logprob request): dynamo compiled the step again at the first "
            "batch of each size and of each logprob variant (TORCH_LOGS=recompiles; tiny checkpoint, buckets "
            "{1, 4, 8}, a loaded 2-core machine: the first batch of 4 took 104.8 s, the next 0.24 s)."
        ),
        how=(
            "before stock prepares the replay, the real batch's decode rows are read on the host "
            "(`DecodeRows.of_forward_batch`) and written, with zeros for the bucket's padding rows, into the static "
            "buffers by one host-to-device copy; the view of the bucket's columns is what the compiled step reads. A "
            "batch of a captured size is copied into that size's captured ForwardBatch (`refill_the_captured_batch`, "
            "stock's padded-replay copy without padding), so every replay calls the step with the object and tensor "
            "views it was captured with; decode logprobs come from the returned logits outside the step (`Sampler`)."
        ),
        upstream="not upstream in 0.5.23",
        remove_when="stock's CPU graph runner carries encoder-decoder metadata for non-AMX backends",
    ),
    Patch(
        title="CPU decode graphs: inductor without freezing",
        target="sglang.srt.model_executor.cpu_graph_runner.set_torch_compile_config",
        kind=HookType.AFTER,
        hook=compile_without_freezing,
        platforms=frozenset({CPU}),
        why=(
            "stock compiles CPU graphs with `torch._inductor.config.freezing = True`; on the whole MOSS-VL decode step "
            "a freezing pass fails (`Attempting to broadcast a dimension of length 32`: an RMSNorm weight of "
            "head_dim against the hidden rows), dynamo gives up on the forward (`WON'T CONVERT`) and compiles its "
            "sub-frames one by one: the tiny checkpoint's graph TPOT at batch 4 was 80-98 ms against 12 ms "
            "without freezing."
        ),
        how=(
            "after stock's configuration, freezing is set back to False (weights stay graph inputs instead of "
            "constants; nothing else of stock's settings changes). One log line says so."
        ),
        upstream="not upstream in 0.5.23",
        remove_when="inductor's freezing passes compile the MOSS-VL decode step",
    ),
    Patch(
        title="CPU decode graphs: compile-time fakes only for the sgl_kernel ops that exist",
        target="sglang.srt.model_executor.cpu_graph_runner.register_cpu_compile_fake",
        kind=HookType.AROUND,
        hook=fake_only_what_exists,
        platforms=frozenset({CPU}),
        why=(
            "stock's CPU graph runner registers a `torch.compile` fake for about forty `sgl_kernel` CPU ops at "
            "start-up; without a CPU sgl-kernel build (PyPI has none; this project's CPU runs use the import-only "
            "stand-in in `cpu_shim/`) the first registration raises `operator sgl_kernel::shm_allreduce does not "
            "exist` and the server dies."
        ),
        how=(
            "an op that `torch.ops.sgl_kernel` does not define gets no fake (a no-op decorator; the MOSS-VL path on "
            "`torch_native` calls none of them); an op that exists gets stock's registration unchanged."
        ),
        upstream="not upstream in 0.5.23",
        remove_when="stock registers the fakes only for the ops its sgl_kernel build defines",
    ),
)
