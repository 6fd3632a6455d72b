"""Import-only stand-in for ``sgl_kernel`` on CPUs without AMX (CPU test runs only).

Why: with ``SGLANG_USE_CPU_ENGINE=1`` stock sglang 0.5.23 does module-level
``from sgl_kernel import <name>_cpu`` in a few places (KV-cache copy, allocator,
speculative decoding). PyPI has no CPU build of sgl-kernel; the source build
needs AVX-512/AMX, which CI machines lack. On the ``torch_native`` path none of
these functions is ever called, so importing is all that is needed.

Every attribute is a function that raises ``NotImplementedError`` naming itself,
so an unexpected call fails loudly instead of computing anything.

When it can go: once sglang imports these kernels lazily on the CPU path, or a
CPU sgl-kernel wheel for plain AVX2 exists on PyPI. Never put this directory on
``PYTHONPATH`` on an NPU or CUDA machine.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_available(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is the import-only CPU stand-in "
            "(cpu_shim/sgl_kernel); the torch_native path should never reach it"
        )

    _not_available.__name__ = name
    return _not_available
