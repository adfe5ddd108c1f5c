#!/usr/bin/env bash
# Installs torch (pinned: 2.13.0, a CPU build on our machines' disk; a bare `torch` would pull CUDA), then this project
# with its test extra, then tinker-cookbook without its dependencies, into the virtual environment VENV (made first).
# With uv where the package index has it: the same packages as pip resolves (same index, local wheels and
# constraints, read from pip's configuration), in about 50 s against pip's 3 min on a 2-core machine. Else with pip.
# Usage: scripts/install.sh PYTHON VENV
set -euo pipefail
python=$1 venv=$2
py=$venv/bin/python

echo "creating $venv with $("$python" --version) ..."
"$python" -m venv "$venv"

# pip -q still warns once per package for an index location that lacks it (a machine's extra local index: hundreds of
# "WARNING: Location '...' is ignored" lines); the filter drops those, pip's other warnings and errors stay.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

# What pip is configured with (its environment first, then its files), as uv's environment: uv reads neither.
pip_setting() {  # NAME (pip's, e.g. find-links) -> its value, or nothing
    local env_name=PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")
    if [[ -n ${!env_name:-} ]]; then echo "${!env_name}"; else "$py" -m pip config get "global.$1" 2>/dev/null || true; fi
}
install() {  # ARGS... (pip install's): with uv when there is one, else pip
    if [[ -x $venv/bin/uv ]]; then
        quiet "$venv/bin/uv" pip install --python "$py" --quiet --compile-bytecode "$@"
    else
        quiet "$py" -m pip install --quiet "$@"
    fi
}
if "$py" -m pip install --quiet uv >/dev/null 2>&1 && [[ -x $venv/bin/uv ]]; then
    # pip merges every index and takes the best match (uv's default is the first index that has a package)
    export UV_INDEX_STRATEGY=unsafe-best-match
    value=$(pip_setting index-url) && [[ -n $value ]] && export UV_INDEX_URL=$value
    value=$(pip_setting extra-index-url) && [[ -n $value ]] && export UV_EXTRA_INDEX_URL=$(tr '\n' ' ' <<<"$value")
    value=$(pip_setting find-links) && [[ -n $value ]] && export UV_FIND_LINKS=$(tr ' \n' ',,' <<<"$value" | sed 's/,*$//')
    value=$(pip_setting constraint) && [[ -n $value ]] && export UV_CONSTRAINT=$(tr '\n' ' ' <<<"$value")
else
    echo "(uv is not on this machine's package index: installing with pip, 3-5 min)"
fi

echo "installing torch 2.13.0 (CPU build) into $venv ..."
install torch==2.13.0
echo "installing tinker_exp and its dependencies (verl, Ray, transformers, W&B, Optuna, pytest, ...) ..."
install -e '.[test]'
# tinker-cookbook 0.6.1 (tests/test_serve_cookbook.py) requires tml-renderers>=0.4.1, which our registry lacks (0.2.1);
# it imports it only for Inkling and Kimi models, so its other requirements come with the test extra, it without its own.
install --no-deps tinker-cookbook==0.6.1
touch "$venv/.installed"
echo "installed into $venv (make clean removes it)"
