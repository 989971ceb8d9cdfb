#!/usr/bin/env bash
# On a machine with a GPU and a CUDA build of torch: builds freetoken._C with its CUDA part in
# place, runs the CUDA tests and the unit tests, then the fused top-k kernel benchmark on the GPU.
#   bash scripts/cuda_check.sh [LOG_DIR]     (logs and the benchmark's JSON go to LOG_DIR)
# Each stage has its own time limit, so one that hangs still leaves the others' logs.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
logs=${1:-/tmp/freetoken-cuda-check}
mkdir -p "$logs"
# the scripts import freetoken from this checkout (built in place, not installed)
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$logs/gpu.txt"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name())" | tee -a "$logs/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400 >> "$logs/gpu.txt"

echo "== build (CUDA part included)"
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout 420 "$py" setup.py build_ext --inplace > "$logs/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s"; tail -3 "$logs/build.log"
[ $rc = 0 ] || exit $rc
"$py" -c "from freetoken.ops.backend import _C; print('cuda_compiled', _C.cuda_compiled())"

echo "== the CUDA tests"
timeout 120 "$py" -m pytest -q -p no:cacheprovider -m cuda tests/unit 2>&1 | tee "$logs/cuda_tests.log" | tail -5

echo "== the unit tests on this machine's CPU, one file a process (a crash names its test,"
echo "   which is deselected and the file run again, at most 4 times)"
end=$(( $(date +%s) + 240 ))
for f in tests/unit/test_*.py; do
  skip=()
  for try in 1 2 3 4 5; do
    left=$(( end - $(date +%s) )); [ $left -gt 5 ] || { echo "$f: out of time"; break; }
    log="$logs/unit_$(basename "$f" .py)_$try.log"
    timeout $left "$py" -m pytest -q -p no:cacheprovider "$f" "${skip[@]}" > "$log" 2>&1
    rc=$?
    echo "$f rc=$rc ${skip[*]} $(grep -E "passed|failed|error" "$log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$log" | head -5
    [ $rc = 139 ] && [ $try -lt 5 ] || break
    crashed=$(grep -oE "line [0-9]+ in test_[A-Za-z0-9_]+" "$log" | head -1 | awk '{print $4}')
    [ -n "$crashed" ] || break
    echo "  crashed in $crashed"; skip+=(--deselect "$f::$crashed")
  done
done

echo "== the fused top-k on the GPU (fused vs unfused torch, CUDA events)"
timeout 150 "$py" scripts/bench_kernel.py --device cuda 2>&1 | tee "$logs/bench_cuda.log" | grep -v '^{'
echo "bench rc=$?"
