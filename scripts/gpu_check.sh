#!/usr/bin/env bash
# The GPU check, for a one-GPU machine with Python 3.12 and torch but no megatron-core and no
# network: install megatron-ext from a wheelhouse built beforehand (scripts/build_wheelhouse.sh),
# run the gpu-marked tests and the mHC layer benchmark, and write a JSON summary.
#
#   scripts/gpu_check.sh [WHEELHOUSE=wheelhouse] [SUMMARY=gpu_check.json]
#
# Run it from the repository root of a copy of this project (tests/, recipes/, bench/).
# Environment: PYTHON (default python3), GPU_CHECK_DIR (scratch, default a temp dir).
# Exit status: 0 when the install, doctor and every gpu test passed; the summary is written either way.
set -uo pipefail
cd "$(dirname "$0")/.."
wheelhouse="$(realpath "${1:-wheelhouse}")"
summary="$(realpath -m "${2:-gpu_check.json}")"
PY="${PYTHON:-python3}"
scratch="${GPU_CHECK_DIR:-$(mktemp -d)}"
mkdir -p "$scratch"
log() { echo "[gpu-check] $*"; }

# 1. A venv that sees the machine's torch (system site-packages) and installs the rest offline.
log "installing megatron-ext from $wheelhouse into $scratch/venv"
"$PY" -m venv --system-site-packages --without-pip "$scratch/venv"
venv_py="$scratch/venv/bin/python"
# When $PY is itself a venv's python (the GPU image's /opt/torch/.venv), --system-site-packages
# reaches the base interpreter's packages, not that venv's torch: a .pth adds $PY's own
# site-packages after the new venv's, so torch is found and our wheels still come first.
"$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
  > "$("$venv_py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz_parent_site.pth"
"$PY" -m pip --python "$venv_py" install --no-index --find-links "$wheelhouse" megatron-ext pytest \
  > "$scratch/install.log" 2>&1
install_rc=$?
tail -3 "$scratch/install.log"

# 2. doctor, the gpu tests (JUnit XML for the counts), the layer benchmark.
doctor_rc=1 tests_rc=1 bench_rc=1
if [ "$install_rc" -eq 0 ]; then
  log "megatron-ext doctor"
  "$scratch/venv/bin/megatron-ext" doctor > "$scratch/doctor.txt" 2>&1; doctor_rc=$?
  head -12 "$scratch/doctor.txt"
  log "gpu tests"
  "$venv_py" -m pytest -m gpu tests/gpu -v -rs --junitxml "$scratch/gpu_tests.xml" 2>&1 | tee "$scratch/gpu_tests.txt"
  tests_rc=${PIPESTATUS[0]}
  # The issue's GPU figure: one layer at h=4096 s=4096 b=1 bf16 n=4, plain vs mHC native vs mHC
  # fused (Triton kernels, use_fused_mhc), side by side.
  bench=("$venv_py" bench/mhc_layer.py --device cuda --dtype bf16 --hidden 4096 --seq 4096 --batch 1 --heads 32 --fused)
  log "benchmark: ${bench[*]}"
  "${bench[@]}" > "$scratch/bench.txt" 2>&1; bench_rc=$?
  tail -20 "$scratch/bench.txt"
fi

# 3. The summary.
"$PY" - "$summary" "$scratch" "$install_rc" "$doctor_rc" "$tests_rc" "$bench_rc" "${bench[*]:-}" <<'PY'
import json, sys, platform, subprocess, xml.etree.ElementTree as ET
from pathlib import Path

out, scratch, install_rc, doctor_rc, tests_rc, bench_rc, bench = sys.argv[1:8]
scratch = Path(scratch)

def text(name, tail=None):
    path = scratch / name
    if not path.exists():
        return None
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-tail:] if tail else lines)

tests = {}
if (scratch / "gpu_tests.xml").exists():
    for case in ET.parse(scratch / "gpu_tests.xml").iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                tests[f"{case.get('classname')}::{case.get('name')}"] = {
                    "outcome": outcome, "seconds": float(case.get("time", 0)),
                    "message": (child.get("message") or "")[:2000]}
                break
        else:
            tests[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": outcome, "seconds": float(case.get("time", 0))}
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
except Exception as exc:
    gpu = f"nvidia-smi failed: {exc}"
counts = {k: sum(1 for t in tests.values() if t["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
summary = {
    "python": platform.python_version(), "gpu": gpu,
    "install": {"rc": int(install_rc), "log_tail": text("install.log", 15)},
    "doctor": {"rc": int(doctor_rc), "report": text("doctor.txt", 40)},
    "gpu_tests": {"rc": int(tests_rc), "counts": counts, "tests": tests},
    "benchmark": {"command": bench, "rc": int(bench_rc), "output_tail": text("bench.txt", 40)},
    "ok": int(install_rc) == 0 and int(doctor_rc) == 0 and int(tests_rc) == 0 and counts["passed"] > 0,
}
Path(out).write_text(json.dumps(summary, indent=2) + "\n")
print(f"[gpu-check] summary {out}: ok={summary['ok']} tests={counts}")
sys.exit(0 if summary["ok"] else 1)
PY
