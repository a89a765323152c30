#!/usr/bin/env bash
# Install megatron-ext as a user would, beside a megatron-core that is already installed, and
# check that pip kept that megatron-core (and torch) instead of replacing or re-resolving them.
#
#   scripts/check_wheel_install.sh [PYTHON]      (default: .venv/bin/python; part of `make test`)
#
# The "user's environment" is a fresh virtualenv whose site-packages also sees the project
# venv's (a .pth line), so megatron-core 0.19.2 and torch are already there and nothing is
# downloaded. pip runs with --no-index: any dependency it wanted to fetch would fail the step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

step() { echo "[wheel-install] $*"; }
fail() { echo "[wheel-install] FAIL: $*" >&2; exit 1; }

step "building the wheel"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w "$work/dist" . >/dev/null
wheel="$(ls "$work"/dist/megatron_ext-*.whl)"
step "built $(basename "$wheel")"

step "a user's environment with megatron-core already installed"
"$PY" -m venv --without-pip "$work/env"
user_py="$work/env/bin/python"
user_site="$("$user_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
project_site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$project_site" > "$user_site/_existing_packages.pth"
core_before="$("$user_py" -c 'import importlib.metadata as m; d = m.distribution("megatron-core"); print(d.version, d.locate_file(""))')"

step "pip install $(basename "$wheel") (no index: nothing may be downloaded)"
"$PY" -m pip --python "$user_py" install --no-index --no-build-isolation "$wheel" > "$work/pip.log" 2>&1 \
  || { cat "$work/pip.log"; fail "pip could not install the wheel from what is installed"; }
grep -E "^Successfully installed" "$work/pip.log"
grep -qiE "^(Collecting|Downloading).*(megatron[-_]core|torch)" "$work/pip.log" \
  && fail "pip re-resolved megatron-core or torch"
grep -iE "^Installing collected packages:" "$work/pip.log" | grep -qiE "megatron[-_]core|torch" \
  && fail "pip replaced megatron-core or torch"

installed="$(ls "$user_site" | grep -iE '\.dist-info$' || true)"
[ "$installed" = "megatron_ext-$(basename "$wheel" | cut -d- -f2).dist-info" ] \
  || fail "expected only megatron-ext in the user's site-packages, found: $installed"
core_after="$("$user_py" -c 'import importlib.metadata as m; d = m.distribution("megatron-core"); print(d.version, d.locate_file(""))')"
[ "$core_before" = "$core_after" ] || fail "megatron-core changed: $core_before -> $core_after"
step "megatron-core kept: $core_after"

step "megatron-ext doctor from the wheel"
(cd "$work" && env -u PYTHONPATH "$user_py" - "$user_site" <<'PY') || fail "the wheel's megatron_ext is not the one imported"
import sys, megatron_ext
assert megatron_ext.__file__.startswith(sys.argv[1]), megatron_ext.__file__
PY
(cd "$work" && env -u PYTHONPATH "$work/env/bin/megatron-ext" doctor > "$work/doctor.txt" 2>&1) \
  || { cat "$work/doctor.txt"; fail "megatron-ext doctor failed"; }
grep -E "^megatron-core " "$work/doctor.txt"
grep -qE "^megatron-core +0\.19\.2" "$work/doctor.txt" || fail "doctor does not report megatron-core 0.19.2"

step "the shipped recipes and golden values from the wheel"
(cd "$work" && env -u PYTHONPATH "$work/env/bin/megatron-ext" recipes --copy gpt_tp2_pp2 "$work/copied" --with-golden > "$work/recipes.txt" 2>&1) \
  || { cat "$work/recipes.txt"; fail "megatron-ext recipes --copy failed"; }
grep -q "_recipes" <(cd "$work" && env -u PYTHONPATH "$work/env/bin/megatron-ext" recipes) \
  || fail "the recipes listed are not the wheel's package data"
[ -f "$work/copied/golden/gpt_tp2_pp2/golden_values_cpu.json" ] || fail "no golden values shipped"
step "OK"
