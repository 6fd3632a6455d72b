"""The pinned dependency files agree with the sglang 0.5.23 wheel's own metadata.

Oracle: ``importlib.metadata.requires("sglang")`` of the installed, pinned wheel.
"""

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import requires, version
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[1]

# sglang requirements that exist only for CUDA (or pin a torch the NPU/CPU stacks cannot use); they must not be
# installed on NPU. Every other runtime requirement must be covered.
CUDA_ONLY = {
    canonicalize_name(n)
    for n in (
        "sglang-kernel",
        "flashinfer_python",
        "flash-attn-4",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "cuda-python",
        "tilelang",
        "quack-kernels",
        "humming-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "torch_memory_saver",
        "kernels",
    )
}
# Pinned by sglang to builds that drag in another torch; replaced on purpose (video decoding uses PyAV).
REPLACED = {canonicalize_name(n) for n in ("torchaudio", "torchcodec", "torch", "torchvision")}
FORBIDDEN_PREFIXES = ("nvidia-", "flashinfer", "flash-attn", "sgl-deep", "sglang-kernel", "cutlass", "deep-ep")
# Pure-Python NVML bindings that sglang imports unconditionally; no CUDA library comes with it.
ALLOWED_NVIDIA = {"nvidia-ml-py"}


def read_requirements(path: Path) -> dict[str, Requirement]:
    """Parse a pip requirements file, following ``-r`` includes; ignores options and local paths."""
    found: dict[str, Requirement] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("--", "./")):
            continue
        if line.startswith("-r "):
            found.update(read_requirements(path.parent / line[3:].strip()))
            continue
        req = Requirement(line)
        found[canonicalize_name(req.name)] = req
    return found


def sglang_runtime_requirements() -> dict[str, Requirement]:
    env = default_environment()
    env["extra"] = ""
    reqs = (Requirement(r) for r in requires("sglang"))
    return {canonicalize_name(r.name): r for r in reqs if r.marker is None or r.marker.evaluate(env)}


def test_installed_sglang_is_the_pinned_release():
    assert version("sglang") == "0.5.23"


def test_npu_closure_covers_every_non_cuda_runtime_dependency():
    npu = read_requirements(REPO_ROOT / "requirements-npu.txt")
    missing = set(sglang_runtime_requirements()) - CUDA_ONLY - REPLACED - set(npu)
    assert not missing, f"requirements-npu.txt lacks sglang runtime deps: {sorted(missing)}"


def test_npu_closure_pins_agree_with_sglang():
    npu = read_requirements(REPO_ROOT / "requirements-npu.txt")
    for name, wanted in sglang_runtime_requirements().items():
        if name in CUDA_ONLY or name in REPLACED:
            continue
        pinned = npu[name]
        assert str(pinned.specifier).startswith("=="), f"{name} is not pinned exactly: {pinned}"
        pinned_version = str(pinned.specifier)[2:]
        assert wanted.specifier.contains(pinned_version, prereleases=True), (
            f"{name}: sglang wants {wanted.specifier}, requirements pin {pinned_version}"
        )


def test_npu_closure_has_no_cuda_only_package():
    npu = read_requirements(REPO_ROOT / "requirements-npu.txt")
    assert not set(npu) & CUDA_ONLY
    assert not [n for n in npu if n.startswith(FORBIDDEN_PREFIXES) and n not in ALLOWED_NVIDIA]


def test_torch_and_torch_npu_agree():
    npu = read_requirements(REPO_ROOT / "requirements-npu.txt")
    torch_version = str(npu["torch"].specifier).removeprefix("==")
    torch_npu_version = str(npu["torch-npu"].specifier).removeprefix("==")
    assert torch_version.split(".")[:3] == torch_npu_version.split(".")[:3], (torch_version, torch_npu_version)
    assert npu["torchvision"].specifier.contains("0.29.0")
    assert "transformers" in npu and npu["transformers"].specifier.contains(version("transformers"))


def test_cpu_environment_installs_no_cuda_only_package():
    from importlib.metadata import distributions

    installed = {canonicalize_name(d.metadata["Name"]) for d in distributions()}
    assert not installed & CUDA_ONLY, sorted(installed & CUDA_ONLY)


def test_the_plugin_wheel_ships_every_module(tmp_path):
    """`pip install ./sglang` (the NPU closure) installs a wheel, not the CPU venv's editable tree: every module of
    the package, subpackages included, must be in it (an explicit package list once left attention/ out)."""
    plugin = REPO_ROOT / "sglang"
    # Built from a copy: setuptools leaves build/ and *.egg-info next to the sources it builds.
    source_copy, wheels = tmp_path / "plugin", tmp_path / "wheels"
    shutil.copytree(plugin, source_copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*pip_wheel, str(source_copy)], check=True)
    (wheel,) = wheels.glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    source = {path.relative_to(plugin).as_posix() for path in (plugin / "mossvl_ascend").rglob("*.py")}
    assert source <= shipped, sorted(source - shipped)
    # the MOSS-VL processor (our checkpoints' remote code and the fallback for published ones) ships in it
    assert "mossvl_ascend/processor/__init__.py" in shipped and "mossvl_ascend/processor/video.py" in shipped


# Run in a fresh interpreter: decode a video, then name any of these modules that got imported.
PROCESSOR_ALONE = """
import sys
from mossvl_ascend.processor import MossVLImageProcessor
media = MossVLImageProcessor(video_size={"shortest_edge": 1024, "longest_edge": 4096})
(patches, grid), = media.videos(media.sample_videos([sys.argv[1]]))
print(grid, sorted({m.split(".")[0] for m in sys.modules} & {"torchcodec", "joblib", "sglang"}))
"""


def test_the_processor_decodes_video_with_pyav_alone():
    """The processor needs neither torchcodec nor joblib (the published checkpoints' video code imports both) nor
    sglang; ``av`` is pinned for it in the NPU closure."""
    assert canonicalize_name("av") in read_requirements(REPO_ROOT / "requirements-npu.txt")
    video = REPO_ROOT / "tests" / "assets" / "moving_square_3s.mp4"
    env = {"PYTHONPATH": str(REPO_ROOT / "sglang"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", PROCESSOR_ALONE, str(video)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # 3 frames at 1 fps, 48x64 -> 32x32 (no video_max_pixels: the whole volume capped at 4096), nothing imported
    assert result.stdout.split() == ["[3,", "2,", "2]", "[]"]
