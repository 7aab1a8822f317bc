#!/usr/bin/env bash
# The project's CUDA checks in one run, for a machine with a GPU (CI has none):
#   1. pytest -m cuda: every experiment with device=cuda gives its CPU verdict at seed 0, the
#      fp16 failures under real CUDA autocast, the SimSiam pair at scale=cifar (tests/test_cuda.py);
#   2. the overhead benchmark on the GPU (benchmarks/overhead.py --device cuda), bare loop and
#      probe interleaved, with peak memory from the CUDA allocator, the probe's pre-step copy
#      beside the parameters (the default) and in host memory (probe.before_on=host), at the
#      full and at the --quick batches.
#
#   bash benchmarks/cuda_checks.sh OUT_DIR      # logs, the runs' summaries and the benchmark's JSON
#
# CUDA_CHECK_WORKERS (default 8) runs that many experiments at once (pytest-xdist), so the
# experiments' wall_s are not timings; the benchmark runs alone, after them.
set -uo pipefail
out=${1:-results/cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import platform, torch; print('python', platform.python_version(), 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$out/machine.txt"
nvidia-smi -L | tee -a "$out/machine.txt"

workers=${CUDA_CHECK_WORKERS:-8}
# --dist load: the tests of the one file spread over the workers (pyproject's default keeps a file on one)
xdist=(-n 0); [ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist load)
timeout "${PYTEST_LIMIT_S:-1800}" python3 -m pytest -m cuda tests/test_cuda.py "${xdist[@]}" -v -rA \
  --durations=0 --basetemp=/tmp/gradrepro_cuda -p no:cacheprovider 2>&1 | tee "$out/pytest_cuda.log"
# The runs' summaries (verdicts, checks, references): one file, whatever pytest reached.
(cd /tmp/gradrepro_cuda && find . -name summary.json | tar czf - -T -) > "$out/summaries.tgz"

timeout "${BENCH_LIMIT_S:-900}" python3 benchmarks/overhead.py --device cuda --models resnet18 plain30 \
  cifar10_3c3d --batch 128 --every 1 16 --ops --tools bare gradrepro gradrepro_copy_on_host \
  --json "$out/overhead_cuda.json" 2>&1 | tee "$out/overhead_cuda.log"
timeout "${BENCH_LIMIT_S:-900}" python3 benchmarks/overhead.py --device cuda --quick --models resnet18 plain30 \
  cifar10_3c3d --every 1 16 --tools bare gradrepro gradrepro_copy_on_host --json "$out/overhead_cuda_quick.json" \
  2>&1 | tee "$out/overhead_cuda_quick.log"
