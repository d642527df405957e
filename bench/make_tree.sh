#!/usr/bin/env bash
# The tree a device run carries: the committed HEAD with this change's files laid over it (so
# other sessions' edits in progress don't ride along), and the wheels of .whl/ (fill it with
# ../shared/device/prepare.sh). Prints the commit it is based on.
set -eu
top=$(git rev-parse --show-toplevel)
cd "$top"
tree=.bench_tree
grep -qx "/$tree/" .git/info/exclude 2>/dev/null || echo "/$tree/" >> .git/info/exclude
rm -rf "$tree" && mkdir "$tree"
git archive HEAD | tar -x -C "$tree"
files="core/engine/cuda_graphs.py core/ops/*.py core/engine/lanes.py core/engine/start.py bench/*.py bench/*.sh
  tests/test_triton_kernels.py plugins/*/tensorfold_*/*.py plugins/*/tests/*.py"
for f in $files; do cp --parents "$f" "$tree/"; done
cp -r .whl "$tree/.whl"
rm -f "$tree"/.whl/fla_core-*.whl
git rev-parse --short HEAD
