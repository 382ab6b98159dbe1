#!/usr/bin/env bash
# The unattended GPU check (issue 9, item 7): run on a GPU node, from the repository root, in under 5 minutes.
#
#   tests/gpu/run.sh [SIZES]        SIZES defaults to 1GB,8GB,32GB
#
# 1. GB/s of each loader (cuda-pinned: registered and pageable side by side; kvikio: cold reads from
#    $PULSESCALE_GPU_DISK_DIR, default /var/tmp; host: the CPU copy) for each size, against the PCIe link's usable
#    rate (nvidia-smi), via `pulsescale bench activate --loader ...`;
# 2. whether the driver enforces RLIMIT_MEMLOCK on cudaHostRegister (pins 1 GiB under an 8 MiB limit);
# 3. the GPU-marked tests (tests/nodeagent/test_gpu_loaders.py -m gpu);
# 4. claim -> first token with a vLLM standby (sleep/wake), when vLLM for CUDA is importable and the bench has
#    `--engine vllm`; otherwise it says why it skipped.
#
# Exit status: 0 all ran, 3 no GPU here ("no GPU: ..." on stderr, before anything else runs), 1 a check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
SIZES="${1:-1GB,8GB,32GB}"
NO_GPU=3

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi not found (no NVIDIA driver on this machine)" >&2
    exit $NO_GPU
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi finds no device: $(nvidia-smi -L 2>&1 | head -1)" >&2
    exit $NO_GPU
fi
PY="${PYTHON:-python}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ! "$PY" -c 'import cupy' >/dev/null 2>&1; then
    echo "installing the gpu extra (cupy, kvikio) ..."
    cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
    extra=gpu; [ "${cuda_major:-13}" -lt 13 ] && extra=gpu-cu12
    "$PY" -m pip install -q -e ".[$extra,dev]" || { echo "cannot install .[$extra]" >&2; exit 1; }
fi

status=0
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max,driver_version --format=csv
echo "memlock limit: $(ulimit -l) KiB (soft) / $(ulimit -Hl) KiB (hard); /dev/shm: $(df -h /dev/shm | tail -1)"

echo "=== 1. loader GB/s ($SIZES)"
for loader in cuda-pinned kvikio host; do
    extra_args=(--repeats 2)
    sizes="$SIZES"
    [ "$loader" = host ] && sizes="${SIZES%,*}"  # the CPU copy is the reference, not the point: skip the largest
    [ "$loader" = kvikio ] && extra_args+=(--disk-dir "${PULSESCALE_GPU_DISK_DIR:-/var/tmp}")
    timeout 170 "$PY" -m pulsescale bench activate --loader "$loader" --size "$sizes" "${extra_args[@]}"
    rc=$?
    if [ $rc -ne 0 ]; then echo "FAILED: bench --loader $loader exited $rc" >&2; status=1; fi
done

echo "=== 2. does the driver enforce RLIMIT_MEMLOCK on cudaHostRegister?"
timeout 60 "$PY" - <<'PYEOF' || status=1
import mmap, os, resource, tempfile
import cupy
resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 * 2**20, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
fd, path = tempfile.mkstemp(dir="/dev/shm")
try:
    os.ftruncate(fd, 2**30)
    m = mmap.mmap(fd, 2**30, prot=mmap.PROT_READ)
    import numpy as np
    addr = np.frombuffer(m, np.uint8).ctypes.data
    try:
        cupy.cuda.runtime.hostRegister(addr, 2**30, 0x01 | 0x08)
        cupy.cuda.runtime.hostUnregister(addr)
        print("memlock: NOT enforced: 1 GiB registered under an 8 MiB RLIMIT_MEMLOCK")
    except cupy.cuda.runtime.CUDARuntimeError as err:
        print(f"memlock: enforced (or read-only registration refused): {err}")
finally:
    os.close(fd); os.unlink(path)
PYEOF

echo "=== 3. GPU tests"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/nodeagent/test_gpu_loaders.py || status=1

echo "=== 4. claim -> first token with a vLLM standby"
if ! "$PY" -c 'import vllm, torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    echo "skipped: vLLM for CUDA is not importable here (import vllm, torch.cuda.is_available())"
elif ! "$PY" -m pulsescale bench activate --help 2>/dev/null | grep -q -- '--engine'; then
    echo "skipped: this version's bench has no --engine vllm"
else
    timeout 240 "$PY" -m pulsescale bench activate --engine vllm --activations 5 || status=1
fi
exit $status
