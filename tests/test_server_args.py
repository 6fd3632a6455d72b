"""Server-argument resolution for MOSS-VL on npu / cpu / cuda, through real sglang resolution.

The plugin's server-args hook is registered and applied exactly as sglang's plugin loader
does (the patch records, then ``HookRegistry.apply_hooks()``, restored afterwards); each case parses a command line with
``prepare_server_args`` and runs the real resolution pipeline (``resolve_once``).

Stand-ins: this machine has no NPU and no ``torch_npu``. Stock NPU resolution reads the
device memory size (``get_npu_memory_capacity``) to pick chunk and graph sizes; the tests
replace that one probe with a constant 64 GiB (an Ascend 910B2-class card). Nothing else is
simulated: ``--device npu`` drives the rest of stock resolution as on real hardware.
"""

import json
import logging

import pytest

from mossvl_ascend.patches import server_args as mossvl_server_args
from support.hooks import patches_applied

SOURCE_PR_COMMAND = [
    "--device", "npu",
    "--attention-backend", "ascend",
    "--prefill-attention-backend", "ascend",
    "--decode-attention-backend", "ascend",
    "--sampling-backend", "ascend",
    "--mm-attention-backend", "ascend_attn",
    "--trust-remote-code",
    "--enable-multimodal",
]  # fmt: skip
FLASHINFER_ASSERTION = "requires flashinfer prefill attention backend"


@pytest.fixture(scope="module", autouse=True)
def plugin_hook_applied():
    with patches_applied(*mossvl_server_args.PATCHES):
        yield


@pytest.fixture
def model_dir(tmp_path):
    """A throwaway checkpoint directory: sglang reads only ``config.json`` to resolve args."""
    config = {
        "architectures": ["MossVLForConditionalGeneration"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def npu_memory_stand_in(monkeypatch):
    """Stand-in for the NPU memory probe (needs torch_npu): a 64 GiB card."""
    import sglang.srt.hardware_backend.npu.utils as npu_utils
    import sglang.srt.utils.common as common

    def capacity_mib():
        return 64 * 1024

    monkeypatch.setattr(npu_utils, "get_npu_memory_capacity", capacity_mib)
    monkeypatch.setattr(common, "get_npu_memory_capacity", capacity_mib)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("ASCEND_USE_FIA", "ASCEND_USE_FA", "MOSSVL_NPU_PAGED_ATTENTION"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def plugin_log():
    """Records of the plugin's server-args logger (root handlers are reset by sglang)."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger(mossvl_server_args.__name__)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def resolve(model_dir, *argv):
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(model_dir), *argv])
    args.resolve_once()
    return resolving_view(args)


def backends(view):
    return (
        view.attention_backend,
        view.prefill_attention_backend,
        view.decode_attention_backend,
        view.sampling_backend,
    )


def test_npu_source_pr_command_and_short_form_resolve_to_ascend(model_dir, npu_memory_stand_in):
    full = resolve(model_dir, *SOURCE_PR_COMMAND)
    short = resolve(model_dir, "--device", "npu")
    assert backends(full) == ("ascend", "ascend", "ascend", "ascend")
    assert backends(short) == backends(full)
    assert full.mm_attention_backend == "ascend_attn"
    for view in (full, short):
        assert view.disable_radix_cache is False
        assert view.cuda_graph_config.decode.backend != "disabled"
        assert view.page_size == 128


def test_npu_decode_graphs_are_on_with_stocks_buckets_and_off_on_request(
    model_dir, text_model_dir, npu_memory_stand_in
):
    """Oracle: stock's own NPU resolution for a model the plugin does not touch (decode graphs, buckets)."""
    plain = resolve(text_model_dir, "--device", "npu")
    view = resolve(model_dir, "--device", "npu")
    assert view.cuda_graph_config.decode.backend == plain.cuda_graph_config.decode.backend != "disabled"
    assert view.cuda_graph_config.decode.bs == plain.cuda_graph_config.decode.bs
    assert resolve(model_dir, "--device", "npu", "--disable-cuda-graph").cuda_graph_config.decode.backend == "disabled"


def test_npu_refuses_torch_compile_with_one_line(model_dir, npu_memory_stand_in):
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        resolve(model_dir, "--device", "npu", "--enable-torch-compile")


def test_npu_keeps_explicit_user_backends(model_dir, npu_memory_stand_in):
    split = resolve(model_dir, "--device", "npu", "--decode-attention-backend", "torch_native")
    assert (split.prefill_attention_backend, split.decode_attention_backend) == (
        "ascend",
        "torch_native",
    )
    base = resolve(model_dir, "--device", "npu", "--attention-backend", "torch_native")
    assert backends(base)[:3] == ("torch_native",) * 3
    sampling = resolve(model_dir, "--device", "npu", "--sampling-backend", "pytorch")
    assert sampling.sampling_backend == "pytorch"


def test_npu_keeps_the_radix_cache_and_honours_disable_radix_cache(model_dir, npu_memory_stand_in, plugin_log):
    """The source PR turned the radix cache off on NPU; its cause (decode overwriting prompt K/V at page 128) is
    fixed by `paged_decode`, so the stock default (on) stands and the stock flag still turns it off."""
    assert resolve(model_dir, "--device", "npu").disable_radix_cache is False
    assert resolve(model_dir, "--device", "npu", "--disable-radix-cache").disable_radix_cache is True
    assert not [r for r in plugin_log if "radix" in r.getMessage().lower()]


@pytest.mark.parametrize("name,value", [("ASCEND_USE_FIA", "1"), ("ASCEND_USE_FA", "true")])
def test_npu_refuses_fused_ascend_extend_env(model_dir, npu_memory_stand_in, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        resolve(model_dir, "--device", "npu")


def test_npu_accepts_fused_ascend_extend_env_set_off(model_dir, npu_memory_stand_in, monkeypatch):
    monkeypatch.setenv("ASCEND_USE_FIA", "0")
    monkeypatch.setenv("ASCEND_USE_FA", "false")
    assert resolve(model_dir, "--device", "npu").attention_backend == "ascend"


@pytest.mark.parametrize("dtype", ["float32", "float"])
def test_npu_refuses_fp32_at_start_up(model_dir, npu_memory_stand_in, dtype):
    with pytest.raises(ValueError, match="float16/bfloat16 only"):
        resolve(model_dir, "--device", "npu", "--dtype", dtype)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_npu_takes_half_dtypes_and_logs_the_choice(model_dir, npu_memory_stand_in, plugin_log, dtype):
    resolve(model_dir, "--device", "npu", "--dtype", dtype)
    choice = [r.getMessage() for r in plugin_log if "page size" in r.getMessage()]
    assert choice == [f"MOSS-VL on NPU: dtype {dtype}, page size 128, gathered fused attention for one-row groups."]


@pytest.mark.parametrize("page_size", ["1", "4", "1024"])
def test_npu_paged_attention_refuses_a_block_size_the_op_rejects(
    model_dir, npu_memory_stand_in, monkeypatch, page_size
):
    monkeypatch.setenv("MOSSVL_NPU_PAGED_ATTENTION", "1")
    with pytest.raises(ValueError, match=f"multiple of 16 up to 512.*got {page_size}"):
        resolve(model_dir, "--device", "npu", "--page-size", page_size)


def test_npu_paged_attention_takes_the_default_page_size(model_dir, npu_memory_stand_in, monkeypatch, plugin_log):
    monkeypatch.setenv("MOSSVL_NPU_PAGED_ATTENTION", "1")
    assert resolve(model_dir, "--device", "npu").page_size == 128
    assert any("page size 128, paged fused" in r.getMessage() for r in plugin_log)
    monkeypatch.delenv("MOSSVL_NPU_PAGED_ATTENTION")
    gathered = resolve(model_dir, "--device", "npu", "--page-size", "1", "--disable-cuda-graph")
    assert gathered.page_size == 1  # the gathered eager path takes any


@pytest.mark.parametrize("page_size", ["1", "24", "1024"])
def test_npu_decode_graphs_refuse_a_page_size_the_paged_op_rejects_in_one_line(
    model_dir, npu_memory_stand_in, page_size
):
    """The captured decode step always calls the paged fused op (block size = page size: 16-aligned, at most 512):
    with graphs on (the NPU default) such a page size would fail at capture, so start-up refuses it."""
    with pytest.raises(ValueError, match=f"decode graphs.*multiple of 16 up to 512.*got {page_size}") as refused:
        resolve(model_dir, "--device", "npu", "--page-size", page_size)
    assert "\n" not in str(refused.value) and "--disable-cuda-graph" in str(refused.value)
    assert resolve(model_dir, "--device", "npu", "--page-size", page_size, "--disable-cuda-graph").page_size == int(
        page_size
    )


@pytest.mark.parametrize("page_size", ["16", "128", "512"])
def test_npu_decode_graphs_take_the_page_sizes_the_paged_op_takes(model_dir, npu_memory_stand_in, page_size):
    view = resolve(model_dir, "--device", "npu", "--page-size", page_size)
    assert view.page_size == int(page_size) and view.cuda_graph_config.decode.backend != "disabled"


def test_cpu_defaults_to_torch_native(model_dir):
    view = resolve(model_dir, "--device", "cpu")
    assert view.attention_backend == "torch_native"
    assert (view.prefill_attention_backend, view.decode_attention_backend) == (None, None)
    assert view.disable_radix_cache is False


def test_cpu_keeps_user_backend_without_flashinfer_assertion(model_dir):
    # Stock's flashinfer assertion rejected any non-flashinfer choice here.
    view = resolve(model_dir, "--device", "cpu", "--attention-backend", "flex_attention")
    assert view.attention_backend == "flex_attention"


def test_cuda_keeps_stock_flashinfer_default(model_dir):
    view = resolve(model_dir, "--device", "cuda")
    assert view.prefill_attention_backend == "flashinfer"
    assert view.disable_radix_cache is False
    assert view.cuda_graph_config.decode.backend != "disabled"


def test_cuda_keeps_stock_flashinfer_assertion(model_dir):
    with pytest.raises(AssertionError, match=FLASHINFER_ASSERTION):
        resolve(model_dir, "--device", "cuda", "--attention-backend", "triton")


@pytest.mark.parametrize("ranks_flag", [["--tp-size", "8"], ["--dp-size", "8"]], ids=["tp8", "dp8"])
def test_npu_source_pr_command_on_eight_cards(model_dir, npu_memory_stand_in, ranks_flag):
    """The source PR's 8-card 910B command line: MOSS-VL resolution does not depend on the rank count."""
    view = resolve(model_dir, *SOURCE_PR_COMMAND, *ranks_flag)
    size = int(ranks_flag[1])
    assert (view.tp_size, view.dp_size) == ((size, 1) if ranks_flag[0] == "--tp-size" else (1, size))
    assert backends(view) == ("ascend", "ascend", "ascend", "ascend")
    assert view.mm_attention_backend == "ascend_attn"
    assert view.disable_radix_cache is False
    assert view.cuda_graph_config.decode.backend != "disabled"
    assert view.page_size == 128


# ---- chunked prefill: kept on npu and cpu, with the radix cache on or off (stock resolves -1); CUDA stays stock.
# The oracle for the defaults is stock resolution itself: the chunk size sglang picks for a plain Llama on that device.


@pytest.fixture
def text_model_dir(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 512,
    }  # fmt: skip
    path = tmp_path / "text-model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


# (device flags, radix opt-in env on NPU, the radix cache state they resolve to)
RADIX_CONFIGS = {
    "npu": (["--device", "npu"], False),
    "npu-no-radix": (["--device", "npu", "--disable-radix-cache"], True),
    "cpu": (["--device", "cpu"], False),
    "cpu-no-radix": (["--device", "cpu", "--disable-radix-cache"], True),
}


@pytest.fixture(params=list(RADIX_CONFIGS))
def radix_config(request):
    return RADIX_CONFIGS[request.param]


def test_default_chunk_size_is_the_stock_device_default(model_dir, text_model_dir, npu_memory_stand_in, radix_config):
    argv, radix_disabled = radix_config
    moss_vl = resolve(model_dir, *argv)
    text_model = resolve(text_model_dir, *argv[:2]).chunked_prefill_size
    assert moss_vl.disable_radix_cache is radix_disabled
    assert moss_vl.chunked_prefill_size == text_model > 0


def test_explicit_chunk_size_and_mixed_chunks_are_kept(model_dir, npu_memory_stand_in, radix_config, plugin_log):
    argv, radix_disabled = radix_config
    view = resolve(model_dir, *argv, "--chunked-prefill-size", "256", "--enable-mixed-chunk")
    assert view.disable_radix_cache is radix_disabled
    assert (view.chunked_prefill_size, view.enable_mixed_chunk) == (256, True)
    assert not [r for r in plugin_log if "chunk" in r.getMessage().lower()]


def test_cuda_still_turns_chunked_prefill_off(model_dir):
    assert resolve(model_dir, "--device", "cuda", "--chunked-prefill-size", "256").chunked_prefill_size == -1


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_a_mixed_chunk_under_two_pages_gets_one_warning(model_dir, npu_memory_stand_in, plugin_log, device):
    paged = ["--device", device, "--page-size", "128", "--enable-mixed-chunk", "--chunked-prefill-size"]
    resolve(model_dir, *paged, "256")
    assert not [r for r in plugin_log if "admits no new request" in r.getMessage()]
    resolve(model_dir, *paged, "128")
    (line,) = [r.getMessage() for r in plugin_log if "admits no new request" in r.getMessage()]
    assert "--chunked-prefill-size 128" in line and "use 256 or more" in line
