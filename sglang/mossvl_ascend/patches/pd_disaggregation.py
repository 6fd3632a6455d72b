"""Prefill/decode disaggregation of MOSS-VL requests (sglang's PD over Mooncake, TCP on CPU).

A transferred request arrives at the decode server as a slot row ``[encoder slots | text slots]`` filled by the prefill
server; the decode server must turn it into exactly the decode row an aggregated server has after its extend.
Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)

# Mooncake's TCP transport admits 1024 queued transfers and 1024 pending admissions per peer and waits 1 s for an
# admission; one KV transfer batch carries (2 x layers x contiguous page runs) entries, and sglang drops the peer after
# one failed batch. Measured on this 2-core machine: 2048-4096 entries failed with rc=-1 at the defaults, 16384
# passed with these (docs/scale-out.md).
MOONCAKE_TCP_LIMITS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_TCP_ADMISSION_TIMEOUT_MS": "10000",
}


# The device each transfer backend's engine moves memory of (read in sglang 0.5.23): nixl registers the KV as "VRAM"
# (`disaggregation/nixl/conn.py`), mori is AMD's GPU RDMA/SDMA, `ascend` is memfabric's NPU transfer
# (`disaggregation/ascend/transfer_engine.py`, `libmf_hybm_core.so` dlopens `libascend_hal.so`).
BACKEND_DEVICES = {"nixl": ("cuda",), "mori": ("cuda",), "ascend": ("npu",)}
# The Python package each backend's engine imports, and how to install it.
BACKEND_PACKAGES = {
    "mooncake": ("mooncake", "pip install mooncake-transfer-engine (mooncake-transfer-engine-non-cuda off CUDA)"),
    "ascend": ("memfabric_hybrid", "pip install memfabric-hybrid, with the CANN toolkit"),
}
# sglang's switch for a prefill server's early send of a request's radix-cached prefix
# (`disaggregation/prefill.py` `maybe_send_cached_prefix_chunk`): with overlap scheduling it records a
# `torch.cuda.Event` on the forward stream, which off CUDA kills the scheduler.
EARLY_SEND_ENV = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
# memfabric's config store, which every prefill and decode process of a deployment connects to.
ASCEND_STORE_URL_ENV = "ASCEND_MF_STORE_URL"
ASCEND_STORE_URL = re.compile(r"^tcp://[^:/\s]+:\d+$")


def encoder_len_of(req: Any) -> int:
    """The encoder slots at the front of a request's row, as ``prepare_encoder_info_extend`` counts them."""
    mm_inputs = req.multimodal_inputs
    return 0 if mm_inputs is None or mm_inputs.num_image_tokens is None else mm_inputs.num_image_tokens


def decode_rows_after_transfer(result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``prepare_for_prebuilt``: an encoder-decoder batch gets its encoder lengths (every encoder
    cached) and text-only ``seq_lens``, the state an aggregated batch is in after ``prepare_encoder_info_extend``."""
    if not batch.model_config.is_encoder_decoder:
        return result
    encoder_lens = [encoder_len_of(req) for req in batch.reqs]
    text_lens = [row - encoder for row, encoder in zip(batch.seq_lens_cpu.tolist(), encoder_lens)]
    batch.encoder_lens_cpu = encoder_lens
    batch.encoder_cached = [True] * len(encoder_lens)
    batch.encoder_lens = torch.tensor(encoder_lens, dtype=torch.int64, device=batch.device)
    batch.seq_lens_cpu = torch.tensor(text_lens, dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.to(batch.device)
    batch.orig_seq_lens = torch.tensor(text_lens, dtype=torch.int32, device=batch.device)
    batch.seq_lens_sum = sum(text_lens)
    return result


def host_indices_only_with_cuda(result: Any, sender: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``MooncakeKVSender.__init__``: without CUDA the sender takes the plain index path."""
    if not torch.cuda.is_available():
        sender.supports_host_tensor_indices = False
    return result


def pd_start_up(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``handle_pd_disaggregation``: what a PD worker on CPU or NPU needs before it starts."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cfg.disaggregation_mode == "null":
        return result
    refuse_what_this_host_cannot_transfer(cfg.device, cfg.disaggregation_transfer_backend)
    if cfg.disaggregation_enable_kv_checksum and cfg.device != "cuda":
        raise ValueError(
            f"--disaggregation-enable-kv-checksum cannot run on --device {cfg.device}: stock computes the checksum on "
            "cuda:<gpu_id> (disaggregation/prefill.py, decode.py); drop the flag."
        )
    if cfg.disaggregation_mode == "prefill" and cfg.device != "cuda":
        send_cached_prefixes_with_the_rest()
    if cfg.disaggregation_transfer_backend == "mooncake" and os.environ.get("MC_FORCE_TCP") == "1":
        set_mooncake_tcp_limits()
    if cfg.disaggregation_mode == "decode" and cfg.device == "cpu":
        backup = cpu_retraction_backup(cfg.disaggregation_decode_retraction_backup)
        declare_resolution(server_args, "mossvl_ascend.pd_start_up", disaggregation_decode_retraction_backup=backup)
    return result


def refuse_what_this_host_cannot_transfer(device: str, backend: str) -> None:
    """One line, before any scheduler starts, for a transfer backend this device or this environment cannot run;
    for ``ascend``, one line naming its protocol once it resolves."""
    devices = BACKEND_DEVICES.get(backend)
    if devices is not None and device not in devices:
        raise ValueError(
            f"--disaggregation-transfer-backend {backend} cannot run on --device {device}: its engine moves "
            f"{'/'.join(devices)} memory; use mooncake_tcp on cpu, ascend on npu."
        )
    package, install = BACKEND_PACKAGES.get(backend, (None, None))
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"--disaggregation-transfer-backend {backend} needs the Python package {package}, which is not "
            f"installed here ({install})."
        )
    if backend == "ascend":
        store_url = os.environ.get(ASCEND_STORE_URL_ENV, "")
        if not ASCEND_STORE_URL.match(store_url):
            raise ValueError(
                f"--disaggregation-transfer-backend ascend needs {ASCEND_STORE_URL_ENV}=tcp://IP:PORT (memfabric's "
                f"config store, the same on every prefill and decode server); got {store_url or 'nothing'!r}."
            )
        protocol = os.environ.get("ASCEND_MF_TRANSFER_PROTOCOL") or "sdma (default; A2/910B needs device_rdma)"
        logger.info("PD over memfabric: store %s, protocol %s", store_url, protocol)


def send_cached_prefixes_with_the_rest() -> None:
    """Off CUDA a prefill server sends a request's radix-cached prefix with the rest of its KV, not ahead of its
    forward: stock's early send records a ``torch.cuda.Event`` on the forward stream ("expected stream to be a
    torch.Stream or torch.cuda.Stream object" on CPU, the scheduler dead). Refused, one line, if the user set it."""
    from sglang.srt.environ import envs

    # Read as stock reads it (its EnvBool: unset means on, an unparsable value falls back to on).
    early_send = envs.SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX
    if early_send.is_set() and early_send.get():
        raise ValueError(
            f"{EARLY_SEND_ENV}={os.environ[EARLY_SEND_ENV]} cannot run on a PD prefill server off CUDA: its early "
            "send records a torch.cuda.Event on the forward stream; unset it (the prefix then goes with the rest of "
            "the KV)."
        )
    os.environ[EARLY_SEND_ENV] = "0"
    logger.info("PD prefill off CUDA: %s=0 (a cached prefix goes with the rest of the KV).", EARLY_SEND_ENV)


def set_mooncake_tcp_limits() -> None:
    """The per-peer limits a KV batch needs, in this (the launcher's) environment, which the scheduler inherits,
    unless the user set them; one line says which were set and which kept."""
    kept = {name: os.environ[name] for name in MOONCAKE_TCP_LIMITS if name in os.environ}
    chosen = {name: value for name, value in MOONCAKE_TCP_LIMITS.items() if name not in kept}
    os.environ.update(chosen)
    logger.info("Mooncake over TCP: set %s; kept the user's %s", chosen or "nothing", kept or "nothing")


def cpu_retraction_backup(chosen: str | None) -> str:
    """A CPU decode server's retraction backup: ``cpu_tensor`` unless the user chose one; ``host_pool`` refused,
    because its host KV pool registers memory through CUDA ("Found no NVIDIA driver on your system")."""
    if chosen == "host_pool":
        raise ValueError(
            "PD decode on CPU cannot run with --disaggregation-decode-retraction-backup host_pool: its host KV pool "
            "registers memory through CUDA; use cpu_tensor (the default here)."
        )
    if chosen is None:
        logger.info("PD decode on CPU: --disaggregation-decode-retraction-backup cpu_tensor (stock infers host_pool).")
    return chosen or "cpu_tensor"


PATCHES = (
    Patch(
        title="A transferred encoder-decoder request becomes the decode row an aggregated extend leaves",
        target=(
            "sglang.srt.disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin"
            ".prepare_for_prebuilt"
        ),
        kind=HookType.AFTER,
        hook=decode_rows_after_transfer,
        platforms=ON_NPU_AND_CPU,
        why=(
            "a PD decode server builds its batch from a transferred request in `prepare_for_prebuilt`, which never "
            "sets `encoder_lens`/`encoder_lens_cpu`/`encoder_cached` (the aggregated path's "
            "`prepare_encoder_info_extend` does) and counts the encoder slots in `seq_lens`. Issue 51 measured on "
            "CPU (tiny checkpoint, page 128, `mooncake_tcp`, smg in PD mode): the first image request killed the "
            "decode scheduler in `patches.paged_decode` -> `alloc_for_decode_default` with `TypeError: unsupported "
            "operand type(s) for +: 'NoneType' and 'Tensor'`; MOSS-VL's forward also asserts on `encoder_lens`."
        ),
        how=(
            "after stock's method, for an encoder-decoder model: per request the encoder length stock's own extend "
            "would use (`multimodal_inputs.num_image_tokens`, set by `pad_input_ids` on the decode server too), every "
            "encoder marked cached (the prefill server computed it), and `seq_lens`/`seq_lens_cpu`/`orig_seq_lens`/"
            "`seq_lens_sum` reduced to the text length. The row then decodes, merges and allocates (`paged_decode`) "
            "like an aggregated one; frame visibility comes from the decode server's own multimodal inputs."
        ),
        upstream="open in 0.5.23 (nothing under `disaggregation/` reads `encoder_lens`)",
        remove_when="`prepare_for_prebuilt` sets the encoder information of encoder-decoder requests",
    ),
    Patch(
        title="Mooncake's host-tensor page indices only with CUDA",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
        kind=HookType.AFTER,
        hook=host_indices_only_with_cuda,
        platforms=ON_NPU_AND_CPU,
        why=(
            "`MooncakeKVSender.supports_host_tensor_indices = True` sends the prefill server "
            "(`disaggregation/prefill.py` `send_kv_chunk`) down a path that allocates pinned memory and records a "
            "`torch.cuda.Event`: without CUDA both raise 'Found no NVIDIA driver on your system'. The plain index "
            "path beside it (`kv_to_page_indices`) runs on any device."
        ),
        how="each sender built without CUDA sets `supports_host_tensor_indices = False` on itself",
        upstream="open in 0.5.23",
        remove_when="`send_kv_chunk` checks the device before the host-index path",
    ),
    Patch(
        title=(
            "PD workers on CPU and NPU: Mooncake TCP limits, a CPU decode server's retraction backup, what the host "
            "cannot transfer refused"
        ),
        target="sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
        kind=HookType.AFTER,
        hook=pd_start_up,
        platforms=ON_NPU_AND_CPU,
        why=(
            "one Mooncake KV batch carries 2 x layers x contiguous page runs entries; at Mooncake's TCP defaults "
            "(1024 queued transfers and pending admissions per peer, 1 s admission timeout) batches of 2048-4096 "
            "entries failed with rc=-1 on a busy CPU, and sglang fails the peer session for good after one failed "
            "batch. A CPU decode server did not start: with `--disaggregation-decode-retraction-backup` unset stock "
            "infers `host_pool`, whose host KV pool registers memory through CUDA (`mem_cache/pool_host/common.py` "
            "`_cuda_host_register`: 'Found no NVIDIA driver on your system'). Stock resolves, and fails only in the "
            "scheduler after the model loaded (or never, silently), a transfer backend for another device (nixl "
            "registers the KV as VRAM, `ascend`'s memfabric dlopens libascend_hal.so), an engine whose package is "
            "missing (`ascend/transfer_engine.py` re-raises memfabric's ImportError), `ascend` without "
            "`ASCEND_MF_STORE_URL` (memfabric initialises with None), and `--disaggregation-enable-kv-checksum` off "
            "CUDA (built on `cuda:<gpu_id>`). A CPU prefill server's scheduler died at the first request whose prefix "
            "its radix cache held (`tests/test_serving_pd_faults.py`, page 1: a video asked twice): "
            "`maybe_send_cached_prefix_chunk` records a `torch.cuda.Event` on the forward stream, 'expected stream to "
            "be a torch.Stream or torch.cuda.Stream object'."
        ),
        how=(
            "for a PD server on Mooncake with `MC_FORCE_TCP=1` (what `mooncake_tcp` sets), "
            + ", ".join(f"`{name}={value}`" for name, value in MOONCAKE_TCP_LIMITS.items())
            + " are set in the launcher's environment (inherited by the scheduler) unless the user set them, one line "
            "logging what was set and what kept. A decode server on CPU resolves the retraction backup to "
            "`cpu_tensor` when unset (one line) and refuses `host_pool` with one line; on NPU stock's choice stays "
            "(`host_pool` with the `kernel_ascend` IO backend). Refused with one line at argument resolution: "
            "nixl/mori off CUDA and `ascend` off NPU; `mooncake`/`ascend` when `mooncake`/`memfabric_hybrid` is not "
            "importable (naming the pip package); `ascend` without `ASCEND_MF_STORE_URL=tcp://IP:PORT`; the KV "
            "checksum off CUDA. `ascend` that resolves logs its store and protocol (sdma by default; A2 needs "
            "`ASCEND_MF_TRANSFER_PROTOCOL=device_rdma`). A prefill server off CUDA sets "
            f"`{EARLY_SEND_ENV}=0` (stock's switch; the cached prefix then goes with the rest of the KV, as stock does "
            "when the prefix does not end on a page) and refuses it set true, one line each."
        ),
        upstream="Mooncake's defaults, sglang sets none of them; stock's `host_pool` inference ignores the device",
        remove_when=(
            "Mooncake's TCP transport sizes its queues for a batch (or sglang retries a failed batch), and stock "
            "infers `cpu_tensor` off CUDA/NPU"
        ),
    ),
)
