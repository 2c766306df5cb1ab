#!/usr/bin/env bash
# Packs the Python packages the GPU end-to-end benchmark needs and a lent GPU
# machine's image lacks (ray and its few missing dependencies, pydantic) into
# .whl/site.tar.xz, for the device tool to carry (`carry: [".whl"]`);
# bench/gpu_check.sh unpacks it to /tmp/site. Needs the package registry here,
# none there. Ray's Java jars, dashboard source maps and ML libraries are left
# out and its three binaries stripped, so that the archive and the working tree
# stay inside the tool's 64 MiB.
#
#   bash bench/device_site.sh            # Python 3.12 on x86-64, the image's interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
# the versions this project's environment runs (pydantic and pydantic-core must match each other)
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null |
       grep -i -E '^(ray|pydantic|pydantic[-_]core|typing[-_]inspection|annotated[-_]types)==' || true)
test -n "$pins" || pins="ray==2.60.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/wheels" $pins jsonschema jsonschema-specifications referencing rpds-py
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
rm -rf "$work"/site/ray/jars "$work"/site/ray/train "$work"/site/ray/tune "$work"/site/ray/rllib
rm -f "$work"/site/ray/dashboard/client/build/static/js/*.map
strip --strip-unneeded "$work"/site/ray/_raylet.so "$work"/site/ray/core/src/ray/gcs/gcs_server \
  "$work"/site/ray/core/src/ray/raylet/raylet
mkdir -p .whl
tar -C "$work/site" -cf - . | xz -T0 -6 > .whl/site.tar.xz
ls -l .whl/site.tar.xz
