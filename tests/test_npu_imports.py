"""The pure-torch ``split_qkv_rmsnorm_rope`` fallback and the start-up imports it unblocks.

Numerics: the fallback against (a) a separate split + RMSNorm + rotary written here from
first principles and (b) qwen3's own CPU path (``RMSNorm`` + ``RotaryEmbedding.forward_native``
fed by ``get_cos_sin_with_position``, the call qwen3's NPU path makes), in fp32.

Imports: a fresh interpreter simulates an Ascend host with a broken ``sgl_kernel_npu``
(``tests/support/simulated_npu.py``, labelled stand-ins throughout). The import checks' interpreters start together
(each imports sglang on one core for ~13 s); each test reads only its own.
"""

import functools
import sys

import pytest
import torch

from mossvl_ascend.patches import npu_imports
from support.simulated_npu import run_python, run_simulated_npu
from support.together import started_together

STARTUP_IMPORTS = [
    "sglang.srt.models.qwen3",
    "sglang.srt.entrypoints.openai.transcription_adapters",
]


# The entry modules ``sglang.launch_server`` and ``run_scheduler_process`` import before they call ``load_plugins()``.
ENTRY_MODULES_CODE = (
    "import sys, sglang.launch_server, sglang.srt.managers.scheduler;"
    "print('QWEN3_LOADED', 'sglang.srt.models.qwen3' in sys.modules)"
)


@pytest.fixture(scope="module")
def fresh_interpreters(tmp_path_factory):
    """The module's fresh-interpreter checks, started at once: name -> a future of its report (or process)."""
    runs = {
        f"{plugin}_plugin": functools.partial(
            run_simulated_npu, tmp_path_factory.mktemp(plugin), STARTUP_IMPORTS, register_plugin=plugin == "with"
        )
        for plugin in ("with", "without")
    }
    with started_together({**runs, "entry_modules": functools.partial(run_python, ENTRY_MODULES_CODE)}) as futures:
        yield futures


def test_broken_kernel_blocks_startup_imports_without_plugin(fresh_interpreters):
    report = fresh_interpreters["without_plugin"].result()
    for name in STARTUP_IMPORTS:
        assert "triton.language.extra.cann" in report["imported"][name], name


def test_plugin_unblocks_startup_imports_with_one_warning(fresh_interpreters):
    report = fresh_interpreters["with_plugin"].result()
    assert report["imported"] == {name: "ok" for name in STARTUP_IMPORTS}
    assert report["qwen3_uses_fallback"]
    assert len(report["plugin_warnings"]) == 1
    assert "triton.language.extra.cann" in report["plugin_warnings"][0]


def test_fallback_is_not_applied_off_npu():
    from mossvl_ascend.registry import apply_patches

    before = sys.modules.get(npu_imports.KERNEL_MODULE)
    assert apply_patches(patches=npu_imports.PATCHES) == []  # this CPU host: is_npu() is False
    assert sys.modules.get(npu_imports.KERNEL_MODULE) is before


# ---- numerics -------------------------------------------------------------------------------


def reference_split_norm_rope(qkv, positions, q_size, kv_size, head_dim, eps, weights, biases, base):
    """Separate steps written from the definitions: split, per-head RMSNorm, pairwise rotation."""
    q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float64) * 2 / head_dim))
    angle = positions.double()[:, None] * inv_freq[None, :]  # [T, half]
    c, s = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]

    def one(x, weight, bias):
        x = x.double().reshape(x.shape[0], -1, head_dim)
        rms = torch.sqrt((x * x).sum(-1, keepdim=True) / head_dim + eps)
        x = x / rms * weight.double() + (0 if bias is None else bias.double())
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return rotated.reshape(x.shape[0], -1)

    return one(q, weights[0], biases[0]), one(k, weights[1], biases[1]), v.double()


def cos_sin_rows(positions, head_dim, base):
    """Full-width cos/sin rows ``[T, 1, 1, D]``, rotate-half layout, as qwen3's NPU path passes."""
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) * 2 / head_dim))
    angle = positions.float()[:, None] * inv_freq[None, :]
    full = torch.cat((angle, angle), dim=-1)
    return torch.cos(full)[:, None, None, :], torch.sin(full)[:, None, None, :]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (2, 2)])
def test_fallback_matches_separate_split_norm_rope(with_bias, num_q_heads, num_kv_heads):
    torch.manual_seed(0)
    head_dim, base, eps, tokens = 16, 10000.0, 1e-6, 7
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size) * 3
    positions = torch.tensor([0, 1, 2, 5, 9, 33, 100])
    weights = (torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5)
    biases = (torch.randn(head_dim), torch.randn(head_dim)) if with_bias else (None, None)
    cos, sin = cos_sin_rows(positions, head_dim, base)

    q, k, v = npu_imports.split_qkv_rmsnorm_rope(
        qkv, sin, cos, q_size, kv_size, head_dim, eps=eps,
        q_weight=weights[0], k_weight=weights[1], q_bias=biases[0], k_bias=biases[1],
    )  # fmt: skip
    q_ref, k_ref, v_ref = reference_split_norm_rope(
        qkv, positions, q_size, kv_size, head_dim, eps, weights, biases, base
    )
    assert q.shape == (tokens, q_size) and k.shape == v.shape == (tokens, kv_size)
    torch.testing.assert_close(q.double(), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.double(), v_ref, rtol=0, atol=0)


def test_fallback_without_eps_only_splits_and_rotates():
    torch.manual_seed(1)
    head_dim, base, tokens = 8, 10000.0, 5
    qkv = torch.randn(tokens, 4 * head_dim)
    positions = torch.arange(tokens) * 3
    cos, sin = cos_sin_rows(positions, head_dim, base)
    q, k, _ = npu_imports.split_qkv_rmsnorm_rope(qkv, sin, cos, 2 * head_dim, head_dim, head_dim)
    # Without eps the kernel skips the norm: the reference is the rotation alone.
    half = head_dim // 2
    x = qkv[:, : 2 * head_dim].reshape(tokens, 2, head_dim)
    angle = positions.float()[:, None, None] * (1.0 / (base ** (torch.arange(half).float() * 2 / head_dim)))
    x1, x2 = x[..., :half], x[..., half:]
    c, s = torch.cos(angle), torch.sin(angle)
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(tokens, -1)
    torch.testing.assert_close(q, expected, rtol=1e-5, atol=1e-5)
    assert k.shape == (tokens, head_dim)


def test_fallback_matches_qwen3_native_prepare_path():
    """Same inputs through qwen3's CPU path: ``RMSNorm`` per head, then ``forward_native`` rope."""
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope

    torch.manual_seed(2)
    head_dim, num_q_heads, num_kv_heads, tokens = 32, 4, 2, 6
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    rope = get_rope(
        head_dim, rotary_dim=head_dim, max_position=256, base=1000000, is_neox_style=True,
        dtype=torch.float32,
    )  # fmt: skip
    q_norm, k_norm = RMSNorm(head_dim, eps=1e-6), RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim) + 0.5)
    qkv = torch.randn(tokens, q_size + 2 * kv_size)
    positions = torch.tensor([3, 4, 5, 6, 200, 255])

    rope.get_cos_sin_with_position(positions)
    q, k, v = npu_imports.split_qkv_rmsnorm_rope(
        qkv, rope.position_sin, rope.position_cos, q_size, kv_size, head_dim,
        eps=q_norm.variance_epsilon, q_weight=q_norm.weight, k_weight=k_norm.weight,
    )  # fmt: skip

    q_raw, k_raw, v_raw = qkv.split([q_size, kv_size, kv_size], dim=-1)
    with torch.no_grad():
        q_ref = q_norm.forward_native(q_raw.reshape(-1, head_dim)).reshape(tokens, q_size)
        k_ref = k_norm.forward_native(k_raw.reshape(-1, head_dim)).reshape(tokens, kv_size)
        q_ref, k_ref = rope.forward_native(positions, q_ref, k_ref)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, v_raw)


def test_entry_modules_do_not_import_qwen3_before_plugins_load(fresh_interpreters):
    """The fallback is installed by ``load_plugins()``, which ``sglang.launch_server``'s main and
    ``run_scheduler_process`` call after importing their own modules: those imports must not
    reach ``models/qwen3.py`` (the HTTP server module, which does, is imported after)."""
    proc = fresh_interpreters["entry_modules"].result()
    assert "QWEN3_LOADED False" in proc.stdout, proc.stderr[-3000:]
