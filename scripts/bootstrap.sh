#!/usr/bin/env bash
# Creates .venv with Python 3.12 and the pinned packages, then installs megatron-ext into it
# (editable). Safe to re-run: it does nothing when the venv is already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP=$VENV/.megatron-ext-installed

find_python312() {
  # A pyenv shim can be on PATH without the version being active: check that it runs.
  local candidate
  for candidate in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
                   /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if [ -f "$STAMP" ] && [ "$STAMP" -nt requirements.txt ] && [ "$STAMP" -nt setup.py ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY=$(find_python312); then
    echo "error: megatron-core >= 0.17 needs Python 3.12, and no working python3.12 was found" >&2
    echo "       (looked on PATH and in ~/.pyenv/versions/3.12*). Install Python 3.12 (e.g." >&2
    echo "       'pyenv install 3.12') and run this again." >&2
    exit 1
  fi
  echo "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi

echo "installing pinned packages into $VENV (torch is a large download the first time)"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -r requirements.txt
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
touch "$STAMP"
