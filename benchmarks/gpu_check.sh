#!/usr/bin/env bash
# Everything that needs a GPU, in one run of at most 10 minutes: the CUDA tests (the zoo on CUDA replicas among
# them), then the benchmarks' quick mode on CUDA (BatchNorm models included). Logs and results go to $OUT (default
# runs/gpu_check), which git ignores.
#
#   bash benchmarks/gpu_check.sh
#
# On a machine whose Python lacks some of the package's requirements, put their wheels in .whl/ (git ignores it):
# they are installed into /tmp/site first, with no index. Each part has its own time limit, so a part that hangs
# leaves time for the next (TESTS_LIMIT and BENCH_LIMIT, in seconds, shorten them to fit a lease); the exit status is
# non-zero when any part failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

python3 - <<'EOF' | tee "$out/machine.txt"
import platform, torch, lightning
gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
print(f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, gpus {gpus}")
EOF

failed=0
timeout "${TESTS_LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee "$out/cuda-tests.log" || failed=1
# With one GPU the multi-process jobs would run one process each, comparing nothing across GPUs, in half the time.
skip_ddp=$(python3 -c "import torch; print('--skip-ddp' if torch.cuda.device_count() < 2 else '')")
timeout "${BENCH_LIMIT:-240}" python3 -m benchmarks.run --quick --device cuda $skip_ddp --out "$out/cuda-quick" 2>&1 \
    | tee "$out/benchmarks.log" || failed=1
exit "$failed"
