#!/usr/bin/env bash
# `make gpu-prepare`: everything `make gpu-check` and `make gpu-anchors` need on the GPU
# machine, which fetches nothing, into .gpu/ (ignored by git; name it in the device tool's
# `carry`): the anchor script (bench/gpu/anchors_gpu.py), PyCUDA's sdist (PyPI
# has no wheel) and the pure-Python packages it needs, lark (flowc's DSL parser) and
# siphash24 (needed by pytools) as wheels for that machine's Python 3.12 on x86-64. The
# machine already has numpy, setuptools, markupsafe, typing-extensions, torch,
# transformers, onnx, onnxruntime and CuPy (/work/.library/device/KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu
mkdir -p "$out/wheels" "$out/sdist"

cp bench/gpu/anchors_gpu.py "$out/anchors_gpu.py"

PY=${PYTHON:-python3}
# Pinned so that one version of each travels (two would stop the install there).
PYCUDA=pycuda==2026.1
WHEELS="lark==1.3.1 pytools==2026.1.1 platformdirs==4.14.9 mako==1.4.3 siphash24==1.9"
have() { ls "$out/$1" 2>/dev/null | grep -qi "^$2"; }

if ! have sdist pycuda-2026.1; then
  # An sdist only; pip prepares its metadata with PyPI's build requirements (numpy, ...).
  "$PY" -m pip download -q --no-deps --no-binary pycuda -d "$out/sdist" "$PYCUDA"
fi
for spec in $WHEELS; do
  name=${spec%%==*}
  version=${spec##*==}
  if have wheels "${name}-${version}-"; then continue; fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/wheels" "$spec"
done
echo "prepared $out/:"
ls -1 "$out" "$out/wheels" "$out/sdist" | sed 's/^/  /'
du -sh "$out" | sed 's/^/  total /'
