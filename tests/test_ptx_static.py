"""Static checks of the CUDA code generated for every shared model, no GPU needed: nvcc
compiles model.cu to PTX for sm_90 as the project's CMake build does (same include folders,
Release's -O3 -DNDEBUG), ptxas assembles it with its resource report, and

- no kernel spills registers to local memory (0 bytes of spill stores and loads);
- the softmax and layer-norm kernels reduce with warp shuffles (shfl.sync in their PTX);
- element-wise kernels whose operands all have the output's shape and 4-byte elements use
  128-bit global loads (ld.global[.nc].v4) and stores;
- nvcc gives no warning.

One compile per model, shared by the checks (module-scoped), the models two at a time."""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS

from flowc.compiler import compile_graph
from flowc.frontend.onnx import ImportOptions, import_onnx
from flowc.passes.manager import COMPILE_PIPELINE, PassManager
from flowc.toolchain import find_cuda

MODELS = ["mlp", "resnet_tiny", "bert_tiny", "gpt2_tiny", "vit_tiny"]
ARCH = "90"

# Kernels (by their template macro, the name after k<N>_) that must reduce with shuffles.
SHUFFLING = ("softmax_rows", "normalize")
ELEMENTWISE = ("elementwise", "fused")


@dataclass
class Kernel:
    name: str  # as in model.cu: k<N>_<macro>
    source: str  # its C++ text in model.cu
    ptx: str  # its PTX body
    spill_stores: int
    spill_loads: int

    @property
    def macro(self) -> str:
        return self.name.split("_", 1)[1]


@dataclass
class Built:
    kernels: dict[str, Kernel]
    nvcc_output: str


def _kernel_sources(model_cu: str) -> dict[str, str]:
    """Each kernel's text: from its `static __global__ void kN_...(` to the next kernel."""
    starts = [
        (m.start(), m.group(1))
        for m in re.finditer(r"static __global__ void (k\d+_\w+)\(", model_cu)
    ]
    return {
        name: model_cu[at : starts[i + 1][0] if i + 1 < len(starts) else len(model_cu)]
        for i, (at, name) in enumerate(starts)
    }


def _ptx_entries(ptx: str) -> dict[str, str]:
    """Mangled entry name -> its PTX body."""
    out = {}
    for m in re.finditer(r"\.entry\s+([\w$]+)\(", ptx):
        end = ptx.find("\n}\n", m.end())
        out[m.group(1)] = ptx[m.start() : end if end >= 0 else len(ptx)]
    return out


def _spills(ptxas_log: str) -> dict[str, tuple[int, int]]:
    """Mangled function name -> (spill store bytes, spill load bytes) from ptxas -v."""
    pattern = re.compile(
        r"Function properties for ([\w$]+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill "
        r"stores, (\d+) bytes spill loads"
    )
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in pattern.finditer(ptxas_log)}


def _build(name: str, root: Path) -> Built:
    tk = find_cuda()
    assert tk.nvcc is not None
    io = np.load(SHARED_MODELS / f"{name}.io.npz")
    shapes = {k[3:]: io[k].shape for k in io.files if k.startswith("in:")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = import_onnx(SHARED_MODELS / f"{name}.onnx", ImportOptions(shapes=shapes))
    out = root / name
    compile_graph(PassManager(COMPILE_PIPELINE).run(graph), out, prefix=name, arch=ARCH)
    # What flowc.cmake gives nvcc: the project folder (model.h, flowc/) and the libraries'
    # include folders; Release flags.
    includes = ["-I", str(out)]
    for lib in ("cublasLt", "cudnn"):
        includes += ["-I", str(tk.libs[lib].include_dir)]
    ptx_path, cubin = out / "model.ptx", out / "model.cubin"
    flags = ["-std=c++17", f"-arch=sm_{ARCH}", "-O3", "-DNDEBUG", *includes]
    nvcc = subprocess.run(
        [str(tk.nvcc), *flags, "-ptx", str(out / "model.cu"), "-o", str(ptx_path)],
        capture_output=True,
        text=True,
    )
    assert nvcc.returncode == 0, f"{name}: nvcc -ptx failed:\n{nvcc.stderr[-3000:]}"
    ptxas = subprocess.run(
        [
            str(Path(tk.nvcc).parent / "ptxas"),
            f"-arch=sm_{ARCH}",
            "-v",
            str(ptx_path),
            "-o",
            str(cubin),
        ],
        capture_output=True,
        text=True,
    )
    assert ptxas.returncode == 0, f"{name}: ptxas failed:\n{ptxas.stderr[-3000:]}"
    entries = _ptx_entries(ptx_path.read_text())
    spills = _spills(ptxas.stdout + ptxas.stderr)
    kernels = {}
    for kname, source in _kernel_sources((out / "model.cu").read_text()).items():
        # Static kernels are mangled inside the file's anonymous namespace: <len><name>E.
        mangled = [e for e in entries if f"{len(kname)}{kname}E" in e]
        assert len(mangled) == 1, f"{name}: kernel {kname} is not one PTX entry: {mangled}"
        assert mangled[0] in spills, f"{name}: ptxas reported nothing for {kname}"
        stores, loads = spills[mangled[0]]
        kernels[kname] = Kernel(kname, source, entries[mangled[0]], stores, loads)
    return Built(kernels, nvcc.stdout + nvcc.stderr)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    missing = find_cuda().missing(["cublasLt", "cudnn"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the generated PTX is not checked")
    root = tmp_path_factory.mktemp("ptx")
    # nvcc is mostly single-threaded: two models at a time on the two cores.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda n: _build(n, root), MODELS))
    return dict(zip(MODELS, results, strict=True))


def test_no_register_spills(built: dict[str, Built]) -> None:
    spilling = [
        f"{model}: {k.name} ({k.spill_stores} B stored, {k.spill_loads} B loaded)"
        for model, b in built.items()
        for k in b.kernels.values()
        if k.spill_stores or k.spill_loads
    ]
    assert sum(len(b.kernels) for b in built.values()) > 0
    assert not spilling, "kernels spill registers:\n" + "\n".join(spilling)


def test_nvcc_gives_no_warning(built: dict[str, Built]) -> None:
    for model, b in built.items():
        assert "warning" not in b.nvcc_output.lower(), f"{model}:\n{b.nvcc_output}"


def test_softmax_and_layer_norm_use_warp_shuffles(built: dict[str, Built]) -> None:
    checked = []
    for model, b in built.items():
        for k in b.kernels.values():
            if k.macro in SHUFFLING:
                assert "shfl.sync" in k.ptx, f"{model}: {k.name} has no warp shuffle"
                # A row is combined with one barrier at most (wider than a warp), not a tree
                # of them.
                assert k.ptx.count("bar.sync") <= 1, f"{model}: {k.name} has several barriers"
                checked.append(k.macro)
    # The transformers' layer norms and the MLP's softmax at least.
    assert "normalize" in checked and "softmax_rows" in checked, checked


def _eligible_for_vectors(source: str) -> bool:
    """An element-wise kernel whose operands all have the output's shape (read at the flat
    index, no broadcast coordinates) and 4-byte elements: its pointers all float, int32 or
    uint32."""
    params = source[: source.index("{")]
    pointer_types = re.findall(r"(\w+)\*", params)
    four_bytes = {"float", "int32_t", "uint32_t"}
    return bool(pointer_types) and set(pointer_types) <= four_bytes and "c0" not in source


def test_elementwise_kernels_use_128_bit_loads(built: dict[str, Built]) -> None:
    eligible = 0
    for model, b in built.items():
        for k in b.kernels.values():
            if k.macro not in ELEMENTWISE or not _eligible_for_vectors(k.source):
                continue
            eligible += 1
            assert re.search(r"ld\.global(\.nc)?\.v4\.(f32|b32|u32|s32)", k.ptx), (
                f"{model}: {k.name} has no 128-bit load"
            )
            assert re.search(r"st\.global\.v4\.(f32|b32|u32|s32)", k.ptx), (
                f"{model}: {k.name} has no 128-bit store"
            )
    assert eligible > 0
