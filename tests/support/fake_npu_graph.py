"""STAND-IN for ``torch.npu.NPUGraph`` / ``torch.npu.graph(..., auto_dispatch_capture=True)`` in CPU tests: capture
records a step once, replay runs the recording, so every Python value the step read while it was captured stays
frozen, as on an Ascend device.

It follows torch_npu's own source, ``torch_npu/npu/graphs.py`` (Ascend/pytorch; read at the release tags named in
:data:`RELEASES`), as stock sglang's ``NPUCudaGraphBackend.capture_one`` drives it (``auto_dispatch_capture=True``,
which ``NPUGraph.update`` requires):

- **capture** (``_GraphDispatchMode.__torch_dispatch__``): a call of ``npu_fused_infer_attention_score`` is not run as
  called. torch_npu allocates the op's outputs itself and records the op's ``.out`` form writing into them, with a
  workspace from ``torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs)``; the call returns
  those buffers. The LSE buffer depends on the release: 7.1.0 to 7.2.x allocate ``torch.empty(1, dtype=query.dtype)``
  whatever ``softmax_lse_flag`` says; 7.3.0 on infer it (``_npu_fused_infer_attention_score_infer_output``, op-plugin
  ``FusedInferAttentionScoreKernelNpuOpApi.cpp`` ``construct_fia_output_tensor``: ``[B, N, S, 1]`` float32 with the
  flag, ``[0]`` float32 without). Here the step is traced with ``make_fx(tracing_mode="real")``: tensor ops become
  graph nodes, Python values (lists, ``int``\\ s, branches, shapes) constants; each fused-attention call is one node,
  ``fake_npu::fia_paged_out``, writing into the buffers the release allocates, with its ``actual_seq_lengths_kv``
  host list frozen in it. An LSE the flag asks for that does not fit its buffer is refused (:class:`LseOverflow`):
  on the card the kernel writes past it. The workspace is a placeholder: its size rule is not modelled;
- **update** (``NPUGraph.update`` -> ``_GraphDispatchMode.update_capture_record``): the record list is every captured
  fused-attention call, in capture order. One dict is copied to every record; otherwise the dicts go to the records
  pairwise. Up to 7.3.x the count check compares the record count with itself, so it never fires: a list shorter than
  the records leaves the later records with their capture-time lengths, a longer one is cut, silently (``zip``);
  from 26.0.0 (handler registry, ``_npugraph_handlers/ifa_handler.py`` ``_IFAv1DefaultHandler``) a count mismatch
  raises. A key the record does not hold: up to 7.3.x it is added to the call's keywords (the op then refuses the
  unknown keyword); from 26.0.0 it is skipped;
- **replay** runs the recording on whatever the tensors it reads hold now (the static buffers, updated in place).

It also refuses what would be wrong on the device, naming it:

- a host read during capture (``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``, ...): :class:`HostRead`;
- a tensor the recording reads that was made before capture and is neither a parameter, a static buffer nor a pool
  tensor (the caller lists those): on the device its address is baked into the graph while something else owns it;
- a tensor allocated during capture that outlives it outside the recording (a workspace kept in Python state): on
  the device its memory belongs to the graph's private pool, and a later eager step would write into the graph.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fake_torch_npu import _npu_fused_infer_attention_score

UPDATABLE = "actual_seq_lengths_kv"
# Position of the updatable argument in the recorded op's schema (below).
_UPDATABLE_INDEX = 5
# The fused op's other keywords: updating them is not modelled.
_FIA_KEYWORDS = {"atten_mask", "actual_seq_lengths", "block_table", "block_size", "num_heads", "scale", "sparse_mode"}
# aten ops that read a device value on the host.
_HOST_READ_OPS = {"_local_scalar_dense", "equal", "nonzero", "_unique2", "masked_select", "is_nonzero"}
# aten factory ops: a tensor they make during capture comes from the graph's pool.
_FACTORY_OPS = {"empty", "empty_strided", "zeros", "ones", "full", "new_empty", "new_zeros", "new_full", "arange"}


@dataclass(frozen=True)
class TorchNpuRelease:
    """What one line of torch_npu releases does under auto-dispatch capture (module doc)."""

    name: str
    one_element_lse: bool  # the LSE buffer is torch.empty(1, dtype=query.dtype), whatever the flag
    checks_update_count: bool  # update refuses a dict count other than 1 or the record count; skips unknown keys


RELEASES = {
    "7.1-7.2": TorchNpuRelease(
        "torch_npu 7.1.0-7.2.x (tags v7.1.0-pytorch2.1.0 .. v7.2.0.1-pytorch2.8.0)", True, False
    ),
    "7.3": TorchNpuRelease("torch_npu 7.3.x (tags v7.3.0/v7.3.1-pytorch2.6.0 .. 2.9.0)", False, False),
    "26": TorchNpuRelease("torch_npu 26.0.0 and later (tags v26.0.0 .. v26.2.0-pytorch2.13.0, master)", False, True),
}
# The strictest line about the LSE buffer; tests/test_decode_graphs.py runs the production step under every line.
DEFAULT_RELEASE = RELEASES["7.1-7.2"]


class HostRead(RuntimeError):
    """A captured step read a device value on the host."""


class NotCaptureSafe(RuntimeError):
    """A captured step reads or keeps a tensor it may not (see the module doc)."""


class LseOverflow(RuntimeError):
    """A captured fused-attention call asks for an LSE larger than the buffer torch_npu allocated for it."""


def _fia_paged(query, key, value, block_table, block_size, actual_seq_lengths_kv, atten_mask, num_heads, kv_heads,
               scale, softmax_lse_flag):  # fmt: skip
    return _npu_fused_infer_attention_score(
        query,
        key,
        value,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths_kv=actual_seq_lengths_kv,
        atten_mask=atten_mask,
        num_heads=num_heads,
        num_key_value_heads=kv_heads,
        scale=scale,
        input_layout="BNSD",
        softmax_lse_flag=softmax_lse_flag,
    )


@torch.library.custom_op("fake_npu::fia_paged_out", mutates_args=("output", "softmax_lse"))
def fia_paged_out(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    actual_seq_lengths_kv: list[int],
    atten_mask: Optional[torch.Tensor],
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    softmax_lse_flag: bool,
    workspace: torch.Tensor,
    output: torch.Tensor,
    softmax_lse: torch.Tensor,
) -> None:
    """The paged FIA's ``.out`` form as one op: what a recording holds for each captured call."""
    out, lse = _fia_paged(query, key, value, block_table, block_size, actual_seq_lengths_kv, atten_mask, num_heads,
                          num_key_value_heads, scale, softmax_lse_flag)  # fmt: skip
    output.copy_(out)
    if not softmax_lse_flag:
        return
    if softmax_lse.numel() < lse.numel():
        raise LseOverflow(
            f"npu_fused_infer_attention_score.out with softmax_lse_flag=True writes a {tuple(lse.shape)} float32 LSE "
            f"into the {softmax_lse.numel()}-element {softmax_lse.dtype} softmax_lse buffer torch_npu allocated at "
            "capture: on the card it writes past that buffer"
        )
    softmax_lse.view(-1)[: lse.numel()] = lse.reshape(-1)


_CAPTURING: list[TorchNpuRelease] = []  # the release of the capture under way (at most one)


def recordable_fia(query, key, value, *, block_table=None, block_size=0, actual_seq_lengths_kv=None, **kwargs):
    """Outside capture: the plain stand-in. During capture: torch_npu's rewrite of the paged BNSD call to its
    ``.out`` form with the buffers the capture's release allocates (module doc); other forms are not modelled."""
    if not _CAPTURING:
        return _npu_fused_infer_attention_score(
            query, key, value, block_table=block_table, block_size=block_size,
            actual_seq_lengths_kv=actual_seq_lengths_kv, **kwargs,
        )  # fmt: skip
    if block_table is None or kwargs.pop("input_layout", "BSH") != "BNSD":
        raise NotImplementedError("fake NPU graph: only the paged BNSD fused attention call is recordable")
    flag = kwargs.pop("softmax_lse_flag", False)
    unexpected = set(kwargs) - {"atten_mask", "num_heads", "num_key_value_heads", "scale"}
    if unexpected:
        raise NotImplementedError(f"fake NPU graph: FIA arguments {sorted(unexpected)} are not recordable")
    release = _CAPTURING[-1]
    batch, heads, rows, _ = query.shape
    output = torch.empty_like(query)
    if release.one_element_lse:
        softmax_lse = torch.empty(1, dtype=query.dtype, device=query.device)
    else:
        shape = (batch, heads, rows, 1) if flag else (0,)
        softmax_lse = torch.empty(shape, dtype=torch.float32, device=query.device)
    workspace = torch.empty(1, dtype=query.dtype, device=query.device)
    fia_paged_out(query, key, value, block_table, block_size, list(actual_seq_lengths_kv), kwargs.get("atten_mask"),
                  kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["scale"], flag, workspace, output,
                  softmax_lse)  # fmt: skip
    return output, softmax_lse


@contextlib.contextmanager
def graph_mode(torch_npu):
    """The stand-in torch_npu's fused attention routed through :func:`recordable_fia` (warm-ups, capture, replays)."""
    original = torch_npu.npu_fused_infer_attention_score
    torch_npu.npu_fused_infer_attention_score = recordable_fia
    try:
        yield
    finally:
        torch_npu.npu_fused_infer_attention_score = original


class _CaptureWatch(TorchDispatchMode):
    """During capture: refuse host reads; keep a weak reference to every tensor a factory op makes."""

    def __init__(self):
        super().__init__()
        self.allocated: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_READ_OPS:
            raise HostRead(f"aten.{name} read a device value on the host during capture")
        result = func(*args, **(kwargs or {}))
        if name in _FACTORY_OPS and isinstance(result, torch.Tensor):
            self.allocated.append(weakref.ref(result))
        return result

    def __enter__(self):
        def refused_tolist(tensor):
            raise HostRead("Tensor.tolist() read a device value on the host during capture")

        torch.Tensor.tolist = refused_tolist  # shadows the C method until __exit__
        return super().__enter__()

    def __exit__(self, *exc):
        del torch.Tensor.tolist
        return super().__exit__(*exc)


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class FakeNPUGraph:
    """One recorded step (``torch.npu.NPUGraph``): :meth:`capture`, then :meth:`update` and :meth:`replay`, as the
    torch_npu ``release`` does them (:data:`RELEASES`)."""

    def __init__(self, release: TorchNpuRelease = DEFAULT_RELEASE):
        self.release = release
        self.recording: torch.fx.GraphModule | None = None

    def capture(self, step: Callable[[], object], *, may_read: Iterable[torch.Tensor]):
        """Record ``step`` (a closure over its static inputs, as stock's captured forward is). ``may_read``: the
        parameters, static buffers and pool tensors the recording may read. Returns the capture run's output."""
        watch = _CaptureWatch()
        _CAPTURING.append(self.release)
        try:
            with watch:
                recording = make_fx(step, tracing_mode="real")()
        finally:
            _CAPTURING.pop()
        with _disable_current_modes():
            output = recording()
        allowed = _storages(may_read)
        for node in recording.graph.nodes:
            if node.op == "get_attr":
                tensor = getattr(recording, node.target)
                if tensor.untyped_storage().data_ptr() not in allowed:
                    raise NotCaptureSafe(
                        f"the recording reads a {tuple(tensor.shape)} {tensor.dtype} tensor made before capture that "
                        "is no parameter, static buffer or pool tensor"
                    )
        kept = _storages(_flat_tensors(output))
        gc.collect()
        for ref in watch.allocated:
            tensor = ref()
            if tensor is not None and tensor.untyped_storage().data_ptr() not in kept:
                raise NotCaptureSafe(
                    f"a {tuple(tensor.shape)} {tensor.dtype} tensor allocated during capture outlives it (on the "
                    "device it belongs to the graph's pool)"
                )
        self.recording = recording
        return output

    def fia_records(self) -> list[torch.fx.Node]:
        """The records ``NPUGraph.update`` walks: every captured fused-attention call, in capture order."""
        return [
            node
            for node in self.recording.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.fake_npu.fia_paged_out.default
        ]

    def update(self, cpu_update_input: list[dict]) -> None:
        """``NPUGraph.update(cpu_update_input=...)`` as the release does it (module doc)."""
        records = self.fia_records()
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in records]
        if self.release.checks_update_count and len(cpu_update_input) != len(records):
            raise RuntimeError(f"NPUGraph.update: {len(cpu_update_input)} dicts for {len(records)} recorded calls")
        for node, update in zip(records, cpu_update_input):  # up to 7.3.x a count mismatch passes: zip cuts it
            arguments = list(node.args)
            for name, value in update.items():
                if name == UPDATABLE:
                    arguments[_UPDATABLE_INDEX] = list(value)
                elif name in _FIA_KEYWORDS:
                    raise NotImplementedError(f"fake NPU graph: updating {name!r} is not modelled")
                elif not self.release.checks_update_count:
                    raise TypeError(f"npu_fused_infer_attention_score.out() got an unexpected keyword {name!r}")
            node.args = tuple(arguments)
        self.recording.recompile()

    def replay(self):
        return self.recording()


def _flat_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _flat_tensors(item)]
    return []
