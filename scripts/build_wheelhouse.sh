#!/usr/bin/env bash
# Build the wheelhouse that scripts/gpu_check.sh installs from on a GPU machine without network:
# megatron-ext's wheel plus megatron-core and every small dependency, at the versions of the
# project's venv (the tested set). torch is not in it: the GPU machine brings its own.
#
#   scripts/build_wheelhouse.sh [OUT_DIR=wheelhouse] [PYTHON=.venv/bin/python]    (make wheelhouse)
#
# Fails if the result exceeds 64 MiB (what a device run can carry).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-wheelhouse}"
PY="${2:-.venv/bin/python}"
limit_mib=64

# The packages megatron-ext and its GPU tests need beyond torch, pinned to the venv's versions.
packages=(megatron-core numpy packaging psutil pyyaml pytest iniconfig pluggy
          matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil tzdata)
pins=()
for name in "${packages[@]}"; do
  version="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
  pins+=("$name==$version")
done

rm -rf "$out" && mkdir -p "$out"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w "$out" .
# Binary wheels for this interpreter's platform (the GPU machine runs CPython 3.12 on x86_64).
"$PY" -m pip download --quiet --no-deps --only-binary :all: -d "$out" "${pins[@]}" 2> >(grep -v "is ignored" >&2)

size_kib="$(du -sk "$out" | cut -f1)"
echo "[wheelhouse] $out: $(ls "$out" | wc -l) wheels, $((size_kib / 1024)) MiB (limit ${limit_mib} MiB)"
ls "$out"
[ "$size_kib" -le $((limit_mib * 1024)) ] || { echo "[wheelhouse] FAIL: larger than ${limit_mib} MiB" >&2; exit 1; }
