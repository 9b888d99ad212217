#!/usr/bin/env bash
# Build the wheel bundle that perf/gpu_check.py needs on the lent GPU machine, into .whl/
# (git-ignored), and check that it travels: the device tool carries the working tree and the
# paths named in `carry`, 64 MiB in all, and the machine reaches no package index.
#
#   bash perf/gpu_bundle.sh            # then the `run` call of perf/README.md ("GPU check")
#
# What goes in: the packages perf/gpu_check.py imports that the machine's image lacks or holds
# in another version, at the versions of this checkout's venv (MEGARL_VENV, default .venv), each
# --no-deps: their own dependencies are in the image (KINDS.md of the device tool lists it, and a
# session's `pip list` there: Python 3.12.3, torch 2.11.0, transformers 5.17.0, huggingface_hub
# 1.33.0, tokenizers 0.23.2, safetensors 0.8.0, numpy, packaging, einops, pyyaml, typer, ...).
#   megatron-core, mbridge   absent from the image
#   transformers             the image has 5.17.0; megarl is developed and tested against this
#                            venv's version (the engine reads configs through it)
#   regex                    transformers checks regex >= 2025.10.22 when imported; the image's
#                            version is not recorded
# Compiled wheels (megatron-core, regex) are fetched for the image's CPython (GPU_BUNDLE_PYTHON,
# default 3.12). The import trace behind this list is in perf/results/gpu_bundle.md.
#
# On the machine the wheels go into a folder of their own, first on PYTHONPATH (the image's
# python3 is itself a venv, /opt/torch/.venv, so a venv made from it with
# --system-site-packages would see the base interpreter's packages, not torch):
#   python3 -m pip install -q --no-index --no-deps --no-compile --find-links .whl \
#       -r .whl/requirements.txt --target /tmp/site && export PYTHONPATH=/tmp/site
#
# Prints the bundle's size and the size of everything that travels with it (tracked files and
# untracked files git does not ignore), and exits 1 when that is over 64 MiB.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${MEGARL_VENV:-$ROOT/.venv}
DEST=$ROOT/.whl
PY=${GPU_BUNDLE_PYTHON:-3.12}
PACKAGES="megatron-core mbridge transformers regex"
LIMIT=$((64 * 1024 * 1024))

cd "$ROOT"
git check-ignore -q .whl/x.whl || { echo "gpu_bundle: .whl/ is not git-ignored (.gitignore has /.whl/)" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST"
: > "$DEST/requirements.txt"
for pkg in $PACKAGES; do
    version=$("$VENV/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")
    echo "$pkg==$version" >> "$DEST/requirements.txt"
    "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$DEST" "$pkg==$version" ||
        { echo "gpu_bundle: no wheel of $pkg==$version for CPython $PY on x86-64 Linux" >&2; exit 1; }
done

bundle=$(du -sb "$DEST" | cut -f1)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- | tail -1 | cut -f1)
total=$((bundle + tree))
echo "gpu_bundle: $(ls "$DEST"/*.whl | wc -l) wheels in .whl/: $bundle bytes ($((bundle / 1024 / 1024)) MiB)"
ls -l "$DEST"/*.whl | awk '{printf "  %10d  %s\n", $5, $NF}'
echo "gpu_bundle: working tree that travels: $tree bytes; with the bundle $total bytes of $LIMIT (64 MiB)"
if [[ $total -gt $LIMIT ]]; then
    echo "gpu_bundle: over the device tool's 64 MiB limit" >&2
    exit 1
fi
