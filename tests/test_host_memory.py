"""glibc's malloc thresholds pinned in the server's processes (``mossvl_ascend.host_memory``), checked through
glibc's own behaviour: with the dynamic threshold, a 4 MiB block freed raises the threshold, so the next 4 MiB
block comes from the heap (no mapping of its own: ``mallinfo2().hblks`` does not grow); pinned, it gets a mapping of
its own again, returned when it is freed. Each case runs in a fresh interpreter (a fresh malloc state)."""

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from mossvl_ascend.host_memory import pin_malloc_thresholds

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.mallinfo2.restype = MallInfo2
    pinned = pin_malloc_thresholds() if sys.argv[1] == "pin" else None
    size = 4 << 20
    libc.free(libc.malloc(size))  # a mapped block freed: glibc's dynamic threshold rises to its size
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    mapped = libc.mallinfo2().hblks - before
    libc.free(block)
    print(pinned, mapped, libc.mallinfo2().hblks - before)
    """
)


def probe(mode: str, **env) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environment, timeout=60, check=True
    )
    return done.stdout.split()


def test_pinned_thresholds_give_a_large_block_its_own_mapping_again():
    assert probe("stock") == ["None", "0", "0"], "glibc's dynamic threshold: the second block comes from the heap"
    assert probe("pin") == ["True", "1", "0"], "pinned: the block is mapped, and unmapped when freed"


def test_a_threshold_set_in_the_environment_is_left_as_set():
    pinned, mapped, _ = probe("pin", MALLOC_MMAP_THRESHOLD_="8388608")
    assert pinned == "False" and mapped == "0", "the user's 8 MiB threshold serves the 4 MiB block from the heap"
