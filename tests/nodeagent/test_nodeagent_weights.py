"""Weights: the safetensors header validator (table-driven), make-tiny, staging with sha256 checks, mlock."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from nodeagent import modelformat, staging, tinymodel
from nodeagent.engine import loaders, local, safetensors_check
from nodeagent.errors import BadModel, BadWeights
from warmpool.sizes import parse_size


def st_bytes(header: dict[str, object] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def f32(name: str, shape: list[int], begin: int) -> dict[str, object]:
    n = 4 * int(np.prod(shape))
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + n]}}


GOOD = st_bytes({**f32("a", [2, 2], 0), **f32("b", [3], 16)}, bytes(28))

CASES = [
    ("empty file", b"", "truncated"),
    ("short length", b"\x01\x02\x03", "truncated"),
    ("absurd header", st_bytes(b"{}", length=200 * 2**20), "absurd"),
    ("header past the end", st_bytes(b'{"a":1}', length=4096), "truncated"),
    ("zero header", st_bytes(b"", length=0), "header length is 0"),
    ("not json", st_bytes(b"{nope"), "not valid JSON"),
    ("not utf-8", st_bytes(b'{"\xff":1}'), "not UTF-8"),
    ("json list", st_bytes(b"[1, 2]"), "not an object"),
    (
        "unknown dtype",
        st_bytes({"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "unknown dtype",
    ),
    ("bad shape", st_bytes({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "shape"),
    ("bad offsets", st_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)), "data_offsets"),
    (
        "reversed offsets",
        st_bytes({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, bytes(4)),
        "end before",
    ),
    ("truncated data", GOOD[:-5], "truncated"),
    ("out of range", st_bytes(f32("a", [4], 8), bytes(8)), "out of range"),
    ("span mismatch", st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "needs 12"),
    ("overlap", st_bytes({**f32("a", [2], 0), **f32("b", [2], 4)}, bytes(12)), "overlaps"),
    ("gap", st_bytes({**f32("a", [1], 0), **f32("b", [1], 8)}, bytes(12)), "gap"),
    ("trailing bytes", st_bytes(f32("a", [1], 0), bytes(9)), "after the last tensor"),
    ("duplicate name", st_bytes(b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{}}'), "twice"),
    ("bad metadata", st_bytes({"__metadata__": {"k": 1}}), "__metadata__"),
    ("metadata list", st_bytes({"__metadata__": []}), "__metadata__"),
    ("metadata null", st_bytes({"__metadata__": None}), "__metadata__"),
    ("metadata false", st_bytes({"__metadata__": False}), "__metadata__"),
    ("deep nesting", st_bytes(b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"), "nested too deeply"),
]


@pytest.mark.parametrize(("name", "data", "needle"), CASES, ids=[c[0] for c in CASES])
def test_header_refusals_name_the_file_and_the_reason(tmp_path: Path, name: str, data: bytes, needle: str) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    with pytest.raises(BadWeights) as err:
        safetensors_check.read_header(path)
    assert err.value.file == "w.safetensors"
    assert needle in err.value.reason, err.value.reason
    assert str(err.value).startswith("w.safetensors: ")


def test_a_good_header_parses_to_file_offsets(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    path.write_bytes(GOOD)
    hdr = safetensors_check.read_header(path)
    assert [t.name for t in hdr.tensors] == ["a", "b"]
    assert hdr.tensor("b").shape == (3,) and hdr.tensor("b").begin == hdr.data_offset + 16
    assert hdr.data_bytes == 28


def test_make_tiny_writes_standard_safetensors_and_a_sha256sum_manifest(tmp_path: Path) -> None:
    cfg = tinymodel.make_tiny(tmp_path / "m", 2_000_000, shard_bytes=900_000)
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    assert len(files) >= 2 and all(f.stat().st_size <= 1_000_000 for f in files)
    assert abs(cfg.nbytes - 2_000_000) < 100_000
    sums = modelformat.read_manifest(tmp_path / "m")
    assert set(sums) == {f.name for f in files} | {"config.json"}
    for f in files:
        assert hashlib.sha256(f.read_bytes()).hexdigest() == sums[f.name]
        ours = safetensors_check.read_header(f)
        theirs = safetensors.numpy.load_file(str(f))  # the reference implementation reads our files
        assert {t.name for t in ours.tensors} == set(theirs)
    shapes = {t.name: (t.shape, t.dtype) for f in files for t in safetensors_check.read_header(f).tensors}
    local.check_model(local.read_config(tmp_path / "m"), shapes)


@pytest.mark.parametrize(
    ("text", "value"), [("64MB", 64_000_000), ("1GiB", 2**30), ("512k", 512_000), ("1.5GB", 1_500_000_000), ("10", 10)]
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="not a number"):
        parse_size("lots")


def test_manifest_refuses_paths_outside_the_model(tmp_path: Path) -> None:
    (tmp_path / "sha256sums.txt").write_text(f"{'0' * 64}  ../etc/passwd\n")
    with pytest.raises(BadModel, match="plain name"):
        modelformat.read_manifest(tmp_path)
    (tmp_path / "sha256sums.txt").unlink()
    with pytest.raises(BadModel, match=r"no sha256sums\.txt"):
        modelformat.read_manifest(tmp_path)


# --- staging ------------------------------------------------------------------------------------------------------


def test_stage_copies_verifies_and_reuses_a_good_copy(model_dir: Path, shm_dir: Path) -> None:
    first = staging.stage(model_dir, shm_dir, "tiny")
    assert all(f.copied for f in first.files)
    assert first.dir == shm_dir / "tiny"
    for f in first.files:
        assert f.path.read_bytes() == (model_dir / f.name).read_bytes()
    assert not list(first.dir.glob(".*partial"))
    again = staging.stage(model_dir, shm_dir, "tiny")
    assert not any(f.copied for f in again.files)  # verified in place, not copied again


def test_checksum_mismatch_names_the_file_and_stages_nothing_bad(model_dir: Path, shm_dir: Path) -> None:
    victim, other = sorted(p.name for p in model_dir.glob("*.safetensors"))
    data = bytearray((model_dir / victim).read_bytes())
    data[-1] ^= 0xFF
    (model_dir / victim).write_bytes(bytes(data))
    with pytest.raises(BadWeights) as err:
        staging.stage(model_dir, shm_dir, "tiny")
    assert err.value.file == victim and "sha256 mismatch" in err.value.reason
    assert not (shm_dir / "tiny" / victim).exists()
    assert not list((shm_dir / "tiny").glob(".*partial"))
    # All or nothing: the good file copied alongside is not put in place without the rest of its set.
    assert not (shm_dir / "tiny" / other).exists()


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _rewrite_model(model_dir: Path, **kw: int) -> None:
    """Replace the model in `model_dir` by another version (other weights, or another file set)."""
    for p in model_dir.iterdir():
        p.unlink()
    tinymodel.make_tiny(model_dir, 1_000_000, **{"shard_bytes": 600_000, **kw})


def test_a_failed_restage_leaves_the_complete_old_set(model_dir: Path, shm_dir: Path) -> None:
    v1 = staging.stage(model_dir, shm_dir, "tiny")
    before = _digests(shm_dir / "tiny")
    _rewrite_model(model_dir, seed=1)  # v2: the same files, other weights
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    last = model_dir / shards[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0x01  # ...and its last shard arrives corrupt
    last.write_bytes(bytes(data))
    with pytest.raises(BadWeights) as err:
        staging.stage(model_dir, shm_dir, "tiny", threads=1)  # the good shard is copied before the bad one fails
    assert err.value.file == shards[-1]
    assert _digests(shm_dir / "tiny") == before  # not a mix of v1 and v2
    # The model the caller keeps (v1) is still what the paths hold, and still checks out.
    staging.check_staged(v1)
    # A bad check (the engine's config against the new tensors) replaces nothing either.
    last.write_bytes(bytes(data[:-1] + bytes([data[-1] ^ 0x01])))
    with pytest.raises(ValueError, match="vetoed"):
        staging.stage(model_dir, shm_dir, "tiny", check=_veto)
    assert _digests(shm_dir / "tiny") == before
    v2 = staging.stage(model_dir, shm_dir, "tiny")
    assert v2.version != v1.version and _digests(shm_dir / "tiny") == modelformat.read_manifest(model_dir)


def _veto(pending: staging.Staged) -> None:
    assert any(f.path.name.endswith(".partial") for f in pending.files)  # vetted before anything is renamed
    raise ValueError("vetoed")


def test_staging_removes_old_versions_and_killed_copies(model_dir: Path, shm_dir: Path) -> None:
    staging.stage(model_dir, shm_dir, "tiny")
    stale = shm_dir / "tiny" / ".model-00001-of-00002.safetensors.partial"
    stale.write_bytes(b"x" * 1000)  # a copy SIGKILLed mid-way
    _rewrite_model(model_dir, shard_bytes=2**30)  # v2 comes in one shard: the two old shards are not part of it
    staged = staging.stage(model_dir, shm_dir, "tiny")
    assert sorted(p.name for p in (shm_dir / "tiny").iterdir()) == sorted(f.name for f in staged.files)
    assert sorted(f.name for f in staged.files) == sorted(modelformat.read_manifest(model_dir))
    stale.write_bytes(b"x")
    staging.stage(model_dir, shm_dir, "tiny")  # a re-verify that copies nothing sweeps too
    assert not stale.exists()


def test_a_verified_staged_copy_survives_a_damaged_source(model_dir: Path, shm_dir: Path) -> None:
    good = staging.stage(model_dir, shm_dir, "tiny")
    victim = good.weights[0]
    before = victim.path.read_bytes()
    (model_dir / victim.name).write_bytes(b"garbage")
    again = staging.stage(model_dir, shm_dir, "tiny")  # the staged copy matches the manifest: kept, not re-copied
    assert not any(f.copied for f in again.files)
    assert victim.path.read_bytes() == before


def test_truncated_weights_with_a_matching_manifest_are_refused(model_dir: Path, shm_dir: Path) -> None:
    name = sorted(model_dir.glob("*.safetensors"))[0].name
    path = model_dir / name
    path.write_bytes(path.read_bytes()[:-1000])
    sums = modelformat.read_manifest(model_dir)
    sums[name] = hashlib.sha256(path.read_bytes()).hexdigest()  # the manifest agrees: only the header check catches it
    modelformat.write_manifest(model_dir, sums)
    with pytest.raises(BadWeights) as err:
        staging.stage(model_dir, shm_dir, "tiny")
    assert err.value.file == name and "truncated" in err.value.reason
    assert not (shm_dir / "tiny" / name).exists()


def test_a_missing_file_is_named(model_dir: Path, shm_dir: Path) -> None:
    name = sorted(model_dir.glob("*.safetensors"))[-1].name
    (model_dir / name).unlink()
    with pytest.raises(BadWeights, match=f"{name}: listed in sha256sums.txt but missing"):
        staging.stage(model_dir, shm_dir, "tiny")


def _may_lock_freely() -> bool:
    """CAP_IPC_LOCK (bit 14 of the effective capabilities) or an unlimited RLIMIT_MEMLOCK."""
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY:
        return True
    with open("/proc/self/status") as f:
        caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
    return bool(int(caps, 16) >> 14 & 1)


@pytest.mark.root
@pytest.mark.skipif(
    not _may_lock_freely(),
    reason="needs CAP_IPC_LOCK (root) or an unlimited RLIMIT_MEMLOCK to lock more than the default 8 MiB",
)
def test_lock_reports_locked_bytes(model_dir: Path, shm_dir: Path) -> None:
    staged = staging.stage(model_dir, shm_dir, "tiny")
    locked = staging.lock([f.path for f in staged.weights])
    try:
        assert locked.error is None and locked.locked
        assert locked.locked_bytes == staged.weights_bytes
    finally:
        locked.release()


def _let_nobody_read(shm_dir: Path, staged: staging.Staged) -> None:
    """Staging makes everything the agent's alone (0700/0600); these tests hand the files to a `nobody` child."""
    os.chmod(shm_dir, 0o755)
    os.chmod(staged.dir, 0o755)
    for f in staged.files:
        os.chmod(f.path, 0o644)


def test_a_refused_lock_says_why_and_runs_unlocked(model_dir: Path, shm_dir: Path) -> None:
    staged = staging.stage(model_dir, shm_dir, "tiny")
    _let_nobody_read(shm_dir, staged)
    # A child without CAP_IPC_LOCK and a 64 KiB RLIMIT_MEMLOCK: as root we drop to `nobody` to lose the capability.
    code = textwrap.dedent(
        f"""
        import json, os, resource
        from pathlib import Path
        from nodeagent import staging
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        locked = staging.lock([Path(p) for p in {[str(f.path) for f in staged.weights]!r}])
        print(json.dumps({{"error": locked.error, "locked": locked.locked_bytes, "mapped": locked.mapped_bytes}}))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["locked"] == 0 and out["mapped"] == staged.weights_bytes
    assert "mlock refused" in out["error"] and "RLIMIT_MEMLOCK is 0.1 MiB" in out["error"]
    assert "CAP_IPC_LOCK" in out["error"]


def test_a_relock_never_counts_the_weights_twice(model_dir: Path, shm_dir: Path) -> None:
    """Re-prewarm with RLIMIT_MEMLOCK between 1x and 2x the weights: unchanged files keep their lock, changed
    ones are unlocked before the new copies are locked, so the weights stay locked."""
    staged = staging.stage(model_dir, shm_dir, "tiny")
    _let_nobody_read(shm_dir, staged)
    os.chmod(staged.dir, 0o777)  # the child (nobody, as root) replaces a file
    limit = staged.weights_bytes * 3 // 2
    code = textwrap.dedent(
        f"""
        import json, os, resource, shutil
        from pathlib import Path
        from nodeagent import staging
        resource.setrlimit(resource.RLIMIT_MEMLOCK, ({limit}, {limit}))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        paths = [Path(p) for p in {[str(f.path) for f in staged.weights]!r}]
        out = {{}}
        first = staging.lock(paths)
        out["first"] = first.locked
        same = staging.lock(paths, previous=first)  # nothing changed: the mappings are kept
        out["same"] = same.locked and first.mapped_bytes == 0
        tmp = paths[0].with_name("new")
        shutil.copyfile(paths[0], tmp)
        os.replace(tmp, paths[0])  # a re-stage put a new copy (new inode) in place
        changed = staging.lock(paths, previous=same)
        out["changed"] = changed.locked
        out["error"] = changed.error
        changed.release()
        print(json.dumps(out))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"first": True, "same": True, "changed": True, "error": None}


# --- loader -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 3])
def test_host_loader_maps_in_place_or_copies_the_same_tensors(model_dir: Path, shm_dir: Path, threads: int) -> None:
    staged = staging.stage(model_dir, shm_dir, "tiny")
    files = loaders.verified_files(staged.engine_weights())
    loader = loaders.HostLoader(copy_threads=threads)
    mapped = loader.load(files, private=False)
    copied = loader.load(files, private=True)
    try:
        assert (mapped.mode, copied.mode) == ("mapped", "copied")
        assert mapped.nbytes == copied.nbytes == staged.weights_bytes - sum(h.data_offset for h in _headers(staged))
        assert set(mapped.tensors) == set(copied.tensors)
        for name, arr in mapped.tensors.items():
            assert not arr.flags.writeable  # the shm pages are shared with every engine: read-only
            np.testing.assert_array_equal(arr, copied.tensors[name])
        assert copied.tensors["tok_emb"].flags.writeable
    finally:
        mapped.release()
        copied.release()


def _dev_ino_size(fd: int) -> tuple[int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size


def _headers(staged: staging.Staged) -> list[safetensors_check.Header]:
    return [f.header for f in staged.weights if f.header is not None]


NO_GPU = loaders.GpuProbe(devices=0, libcuda="not looked for (no device)", cupy=False, kvikio=False)
"""What `probe_gpu` finds on a node without a GPU: handed to `choose`, so the test runs on any machine."""


def test_auto_picks_host_and_gpu_loaders_are_refused_without_a_gpu() -> None:
    loader, why = loaders.choose("auto", probe=NO_GPU)
    assert loader.name == "host" and "no GPU on this node" in why
    with pytest.raises(loaders.LoaderUnavailable, match=r"cannot run on this node: no GPU"):
        loaders.choose("cuda-pinned", probe=NO_GPU)


def test_on_this_machine_choose_follows_what_the_probe_finds() -> None:
    """The real probe, with or without a GPU: a CPU engine always gets ``host``, and a GPU loader asked for by name
    is refused exactly when the probe says it cannot run."""
    probe = loaders.probe_gpu()
    loader, why = loaders.choose("auto", probe=probe)
    assert loader.name == "host" and why
    refused = probe.unavailable("cuda-pinned")
    if refused:
        with pytest.raises(loaders.LoaderUnavailable, match="cannot run on this node"):
            loaders.choose("cuda-pinned", probe=probe)
    else:
        assert loaders.choose("cuda-pinned", probe=probe)[0].name == "cuda-pinned"


def test_the_tiny_model_really_computes_from_its_weights(model_dir: Path) -> None:
    fds = [os.open(p, os.O_RDONLY) for p in sorted(model_dir.glob("*.safetensors"))]
    try:
        files = [loaders.VerifiedFile(str(fd), fd, *_dev_ino_size(fd)) for fd in fds]
        w = loaders.HostLoader().load(files, private=True)
    finally:
        for fd in fds:
            os.close(fd)
    model = local.TinyMoE(local.read_config(model_dir), w.tensors)
    text, finish = model.generate(b"hello", 12, [])
    assert len(text) == 12 and finish == "length" and all(32 <= b < 127 for b in text)
    assert model.generate(b"hello", 12, [])[0] == text  # greedy: deterministic
    w.tensors["lm_head"][:] = 0  # the output comes from the weights: flat logits give the first printable byte
    assert model.generate(b"hello", 3, []) == (b"   ", "length")
