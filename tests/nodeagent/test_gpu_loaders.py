"""The GPU loaders: chunk/stream planning, the pin decision and loader selection (pure, everywhere), the refusals
on a node without a GPU (real CLI, real check script), and the loaders themselves on a real GPU (`gpu` marker:
they skip elsewhere with the reason)."""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent import bench_loader
from nodeagent.engine import cudaplan, loaders, zygote
from nodeagent.errors import LoaderUnavailable

ROOT = Path(__file__).resolve().parents[2]


def _no_gpu_reason() -> str:
    if shutil.which("nvidia-smi") is None or loaders.probe_gpu().unavailable("cuda-pinned"):
        return "no GPU (nvidia-smi/libcuda not found)"
    return ""


requires_gpu = pytest.mark.skipif(bool(_no_gpu_reason()), reason=_no_gpu_reason() or "GPU present")

# --- planning -----------------------------------------------------------------------------------------------------

ALIGNS = st.sampled_from([8, 16, 4096])


@st.composite
def _plans(draw: st.DrawFn) -> tuple[list[cudaplan.Span], int, int, int]:
    align = draw(ALIGNS)
    chunk = align * draw(st.integers(1, 8))
    n = draw(st.integers(0, 6))
    spans = []
    for _ in range(n):
        begin = draw(st.integers(0, 3 * chunk))
        size = draw(st.integers(0, 12 * chunk))
        spans.append(cudaplan.Span(begin, begin + size))
    return spans, chunk, draw(st.integers(1, 9)), align


@settings(max_examples=400, deadline=None)
@given(_plans())
def test_a_plan_copies_each_byte_once_aligned_within_its_file_and_balanced(
    case: tuple[list[cudaplan.Span], int, int, int],
) -> None:
    spans, chunk, streams, align = case
    plan = cudaplan.plan_copy(spans, chunk_bytes=chunk, streams=streams, align=align)
    assert sum(c.nbytes for c in plan.chunks) == plan.nbytes == sum(s.nbytes for s in spans)
    for i, span in enumerate(spans):
        mine = sorted((c for c in plan.chunks if c.file == i), key=lambda c: c.src)
        at = span.begin
        for c in mine:  # contiguous, no overlap, no gap: each byte exactly once, never past the file's end
            assert c.src == at and c.nbytes > 0 and c.src + c.nbytes <= span.end
            assert c.nbytes <= chunk
            if c.src != span.begin:
                assert c.src % chunk == 0  # interior boundaries on chunk multiples in the file...
            assert (c.dst - c.src) % align == 0  # ...and device address == file offset modulo align
            assert c.dst == plan.dst_of(i, c.src)
            at += c.nbytes
        assert at == span.end
    ranges = sorted((c.dst, c.dst + c.nbytes) for c in plan.chunks)
    for (_, end), (begin, _) in itertools.pairwise(ranges):
        assert end <= begin  # no two chunks land on the same device byte
    assert all(lo >= 0 and hi <= plan.alloc_bytes for lo, hi in ranges)
    assert plan.alloc_bytes <= plan.nbytes + len(spans) * align  # gaps are alignment only
    per_stream = [sum(c.nbytes for c in plan.chunks if c.stream == s) for s in range(streams)]
    assert list(plan.stream_bytes) == per_stream
    if plan.chunks:
        assert max(per_stream) - min(per_stream) <= max(c.nbytes for c in plan.chunks)


def test_a_plan_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError, match="power of two"):
        cudaplan.plan_copy([], align=3000)
    with pytest.raises(ValueError, match="multiple of align"):
        cudaplan.plan_copy([], chunk_bytes=5000, align=4096)
    with pytest.raises(ValueError, match="streams"):
        cudaplan.plan_copy([], streams=0)
    with pytest.raises(ValueError, match="bad data span"):
        cudaplan.plan_copy([cudaplan.Span(10, 5)])


def test_a_100_gb_model_spreads_evenly_over_the_streams() -> None:
    spans = [cudaplan.Span(4096 + i, 4096 + i + 5 * 10**9) for i in range(20)]  # 20 shards of 5 GB
    plan = cudaplan.plan_copy(spans)
    assert plan.nbytes == 100 * 10**9
    assert max(plan.stream_bytes) - min(plan.stream_bytes) <= cudaplan.CHUNK_BYTES
    assert len(plan.chunks) == pytest.approx(100e9 / cudaplan.CHUNK_BYTES, rel=0.02)


# --- pinning and the memlock limit --------------------------------------------------------------------------------

GB = 10**9


@pytest.mark.parametrize(
    ("weights", "memlock", "cap", "policy", "register", "says"),
    [
        (100 * GB, 8 * 2**20, False, "auto", False, "RLIMIT_MEMLOCK is 8.0 MiB"),
        (100 * GB, None, False, "auto", True, "unlimited"),
        (100 * GB, 8 * 2**20, True, "auto", True, "CAP_IPC_LOCK"),
        (GB, 2 * GB, False, "auto", True, "covers"),
        (100 * GB, None, False, "never", False, "turned off"),
        (100 * GB, 8 * 2**20, False, "always", True, "forced"),
    ],
)
def test_the_pin_decision_follows_the_memlock_limit(
    weights: int, memlock: int | None, cap: bool, policy: str, register: bool, says: str
) -> None:
    d = cudaplan.pin_decision(weights, memlock_bytes=memlock, cap_ipc_lock=cap, policy=policy)
    assert d.register is register and says in d.reason
    if not register and policy == "auto":
        assert "pageable" in d.reason and "IPC_LOCK" in d.reason  # what happens and the fix


@pytest.fixture(name="low_memlock")
def low_memlock_fixture() -> Iterator[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    low = 8 * 2**20 if hard == resource.RLIM_INFINITY else min(8 * 2**20, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, hard))
    try:
        yield low
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_the_node_pin_decision_reads_this_process_limit(low_memlock: int) -> None:
    """As the engine sees it: the zygote decides after dropping to the engine user (no CAP_IPC_LOCK left)."""
    if not loaders._has_cap(loaders._CAP_IPC_LOCK):
        d = loaders.pin_decision_for(16 * 2**20, "auto")
        assert not d.register and cudaplan.fmt_bytes(low_memlock) in d.reason
        return
    if os.getuid() != 0:
        pytest.skip("needs a process without CAP_IPC_LOCK, or root to drop it")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child becomes nobody, as an engine does, and reports its decision
        code = 1
        try:
            os.close(r)
            zygote.drop_privileges(65534, 65534)
            d = loaders.pin_decision_for(16 * 2**20, "auto")
            os.write(w, json.dumps([d.register, d.reason, loaders._has_cap(loaders._CAP_IPC_LOCK)]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    register, reason, cap = json.loads(data)
    assert not cap and not register and cudaplan.fmt_bytes(low_memlock) in reason


def test_kvikio_is_refused_at_arm_when_the_engine_user_cannot_reopen_the_weights(tmp_path: Path) -> None:
    """Staged files are root's, 0600; kvikio reopens by path as the engine user (nobody): said at arm time."""
    if os.getuid() != 0:
        pytest.skip("needs root (to own the staged file and drop to nobody)")
    path = Path("/dev/shm") / f"pulsescale-kvikio-test-{os.getpid()}"
    path.write_bytes(b"x" * 64)
    path.chmod(0o600)
    r, w = os.pipe()
    try:
        vf = bench_loader._open_verified(path)
        assert loaders.KvikioLoader().prepare([vf]) == ""  # root may reopen it
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                zygote.drop_privileges(65534, 65534)
                try:
                    loaders.KvikioLoader().prepare([vf])
                    os.write(w, b"no error")
                except LoaderUnavailable as err:
                    os.write(w, str(err).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        w = -1
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.waitpid(pid, 0)
        os.close(vf.fd)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        path.unlink(missing_ok=True)
    assert "cannot reopen the verified" in data.decode() and "--loader cuda-pinned" in data.decode()


# --- the PCIe yardstick ---------------------------------------------------------------------------------------------


def test_the_pcie_limit_of_common_links() -> None:
    assert cudaplan.pcie_limit_gbps(5, 16) == pytest.approx(63.0, abs=0.1)
    assert cudaplan.pcie_limit_gbps(4, 16) == pytest.approx(31.5, abs=0.1)
    assert cudaplan.parse_pcie(" 5, 16\n") == (5, 16)
    for bad in ("[N/A], 16", "5", ""):
        with pytest.raises(ValueError, match="PCIe"):
            cudaplan.parse_pcie(bad)
    with pytest.raises(ValueError, match="PCIe"):
        cudaplan.pcie_limit_gbps(9, 16)


# --- choosing a loader ----------------------------------------------------------------------------------------------

GPU_NODE = loaders.GpuProbe(devices=8, libcuda="", cupy=True, kvikio=True)


def test_auto_on_a_gpu_node_picks_by_engine_and_staging_filesystem(tmp_path: Path) -> None:
    loader, why = loaders.choose("auto", probe=GPU_NODE)
    assert loader.name == "host" and "computes on the CPU" in why
    loader, why = loaders.choose("auto", probe=GPU_NODE, engine_device="cuda", staging_dir="/dev/shm")
    assert loader.name == "cuda-pinned" and "tmpfs" in why
    disk = str(tmp_path)
    if loaders._on_tmpfs(disk):
        pytest.skip(f"{disk} is on tmpfs: no disk directory to stage on")
    loader, why = loaders.choose("auto", probe=GPU_NODE, engine_device="cuda", staging_dir=disk)
    assert loader.name == "kvikio" and "disk" in why
    no_kvikio = loaders.GpuProbe(devices=8, libcuda="", cupy=True, kvikio=False)
    loader, _ = loaders.choose("auto", probe=no_kvikio, engine_device="cuda", staging_dir=disk)
    assert loader.name == "cuda-pinned"


@pytest.mark.parametrize(
    ("probe", "says"),
    [
        (loaders.GpuProbe(0, "not looked for (no device)", True, True), "no /dev/nvidiaN"),
        (loaders.GpuProbe(1, "libcuda.so.1: cannot open shared object file", True, True), "driver library"),
        (loaders.GpuProbe(1, "", False, False), "cupy is not installed"),
    ],
)
def test_auto_falls_back_to_host_and_says_why(probe: loaders.GpuProbe, says: str) -> None:
    loader, why = loaders.choose("auto", probe=probe, engine_device="cuda")
    assert loader.name == "host" and says in why
    with pytest.raises(LoaderUnavailable, match="cannot run on this node") as err:
        loaders.choose("cuda-pinned", probe=probe)
    assert says in str(err.value)


def test_kvikio_needs_kvikio() -> None:
    with pytest.raises(LoaderUnavailable, match="kvikio is not installed"):
        loaders.choose("kvikio", probe=loaders.GpuProbe(1, "", True, False))
    loader, _ = loaders.choose("kvikio", probe=GPU_NODE)  # built, not loaded: nothing imported yet
    assert isinstance(loader, loaders.KvikioLoader)


@pytest.mark.skipif(not _no_gpu_reason(), reason="needs a machine without a GPU")
def test_this_cpu_node_picks_host_and_refuses_gpu_loaders_with_the_real_reason() -> None:
    loader, why = loaders.choose("auto")
    assert loader.name == "host" and "no GPU on this node" in why
    for name in loaders.GPU_LOADERS:
        with pytest.raises(LoaderUnavailable, match="no GPU on this node"):
            loaders.choose(name)


@pytest.mark.skipif(not _no_gpu_reason(), reason="needs a machine without a GPU")
def test_the_agent_refuses_a_gpu_loader_at_start_with_the_reason(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "agent", "--node", "n1", "--model", str(tmp_path), "--loader",
         "cuda-pinned"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 2
    assert "cannot run on this node: no GPU on this node" in r.stderr and "--loader host or auto" in r.stderr


@pytest.mark.skipif(not _no_gpu_reason(), reason="needs a machine without a GPU")
def test_the_gpu_check_script_fails_fast_and_clearly_without_a_gpu() -> None:
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi on this machine's PATH either way
    r = subprocess.run(["bash", "tests/gpu/run.sh"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stderr.startswith("no GPU: ") and r.stdout == ""


@pytest.mark.skipif(not _no_gpu_reason(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("loader", loaders.GPU_LOADERS)
def test_the_loader_bench_exits_with_the_no_gpu_code(loader: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "activate", "--loader", loader, "--size", "1MB"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == bench_loader.NO_GPU_EXIT and r.stderr.startswith("no GPU: ")


def _loader_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "activate", "--loader", "host", *args, "--shm-dir", "/dev/shm"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_the_loader_bench_measures_the_host_loader_and_skips_what_does_not_fit() -> None:
    too_big = 2**50  # more than /dev/shm holds
    r = _loader_bench("--size", f"8MB,3MB,{too_big}", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is the one object; the per-size progress went to stderr
    assert doc["bench"] == "activate" and doc["loader"] == "host" and doc["dir"] == "/dev/shm"
    assert (doc["link"], doc["link_limit_gbps"], doc["repeats"]) == ("host memory", None, 2)
    assert doc["sizes_bytes"] == [8_000_000, 3_000_000, too_big]
    assert [res["size_bytes"] for res in doc["results"]] == [8_000_000, 3_000_000]
    for res in doc["results"]:
        assert res["loader"] == "host" and res["pin"] is None and res["link_fraction_p50"] is None
        assert res["loads"] == 2  # --repeats; the first, verified, load is not counted
        assert all(math.isfinite(x) and x > 0 for x in (res["p50_gbps"], res["best_gbps"])), res
        assert res["p50_gbps"] <= res["best_gbps"]
    [skip] = doc["skipped"]
    assert skip["size_bytes"] == too_big and 0 <= skip["free_bytes"] < too_big
    assert skip["reason"].startswith("/dev/shm has ")


def test_the_loader_bench_text_report_summarises_each_size() -> None:
    r = _loader_bench("--size", "8MB,3MB", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("loader host: weights in /dev/shm; yardstick host memory\n")
    assert r.stdout.count("GB/s p50") == 4  # two sizes, each printed and summarised
    assert "\nsummary (host memory):\n" in r.stdout


# --- on a GPU -------------------------------------------------------------------------------------------------------


@pytest.fixture(name="weights_file")
def weights_file_fixture() -> Iterator[loaders.VerifiedFile]:
    """A small safetensors file in /dev/shm with tensors of several dtypes and odd sizes, as a verified fd."""
    tensors = {
        "a": np.arange(1000, dtype=np.float32),
        "b": np.arange(3 * 5 * 7, dtype=np.float16).reshape(3, 5, 7),
        "c": np.arange(70_000_001 // 8, dtype=np.int64),
        "d": np.array([True, False, True]),
    }
    header, data, at = {}, [], 0
    dtypes = {np.float32: "F32", np.float16: "F16", np.int64: "I64", np.bool_: "BOOL"}
    for name, arr in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": dtypes[arr.dtype.type], "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        data.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path = Path("/dev/shm") / f"pulsescale-gpu-test-{os.getpid()}.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(data))
    try:
        vf = bench_loader._open_verified(path)
        try:
            yield vf
        finally:
            os.close(vf.fd)
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("pin", ["always", "never"])
def test_cuda_pinned_puts_every_tensor_on_the_gpu(weights_file: loaders.VerifiedFile, pin: str) -> None:
    loader = loaders.CudaPinnedLoader(chunk_bytes=2**20, streams=3, pin=pin)
    loader.prepare([weights_file])
    w = loader.load([weights_file], private=True)
    try:
        assert w.device.startswith("cuda") and w.mode == ("pinned" if pin == "always" else "pageable"), w.detail
        bench_loader._verify(w, weights_file, full=True)
    finally:
        w.release()


@pytest.mark.gpu
@requires_gpu
def test_kvikio_reads_the_verified_file_and_says_which_mode_ran(weights_file: loaders.VerifiedFile) -> None:
    pytest.importorskip("kvikio", reason="kvikio not installed (pip install '.[gpu]')")
    w = loaders.KvikioLoader(chunk_bytes=2**20).load([weights_file], private=True)
    try:
        assert w.mode in ("gds", "compat") and w.detail
        bench_loader._verify(w, weights_file, full=True)
    finally:
        w.release()


@pytest.mark.gpu
@requires_gpu
def test_cuda_pinned_loads_in_a_child_forked_after_prepare(weights_file: loaders.VerifiedFile) -> None:
    """The zygote imports cupy in `prepare`, then forks: CUDA must start in the child only."""
    loader = loaders.CudaPinnedLoader()
    loader.prepare([weights_file])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            w = loader.load([weights_file], private=True)
            bench_loader._verify(w, weights_file, full=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
