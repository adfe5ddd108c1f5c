#!/bin/bash
# Build what the GPU machine lacks (docs/devices.md#the-gpu-check), into a git-ignored folder of the checkout:
#   bash scripts/gpu_check/build_bundle.sh [DIR]        (DIR: .gpu_bundle, from the repo root)
# DIR/whl: cp312 wheels (manylinux x86_64 or pure Python; one version each) of what the machine's image has not;
# DIR/ray.tar.xz: Ray 2.60.0 unpacked without what a run never imports (jars, rllib, serve, llm, tune, train, data,
# the dashboard's client build, *.map). Everything under DIR must stay under 64 MiB (the device tool's limit for the
# working tree, carry included): checked at the end (exit 1 when over). Needs the package registry (pip download);
# about 100 MB downloaded, a few minutes (xz). Idempotent: wheels already there are kept.
set -euo pipefail
DIR=${1:-.gpu_bundle}
PY=${PYTHON:-python3}
mkdir -p "$DIR/whl"
WHEELS=(
  annotated_types==0.8.0 codetiming==1.4.0 colorlog==6.12.0 datasets==5.2.0 dill==0.4.1 distro==1.9.0
  fastapi==0.165.0 h2==4.4.1 hpack==4.2.0 hydra_core==1.3.8 hydra_submitit_launcher==1.2.0 hyperframe==6.1.0
  jsonschema==4.26.0 jsonschema_specifications==2025.9.1 liger_kernel==0.8.5 multiprocess==0.70.19 omegaconf==2.3.1
  opentelemetry_api==1.45.2 optuna==4.9.0 orjson==3.13.0 pydantic==2.14.4 pydantic_core==2.50.5 pyvers==0.1.0
  referencing==0.37.0 rpds_py==2026.9.1 sniffio==1.3.1 starlette==1.10.0 tensordict==0.10.0 tinker==0.38.0
  typing_inspection==0.4.5 uvicorn==0.55.0 verl==0.9.1 zstandard==0.25.0
)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
have() {  # a wheel of NAME==VERSION already in DIR/whl
  local name=${1%%==*} version=${1##*==}
  compgen -G "$DIR/whl/$(echo "$name" | tr - _)-$version-*.whl" >/dev/null || compgen -G "$DIR/whl/$(echo "$name" | tr _ -)-$version-*.whl" >/dev/null
}
MISSING=()
for w in "${WHEELS[@]}"; do have "$w" || MISSING+=("$w"); done
if [ ${#MISSING[@]} -gt 0 ]; then
  echo "downloading ${#MISSING[@]} wheel(s)"
  $PY -m pip download -q --no-deps "${PLAT[@]}" -d "$DIR/whl" "${MISSING[@]}"
fi
# antlr4 4.9.3 (omegaconf's parser) has only a source release
compgen -G "$DIR/whl/antlr4_python3_runtime-4.9.3-*.whl" >/dev/null || $PY -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$DIR/whl"
if [ ! -s "$DIR/ray.tar.xz" ]; then
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  $PY -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP" ray==2.60.0
  mkdir -p "$TMP/site"
  $PY -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$TMP"/ray-2.60.0-*.whl "$TMP/site"
  (cd "$TMP/site/ray" && rm -rf jars rllib serve llm tune train data dashboard/client/build && find . -name '*.map' -delete)
  chmod -R u+w "$TMP/site"
  echo "packing Ray ($(du -sm "$TMP/site" | cut -f1) MB unpacked)"
  XZ_OPT=-6T2 tar -cJf "$DIR/ray.tar.xz.partial" -C "$TMP/site" ray ray-2.60.0.dist-info
  mv "$DIR/ray.tar.xz.partial" "$DIR/ray.tar.xz"
fi
TOTAL=$(du -sb "$DIR" | cut -f1)
echo "bundle: $DIR: $(ls "$DIR/whl" | wc -l) wheels + ray.tar.xz, $((TOTAL / 1048576)) MiB (limit 64 MiB with the working tree)"
[ "$TOTAL" -lt $((60 * 1048576)) ] || { echo "bundle too big: $TOTAL bytes" >&2; exit 1; }
