"""The import-only sgl_kernel stand-in: imports succeed, any call fails loudly naming the function."""

import pytest


def test_any_name_imports_and_every_call_raises_naming_itself():
    from sgl_kernel import copy_all_layer_kv_cache_cpu  # what sglang's CPU engine imports at module level

    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        copy_all_layer_kv_cache_cpu()


def test_stand_in_is_the_module_sglang_sees():
    import sgl_kernel

    assert "cpu_shim" in sgl_kernel.__file__
    with pytest.raises(AttributeError):
        sgl_kernel.__wrapped_module__  # dunder lookups must not be faked (pickle, inspect, import machinery)
