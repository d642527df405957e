#!/usr/bin/env bash
# Run an old commit's own lfm2 bench beside today's tree (a bisect on the GPU machine, which has
# no .git): `prepare` unpacks the commit's core, adapters, plugins/lfm2_moe and bench into
# old/COMMIT here; `run` (on the device; carry "old") puts that tree's packages first on the
# path and runs its bench/lfm2_speed.py with the arguments given.
#   bash bench/old_tree.sh prepare 49f5b9a
#   bash bench/old_tree.sh run 49f5b9a --sections prefill --out $OUT/old
set -eu
mode=$1 commit=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$root/old/$commit
if [ "$mode" = prepare ]; then
  mkdir -p "$tree"
  git -C "$root" archive "$commit" core adapters plugins/lfm2_moe bench | tar -x -C "$tree"
  exit 0
fi
shim=/tmp/old_tree_$commit
rm -rf "$shim" && mkdir -p "$shim/tensorfold"
for f in "$tree"/core/*; do ln -s "$f" "$shim/tensorfold/"; done
if [ -d "$tree/adapters" ]; then ln -s "$tree/adapters" "$shim/tensorfold/adapters"; fi
cd "$tree"
PYTHONPATH=$shim:$tree/plugins/lfm2_moe:$tree:${PYTHONPATH:-} exec python3 bench/lfm2_speed.py "$@"
