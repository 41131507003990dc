#!/usr/bin/env bash
# python_venv.sh PYTHON VENV_DIR REQUIREMENTS_FILE
# Creates (or reuses) a virtual environment with the pinned requirements installed. The
# environment is rebuilt only when the requirements (or the interpreter) change, so reruns
# cost nothing. Debian's python3 needs python3-venv for this (scripts/setup.sh installs it).
set -euo pipefail
if [[ $# -ne 3 ]]; then
  echo "usage: python_venv.sh PYTHON VENV_DIR REQUIREMENTS_FILE" >&2
  exit 2
fi
python=$1 venv=$2 requirements=$3
req_dir=$(cd "$(dirname "$requirements")" && pwd)

# Every requirements file counts: the one given and those it includes with -r.
stamp_of() {
  {
    "$python" --version 2>&1
    cat "$requirements"
    sed -n 's/^-r[[:space:]]*//p' "$requirements" | while read -r inc; do cat "$req_dir/$inc"; done
  } | sha256sum | cut -d' ' -f1
}
want=$(stamp_of)
if [[ -x "$venv/bin/python" && -f "$venv/.requirements-stamp" && "$(cat "$venv/.requirements-stamp")" == "$want" ]]; then
  echo "python_venv: $venv is up to date"
  exit 0
fi

rm -rf "$venv"
if ! "$python" -m venv "$venv"; then
  echo "python_venv: '$python -m venv' failed; on Debian install python3-venv (scripts/setup.sh does)" >&2
  exit 1
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
echo "$want" >"$venv/.requirements-stamp"
echo "python_venv: $venv ready ($("$venv/bin/python" -m pip freeze | tr '\n' ' '))"
