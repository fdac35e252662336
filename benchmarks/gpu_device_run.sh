#!/usr/bin/env bash
# Device-side driver for the GPU measurements of issue 17 (run from the repo root of the device copy, with the
# repo's components/tests/data, this driver and the reduced fbgemm-gpu copied under .gpu/ by benchmarks/gpu_stage.sh).
# Phases: setup (install .gpu/whl, unpack the reduced fbgemm-gpu), slicewidths (benchmarks.slice_widths), test, costs,
# aa, splitcosts (a pipeline run's shard sample with split pieces, for a GPU cost model), quality
# (benchmarks.gpu_quality). Every step logs under $OUT; each bench step has a deadline so the call ends inside its
# limit.
# usage: gpu_device_run.sh SECONDS PHASE[:CAP_SECONDS]...
set -u
T0=$(date +%s); LIMIT=$1; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/.gpu/components:$PWD/.gpu EMBSHARD_NUM_THREADS=1
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
G=.gpu/data
for arg in "$@"; do
  phase=${arg%%:*}; CAP=${arg#*:}; [ "$CAP" = "$arg" ] && CAP=100000   # PHASE:SECONDS caps a bench phase
  echo "=== phase $phase at +$(( $(date +%s) - T0 ))s" | tee -a $OUT/driver.log
  case $phase in
  setup)
    mkdir -p /tmp/site
    # Python packages the image lacks (embshard's params check imports jsonschema) travel as wheels in .gpu/whl.
    if ls .gpu/whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.whl-ok ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
        >>$OUT/driver.log 2>&1 && touch /tmp/site/.whl-ok
    fi
    if [ ! -f /tmp/site/.ok ]; then
      # The device image has no zstd binary: the archive is xz, unpacked with Python's lzma.
      echo "$(cat .gpu/fbgemm.sha256)  .gpu/fbgemm-red.tar.xz" | sha256sum -c - 2>&1 | tee -a $OUT/driver.log || exit 3
      python3 -c "import tarfile; tarfile.open('.gpu/fbgemm-red.tar.xz', 'r:xz').extractall('/tmp/site', filter='tar')" \
        && touch /tmp/site/.ok
    fi
    { nvidia-smi; python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))";
      python3 -m pip show numpy pandas pyarrow 2>/dev/null | grep -E '^(Name|Version)'; nproc; free -g; df -h /tmp; } > $OUT/env.txt 2>&1
    python3 - <<'PY' 2>&1 | tee -a $OUT/driver.log
import time; t=time.time()
import fbgemm_gpu, torch
print("fbgemm_gpu", fbgemm_gpu.__version__, "import", round(time.time()-t,1), "s")
from embshard.bench import backends
print("fbgemm cuda status:", backends.fbgemm_status("cuda"))
import importlib.metadata as md
print({n: md.version(n) for n in ("numpy", "pandas", "pyarrow", "scipy", "attrs", "jsonschema", "pytest")})
PY
    ;;
  slicewidths)
    # what a column slice of the MLPerf-like list's hottest table costs by width (the split search's slice floor)
    T=$(( $(left) - 20 )); [ $T -gt $CAP ] && T=$CAP; echo "slice widths for at most ${T}s" | tee -a $OUT/driver.log
    timeout $T python3 -m benchmarks.slice_widths --device cuda --batch-size ${EMBSHARD_GPU_BATCH:-65536} \
        --rounds 5 --tables ${EMBSHARD_GPU_ROOT:-.gpu/quality}/task-01/tables.parquet --out $OUT/slice_widths 2>&1 \
        | tee $OUT/slice_widths.log ;;
  test)
    timeout $(( $(left) - 10 )) python3 -m pytest -q -rA -p no:cacheprovider .gpu/tests/test_bench_cuda.py 2>&1 | tee $OUT/pytest_cuda.txt ;;
  costs|aa|splitcosts)
    # splitcosts: a pipeline run's shard sample, split pieces included (.gpu/data/split), for a GPU cost model
    TB=$G/tables.parquet; TK=$G/tasks.parquet
    case $phase in
      costs) S=$G/shards.parquet; R=/tmp/run_costs ;;
      aa) S=$G/aa_shards.parquet; R=/tmp/run_aa ;;
      splitcosts) S=$G/split/shards.parquet; TB=$G/split/tables.parquet; TK=$G/split/tasks.parquet; R=/tmp/run_split ;;
    esac
    BK=fbgemm; python3 -c "from embshard.bench import backends; import sys; sys.exit(backends.fbgemm_status('cuda') is not None)" || BK=torch
    T=$(( $(left) - 25 )); [ $T -gt $CAP ] && T=$CAP; echo "bench $phase backend $BK for at most ${T}s" | tee -a $OUT/driver.log
    [ $T -gt 20 ] && timeout $T python3 -m embshard bench --tables $TB --tasks $TK \
        --shards $S --out $R --device cuda --backend $BK --num-chunks 4 --no-progress 2>&1 | tee -a $OUT/bench_$phase.log
    python3 - $R $OUT/${phase}_gpu.parquet <<'PY' 2>&1 | tee -a $OUT/driver.log
import glob, sys, pandas as pd
fs = glob.glob(sys.argv[1] + "/costs/*.parquet") + glob.glob(sys.argv[1] + "/costs/.partial/*/*.parquet")
if fs:
    df = pd.concat([pd.read_parquet(f) for f in fs], ignore_index=True).drop_duplicates("sample_id")
    df.to_parquet(sys.argv[2], index=False); print(sys.argv[2], len(df), "rows from", len(fs), "files")
PY
    ;;
  quality)
    # The split suite's plans (made on the dev machine: python -m benchmarks.gpu_quality plan --out .gpu/quality)
    # measured here with the ruler, the refinement included; results are written after every task.
    # EMBSHARD_GPU_TASKS=task-01,task-04 measures those tasks only, in that order; EMBSHARD_GPU_ROOT another plan
    # folder (default .gpu/quality), e.g. plans searched with a GPU cost model.
    T=$(( $(left) - 20 )); [ $T -gt $CAP ] && T=$CAP; echo "quality for at most ${T}s" | tee -a $OUT/driver.log
    mkdir -p $OUT/quality
    timeout $T python3 -m benchmarks.gpu_quality measure --root ${EMBSHARD_GPU_ROOT:-.gpu/quality} --out $OUT/quality --device cuda \
        --batch-size ${EMBSHARD_GPU_BATCH:-65536} --rounds 5 --deadline-s $(( T - 30 )) ${EMBSHARD_GPU_TASKS:+--tasks $EMBSHARD_GPU_TASKS} 2>&1 | tee $OUT/quality.log ;;
  esac
done
echo "=== done at +$(( $(date +%s) - T0 ))s" | tee -a $OUT/driver.log
