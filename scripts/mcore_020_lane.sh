#!/usr/bin/env bash
# The megatron-core 0.20 lane: megatron-ext's tests on a 0.20 wheel, beside the 0.19.2 of .venv.
#
#   scripts/mcore_020_lane.sh env        build .venv-mcore-0.20/ (once per wheel and setup.py)
#   scripts/mcore_020_lane.sh unit       the single-process unit session there (the tests that
#                                        meet megatron-core: MEGATRON_FACING_TESTS below)
#   scripts/mcore_020_lane.sh 2ranks     the 2-rank unit session (torchrun)
#   scripts/mcore_020_lane.sh 4ranks     the 4-rank unit session
#   scripts/mcore_020_lane.sh recipes    four recipes against their golden values
#   scripts/mcore_020_lane.sh soak       every shipped recipe and the upstream-checkpoint move
#
# To save time make test runs lighter forms of three steps (make test-mcore-0.20
# and the soak step run them whole):
#   2ranks|4ranks --one-case-per-test    each test function's first parametrized case (the cases
#                                        after it vary megatron-ext's own maps and layouts, which
#                                        the 0.19.2 sessions run whole)
#   recipes --once                       each recipe trained once against its golden values,
#                                        without its ckpt-resume half
#
# The wheel: MEGATRON_CORE_WHEEL (a .whl, or a folder holding one), default the shared
# megatron-core-0.20-mhc-pp build (Megatron-LM #4946: native mHC with pipeline parallelism).
# Without one every step prints one line and succeeds, so the rest of `make test` runs on 0.19.2.
#
# .venv-mcore-0.20/ is a virtualenv whose site-packages holds only the 0.20 wheel and megatron-ext
# (editable); a .pth line after them adds .venv's site-packages, so torch and every other package
# come from .venv (nothing is downloaded) while the 0.20 megatron-core shadows 0.19.2. `env`
# checks which megatron-core that interpreter imports.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=.venv-mcore-0.20
PY="$ENV_DIR/bin/python"
BASE_PY=.venv/bin/python
DEFAULT_WHEEL_DIR=../shared/wheels/megatron-core-0.20-mhc-pp
LANE_RECIPES=gpt_mhc_tp2_pp2_sp,gpt_mhc_pp4_vpp2,gpt_mhc_single_pass_pp2_vpp2,hybrid_mhc_tp2_pp2_mtp
say() { echo "[mcore-0.20] $*"; }

find_wheel() {
  local given="${MEGATRON_CORE_WHEEL:-$DEFAULT_WHEEL_DIR}"
  if [ -d "$given" ]; then
    given="$(ls "$given"/megatron_core-0.20*.whl 2>/dev/null | head -n 1 || true)"
  fi
  [ -n "$given" ] && [ -f "$given" ] && echo "$given"
}

build_env() {
  local wheel="$1" stamp
  stamp="$(sha256sum "$wheel" setup.py | sha256sum | cut -c1-16)"
  if [ -f "$ENV_DIR/.ready" ] && [ "$(cat "$ENV_DIR/.ready")" = "$stamp" ]; then
    return 0
  fi
  say "building $ENV_DIR from $(basename "$wheel") (no download: .venv's packages are reused)"
  rm -rf "$ENV_DIR"
  "$BASE_PY" -m venv --without-pip "$ENV_DIR"
  local own base
  own="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  base="$(cd "$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && pwd)"
  # zz_: processed after the editable megatron-ext's .pth; a plain path line is appended to
  # sys.path after this site-packages, so what is installed here wins.
  echo "$base" > "$own/zz_project_venv.pth"
  "$BASE_PY" -m pip --python "$PY" install --quiet --no-deps --no-index "$wheel"
  "$BASE_PY" -m pip --python "$PY" install --quiet --no-deps --no-index --no-build-isolation -e .
  local py_abs="$PWD/$PY" check_log="$PWD/$ENV_DIR/check.log"
  (cd / && env -u PYTHONPATH "$py_abs" -W ignore - "$own" <<'CHECK' 2>"$check_log") \
    || { cat "$check_log"; say "FAIL: the lane does not import its own megatron-core"; exit 1; }
import os, sys
import megatron.core.package_info as info
import megatron_ext
assert info.__file__.startswith(sys.argv[1]), f"megatron-core imported from {info.__file__}"
assert (info.MAJOR, info.MINOR) == (0, 20), info.VERSION
print(f"[mcore-0.20] megatron-core {info.MAJOR}.{info.MINOR}.{info.PATCH} from {os.path.dirname(info.__file__)}, megatron-ext from {os.path.dirname(megatron_ext.__file__)}")
CHECK
  echo "$stamp" > "$ENV_DIR/.ready"
}

# The single-process session here runs the tests of what meets megatron-core (its config, specs,
# layers, schedules, checkpoints, data builders, argument parser, doctor, the version refusal);
# the packages that only read text, manage files and processes (cli's other commands, launch,
# runs, upstream_cases, the docs and source scans) behave the same whatever megatron-core is
# installed and run once, on 0.19.2. Every multi-rank test meets megatron-core and runs here,
# but for the 4-rank checkpoint layout chains (tests/unit_tests/checkpoint): on 0.20 the
# checkpoint path is proven by the upstream-checkpoint move (tests/unit_tests/mcore_020, saved by
# 0.20's own mHC model, converted, continued at PP2, VPP2 and ZB-H1); the chains run on 0.19.2 in
# make test and on both 0.20 builds in the soak step.
MEGATRON_FACING_TESTS=(
  tests/unit_tests/{checkpoint,config,data,guards,mcore_020,mhc,models,multimodule,pipeline,recipes,runtime,schedules,testing}
  tests/unit_tests/test_{native_mhc,parallel_plan,patch,registry}.py
  tests/unit_tests/cli/test_cli.py tests/unit_tests/runs/test_run_edges.py
)
# A multi-rank session collects only the files that hold tests for its world (tests/conftest.py).
rank_test_files() { grep -rlE "world_size\($1\)" tests/unit_tests | sort; }

step="${1:?usage: scripts/mcore_020_lane.sh env|unit|2ranks|4ranks|recipes|soak [--one-case-per-test|--once]}"
shift
light=()
once=0
for option in "$@"; do
  case "$option" in
    --one-case-per-test) light=(--one-case-per-test) ;;
    --once) once=1 ;;
    *) say "unknown option $option"; exit 2 ;;
  esac
done
wheel="$(find_wheel || true)"
if [ -z "$wheel" ]; then
  say "no megatron-core 0.20 wheel at ${MEGATRON_CORE_WHEEL:-$DEFAULT_WHEEL_DIR} (set MEGATRON_CORE_WHEEL): lane skipped, 0.19.2 only"
  exit 0
fi
build_env "$wheel"
# Ranks and subprocesses must import the lane's interpreter's packages, not a checkout's.
unset PYTHONPATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
TORCHRUN=("$PY" -m torch.distributed.run --standalone --local-ranks-filter 0)
case "$step" in
  env) ;;
  unit) "$PY" -m pytest "${MEGATRON_FACING_TESTS[@]}" --durations=10 ;;
  2ranks) "${TORCHRUN[@]}" --nproc_per_node 2 -m pytest $(rank_test_files 2) "${light[@]}" --durations=5 ;;
  4ranks) "${TORCHRUN[@]}" --nproc_per_node 4 -m pytest $(rank_test_files 4 | grep -v '^tests/unit_tests/checkpoint/') \
      "${light[@]}" --durations=5 ;;
  recipes)
    MEGATRON_EXT_RECIPES="$LANE_RECIPES" MEGATRON_EXT_RECIPES_ONCE="$once" "$PY" -m pytest \
      tests/functional_tests/test_recipes.py -k test_recipe_trains_on_cpu_and_matches_its_golden_values \
      --durations=0 ;;
  soak)
    all="$(cd recipes && ls *.yaml | sed 's/\.yaml$//' | paste -sd, -)"
    MEGATRON_EXT_RECIPES="$all" MEGATRON_EXT_SOAK=1 "$PY" -m pytest tests/functional_tests/test_recipes.py \
      -k test_recipe_trains_on_cpu_and_matches_its_golden_values --durations=0
    "${TORCHRUN[@]}" --nproc_per_node 2 -m pytest tests/unit_tests/mcore_020 --durations=0
    MEGATRON_EXT_SOAK=1 "${TORCHRUN[@]}" --nproc_per_node 4 -m pytest \
      $(rank_test_files 4 | grep '^tests/unit_tests/checkpoint/') --durations=0 ;;
  *) say "unknown step $step"; exit 2 ;;
esac
