#!/usr/bin/env bash
# Stage what a borrowed GPU machine needs into CHECKOUT/.gpu (the checkout the device tool sends; .gpu is
# git-ignored through .git/info/exclude and named in the run's `carry`), from this source tree:
#   .gpu/components  .gpu/tests  .gpu/data  .gpu/gpu_device_run.sh   this tree's code, tests, driver, GPU inputs
#                         (.gpu/data/split: the shard sample of benchmarks/data/gpu-h100-split, split pieces included)
#   .gpu/whl/*.whl        packages the device image lacks (jsonschema and its needs, cp312 manylinux)
#   .gpu/fbgemm-red.tar.xz, .gpu/fbgemm.sha256   the reduced fbgemm-gpu 1.6.0 (benchmarks/gpu_pack_fbgemm.py;
#                         kept when already there: it takes about 5 minutes to build)
# then prints the size of what travels (tracked + untracked-not-ignored files + .gpu; the limit is 64 MiB).
# usage: benchmarks/gpu_stage.sh CHECKOUT        (run from the root of the tree whose code should run)
set -eu
DEST=$(cd "$1" && pwd); G=$DEST/.gpu
grep -qx '/.gpu/' "$DEST/.git/info/exclude" 2>/dev/null || { mkdir -p "$DEST/.git/info"; echo '/.gpu/' >> "$DEST/.git/info/exclude"; }
mkdir -p "$G/data" "$G/whl"
rm -rf "$G/components" "$G/tests"
cp -a components "$G/components"; cp -a tests "$G/tests"
find "$G/components" "$G/tests" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
cp benchmarks/gpu_device_run.sh "$G/"
cp benchmarks/data/gpu-h100/{tables,tasks,shards,aa_shards}.parquet "$G/data/"
mkdir -p "$G/data/split"; cp benchmarks/data/gpu-h100-split/{tables,tasks,shards}.parquet "$G/data/split/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$G/whl" \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# pip has exited 0 having saved only some of them (a registry hiccup): the device image would then lack a module
for w in jsonschema-4 jsonschema_specifications referencing rpds_py; do
  ls "$G/whl/$w"*.whl >/dev/null 2>&1 || { echo "gpu_stage: the $w wheel was not downloaded into $G/whl; run again" >&2; exit 1; }
done
if [ ! -f "$G/fbgemm-red.tar.xz" ] || [ ! -f "$G/fbgemm.sha256" ]; then
  python3 -m benchmarks.gpu_pack_fbgemm "$G"
fi
echo "$(cat "$G/fbgemm.sha256")  $G/fbgemm-red.tar.xz" | sha256sum -c -
cd "$DEST"
tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s+=$1} END {print s+0}')
gpu=$(du -sb .gpu | cut -f1)
echo "travels: tree $((tree / 1024)) KiB + .gpu $((gpu / 1024)) KiB = $(( (tree + gpu) / 1048576 )) MiB (limit 64 MiB)"
