"""Compilers and libraries for generated C++: g++ for the host target, nvcc and the CUDA
libraries (cuBLASLt, cuDNN, NCCL) for the GPU target.

CUDA libraries come from a system toolkit or, failing that, from NVIDIA's Python wheels
(nvidia-cublas, nvidia-cudnn-cu13, nvidia-nccl-cu13), which ship only versioned file names
(libcublasLt.so.13): those are linked by full name with an RPATH to their directory.
"""

from __future__ import annotations

import glob
import os
import shutil
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flowc.resources import runtime_dir

HOST_FLAGS = ["-std=c++17", "-O2", "-fopenmp", "-Wall", "-Wextra", "-DFLOWC_HOST"]
HOST_LIBS = ["-lboost_context", "-lopenblas", "-lpthread"]
CUDA_ARCH = "sm_90"

# library -> (header, wheel package directory under site-packages/nvidia)
CUDA_LIBS = {
    "cublasLt": ("cublasLt.h", "cublas"),
    "cudnn": ("cudnn.h", "cudnn"),
    "nccl": ("nccl.h", "nccl"),
}


@dataclass
class CudaLib:
    name: str
    include_dir: Path
    lib_dir: Path
    file: str  # the file linked: libX.so, or a versioned name from a wheel

    def link_flags(self) -> list[str]:
        flag = f"-l{self.name}" if self.file == f"lib{self.name}.so" else f"-l:{self.file}"
        return [f"-L{self.lib_dir}", flag, f"-Xlinker=-rpath={self.lib_dir}"]


@dataclass
class CudaToolkit:
    nvcc: Path | None
    libs: dict[str, CudaLib] = field(default_factory=dict)

    def missing(self, names: list[str]) -> list[str]:
        out = [] if self.nvcc else ["nvcc"]
        return out + [n for n in names if n not in self.libs]


def _cuda_homes() -> list[Path]:
    homes = [Path(p) for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if p]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(Path(nvcc).resolve().parent.parent)
    homes += [Path("/usr/local/cuda"), *sorted(Path(p) for p in glob.glob("/usr/local/cuda-*"))]
    return list(dict.fromkeys(h for h in homes if h.is_dir()))


def _wheel_roots() -> list[Path]:
    roots = [Path(p) / "nvidia" for p in [*site.getsitepackages(), site.getusersitepackages()]]
    roots += [Path(p) / "nvidia" for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(r for r in roots if r.is_dir()))


def _find_lib(name: str, header: str, wheel_dir: str) -> CudaLib | None:
    system_libdirs = [
        h / sub for h in _cuda_homes() for sub in ("lib64", "lib", "targets/x86_64-linux/lib")
    ]
    system_libdirs += [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")]
    system_incdirs = [
        h / sub for h in _cuda_homes() for sub in ("include", "targets/x86_64-linux/include")
    ]
    system_incdirs += [Path("/usr/include"), Path("/usr/include/x86_64-linux-gnu")]
    inc = next((d for d in system_incdirs if (d / header).is_file()), None)
    lib = next((d for d in system_libdirs if (d / f"lib{name}.so").exists()), None)
    if inc and lib:
        return CudaLib(name, inc, lib, f"lib{name}.so")
    for root in _wheel_roots():
        # CUDA 13's toolkit wheels (nvidia-cublas 13, as PyTorch's cu13 builds pull in)
        # install into nvidia/cu13/ rather than a folder per library.
        for sub in (wheel_dir, "cu13"):
            winc, wlib = root / sub / "include", root / sub / "lib"
            versioned = sorted(wlib.glob(f"lib{name}.so*"))
            if (winc / header).is_file() and versioned:
                return CudaLib(name, winc, wlib, versioned[0].name)
    return None


def find_cuda() -> CudaToolkit:
    nvcc_path = shutil.which("nvcc")
    if nvcc_path is None:
        nvcc_path = next(
            (str(h / "bin" / "nvcc") for h in _cuda_homes() if (h / "bin" / "nvcc").is_file()), None
        )
    tk = CudaToolkit(Path(nvcc_path) if nvcc_path else None)
    for name, (header, wheel_dir) in CUDA_LIBS.items():
        found = _find_lib(name, header, wheel_dir)
        if found is not None:
            tk.libs[name] = found
    return tk


def cudart_library() -> str:
    """The CUDA runtime's shared library, for the Python API's copies to and from a model's
    device buffers: the toolkit's libcudart.so, else the name for the loader to find."""
    for home in _cuda_homes():
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            found = sorted((home / sub).glob("libcudart.so*"))
            if found:
                return str(found[0])
    return "libcudart.so"


def gpu_count() -> int:
    """How many CUDA devices this machine's driver reports (0 without a driver or a GPU).

    Asks the driver itself (libcuda's cuInit / cuDeviceGetCount) in a child process, so a
    broken driver cannot take flowc down and the answer does not depend on nvidia-smi being
    on PATH. FLOWC_GPU_COUNT overrides it (tests use it to act as a machine with or
    without a GPU)."""
    forced = os.environ.get("FLOWC_GPU_COUNT")
    if forced is not None and forced.strip().isdigit():
        return int(forced)
    probe = (
        "import ctypes,sys\n"
        "try:\n"
        " c=ctypes.CDLL('libcuda.so.1')\n"
        "except OSError:\n"
        " sys.exit(0)\n"
        "n=ctypes.c_int(0)\n"
        "if c.cuInit(0)==0 and c.cuDeviceGetCount(ctypes.byref(n))==0:\n"
        " print(n.value)\n"
    )
    import subprocess

    try:
        r = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    text = r.stdout.strip()
    return int(text) if text.isdigit() else 0


def default_target(recorded: str | None = None) -> tuple[str, str]:
    """The target every command (compile, build, run, verify, the Python API) uses when none
    is given, and why, by one rule: the project's recorded target (``flowc compile
    --target``) where it has one, else cuda where a GPU is present, else host. A machine with
    nvcc and no GPU builds for the host, so that what `flowc build` makes is what `flowc run`
    runs; the CUDA build is asked for by name."""
    if recorded is not None:
        return recorded, f"the project was compiled with --target {recorded}"
    return ("cuda", "a GPU is present") if gpu_count() > 0 else ("host", "no GPU found")


def host_compile_command(
    sources: list[Path], out: Path, *, extra: list[str] | None = None
) -> list[str]:
    cmd = ["g++", *HOST_FLAGS, "-I", str(runtime_dir())]
    for s in sources:
        cmd += ["-x", "c++", str(s)]
    return [*cmd, "-x", "none", "-o", str(out), *HOST_LIBS, *(extra or [])]


def cuda_compile_command(
    tk: CudaToolkit, sources: list[Path], out: Path, *, libs: list[str], arch: str = CUDA_ARCH
) -> list[str]:
    if tk.nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    cmd = [
        str(tk.nvcc),
        "-std=c++17",
        f"-arch={arch}",
        "-O2",
        "-Xcompiler=-Wall",
        "-I",
        str(runtime_dir()),
    ]
    for name in libs:
        cmd += ["-I", str(tk.libs[name].include_dir)]
    for s in sources:
        cmd += ["-x", "cu", str(s)]
    cmd += ["-o", str(out)]
    for name in libs:
        cmd += tk.libs[name].link_flags()
    return cmd


WHEELS = {"cublasLt": "nvidia-cublas", "cudnn": "nvidia-cudnn-cu13", "nccl": "nvidia-nccl-cu13"}


def main(argv: list[str]) -> int:
    """`python -m flowc.toolchain [wheels]`: report what was found; with `wheels`, print the pip
    packages that would supply the missing CUDA libraries (used by `make setup`)."""
    tk = find_cuda()
    if argv[:1] == ["wheels"]:
        print(" ".join(WHEELS[n] for n in CUDA_LIBS if n not in tk.libs))
        return 0
    print(f"nvcc: {tk.nvcc or 'not found'}")
    for name in CUDA_LIBS:
        lib = tk.libs.get(name)
        print(f"{name}: {lib.lib_dir / lib.file if lib else 'not found'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
