"""Issue 8, the node agent's weights path and engine process, tested as a local attacker would try it.

The agent runs as root and ``/dev/shm`` is writable by every local user. An attacker is simulated with what such a
user can make: directories and links owned by ``nobody`` (uid 65534, via ``os.chown``), and files swapped under
the agent between staging and the engine's load. Everything is real: files in /dev/shm, zygotes and engines as
processes, a nats-server for the agent-level test.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import stat
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client

from nodeagent import modelformat, readiness, staging
from nodeagent.engine import safetensors_check
from nodeagent.errors import BadModel, BadWeights, EngineFailed, UnsafeStagingDir
from nodeagent.forked import ForkedEngine
from tests.nodeagent_helpers import (
    MODEL,
    alive,
    key,
    request,
    running_agent,
    settings,
    wait_for,
    wait_state,
)
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the attacker and the engines are another uid")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Files of someone else that the agent must never write, map or delete."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    (d / "model-00001-of-00002.safetensors").write_text("not weights")
    return d


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --- finding 1: the shm directory is the agent's own ---------------------------------------------------------------


@needs_root
def test_a_shm_dir_made_by_another_user_is_refused(model_dir: Path, shm_dir: Path) -> None:
    theirs = shm_dir / "pulsescale"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafeStagingDir, match=r"owned by uid 65534.*rm -rf"):
        staging.stage(model_dir, theirs, MODEL)
    assert list(theirs.iterdir()) == []  # nothing staged into it


@needs_root
def test_a_model_dir_that_is_a_link_is_refused_and_its_target_survives(
    model_dir: Path, shm_dir: Path, victim: Path
) -> None:
    before = _files(victim)
    link = shm_dir / MODEL
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UnsafeStagingDir, match="symbolic link"):
        staging.stage(model_dir, shm_dir, MODEL)
    assert _files(victim) == before  # nothing written there, nothing swept away
    assert link.is_symlink()  # and the agent did not "fix" it by following it either


def test_a_shm_dir_in_a_directory_others_can_rewrite_is_refused(model_dir: Path, shm_dir: Path) -> None:
    os.chmod(shm_dir, 0o777)  # world-writable without the sticky bit: anyone could swap our directory
    with pytest.raises(UnsafeStagingDir, match="sticky"):
        staging.stage(model_dir, shm_dir / "pulsescale", MODEL)


def test_links_planted_in_the_model_dir_are_removed_as_links_never_followed(
    model_dir: Path, shm_dir: Path, victim: Path
) -> None:
    first = staging.stage(model_dir, shm_dir, MODEL)
    first.close()
    staged_dir = shm_dir / MODEL
    shard = sorted(model_dir.glob("*.safetensors"))[0].name
    # The attacker's copy of a real shard: it matches the manifest, but its owner can rewrite it at any time.
    bait = victim / "bait.safetensors"
    shutil.copyfile(model_dir / shard, bait)
    before = _files(victim)
    (staged_dir / shard).unlink()
    (staged_dir / shard).symlink_to(bait)
    (staged_dir / "stray.bin").symlink_to(victim / "precious.txt")
    (staged_dir / ".config.json.partial").symlink_to(victim / "precious.txt")  # a "killed copy" to sweep

    again = staging.stage(model_dir, shm_dir, MODEL)  # a fresh agent: nothing carried over
    try:
        st = os.lstat(staged_dir / shard)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()  # a copy of ours replaced the link
        assert os.fstat(next(f.fd for f in again.files if f.name == shard)).st_ino == st.st_ino
        assert not os.path.lexists(staged_dir / "stray.bin")
        assert not os.path.lexists(staged_dir / ".config.json.partial")
        assert _files(victim) == before  # every target intact
    finally:
        again.close()


# --- finding 3: staged weights are the agent's alone ---------------------------------------------------------------


def test_staged_files_are_0600_in_0700_directories(model_dir: Path, shm_dir: Path) -> None:
    staged = staging.stage(model_dir, shm_dir / "pulsescale", MODEL)  # made by the agent
    try:
        for d in (shm_dir / "pulsescale", staged.dir):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        for f in staged.files:
            assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600, f.name
    finally:
        staged.close()
    again = staging.stage(model_dir, shm_dir, MODEL)  # an existing directory of ours, made 0755: tightened
    try:
        assert stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o700
    finally:
        again.close()


# --- finding 4: the source directory's links are refused; mismatch reasons name no digest --------------------------


def test_a_weights_file_that_is_a_link_in_the_model_dir_is_refused(
    model_dir: Path, shm_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    shutil.move(model_dir / modelformat.CONFIG_FILE, elsewhere)  # same bytes: the manifest still matches
    (model_dir / modelformat.CONFIG_FILE).symlink_to(elsewhere)
    with pytest.raises(BadWeights, match=r"config\.json: is a symbolic link"):
        staging.stage(model_dir, shm_dir, MODEL)


def test_a_manifest_that_is_a_link_is_refused(model_dir: Path, shm_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "sums.txt"
    shutil.move(model_dir / modelformat.MANIFEST_FILE, elsewhere)
    (model_dir / modelformat.MANIFEST_FILE).symlink_to(elsewhere)
    with pytest.raises(BadModel, match=r"sha256sums\.txt is a symbolic link"):
        staging.stage(model_dir, shm_dir, MODEL)


def test_a_checksum_mismatch_does_not_say_what_the_file_hashes_to(model_dir: Path, shm_dir: Path) -> None:
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x01")
    observed = hashlib.sha256(shard.read_bytes()).hexdigest()
    with pytest.raises(BadWeights, match="sha256 mismatch") as err:
        staging.stage(model_dir, shm_dir, MODEL)
    assert observed[:8] not in str(err.value)  # the reason lands in KV, readable by every gateway


# --- finding 2: the bytes an engine maps are the bytes staging verified --------------------------------------------


def _spec(staged: staging.Staged, **kw: Any) -> dict[str, Any]:
    return {
        "engine": "local",
        "loader": "host",
        "model_dir": str(staged.dir),
        "files": [str(f.path) for f in staged.weights],
        "weights": staged.engine_weights(),
        "model_name": MODEL,
        "host": "127.0.0.1",
        "private": False,
        "fault": None,
        "slot": "s0",
        **kw,
    }


@pytest.fixture
def staged(model_dir: Path, shm_dir: Path) -> Iterator[staging.Staged]:
    out = staging.stage(model_dir, shm_dir, MODEL)
    yield out
    out.close()


@pytest.fixture
async def engines() -> AsyncIterator[list[ForkedEngine]]:
    made: list[ForkedEngine] = []
    yield made
    for e in made:
        await e.close()


async def _answer(engine: ForkedEngine) -> tuple[str, int]:
    """Start the engine, take one greedy completion, stop it: (text, bytes it loaded)."""
    started = await engine.start(timeout_s=10)
    async with aiohttp.ClientSession() as s:
        await readiness.check(s, started.endpoint, MODEL, timeout_s=5)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 12}
        async with s.post(f"{started.endpoint}/v1/completions", json=body) as r:
            assert r.status == 200
            text = str((await r.json())["choices"][0]["text"])
    await engine.stop()
    return text, started.loaded_bytes


def _swap_in_zeroed_copy(path: Path) -> None:
    """Rename a file with the same header and all-zero tensors over `path` (what a writer of the directory could
    do between the hash and the load): same name, same size, other bytes, a new inode."""
    header = safetensors_check.read_header(path)
    data = path.read_bytes()
    fake = path.with_name("swap.tmp")
    fake.write_bytes(data[: header.data_offset] + bytes(len(data) - header.data_offset))
    os.replace(fake, path)


@pytest.mark.parametrize("private", [False, True])
async def test_a_file_swapped_after_staging_is_never_served(
    staged: staging.Staged, engines: list[ForkedEngine], private: bool
) -> None:
    first = ForkedEngine(_spec(staged, private=private), name="s0", advertise_host="127.0.0.1")
    engines.append(first)
    await first.arm()
    verified, nbytes = await _answer(first)
    await first.close()
    for f in staged.weights:
        _swap_in_zeroed_copy(f.path)
    # A zygote armed after the swap, from the same spec: it maps the verified descriptors, not the names.
    second = ForkedEngine(_spec(staged, private=private), name="s0", advertise_host="127.0.0.1")
    engines.append(second)
    await second.arm()
    assert await _answer(second) == (verified, nbytes)


async def test_an_engine_refuses_a_descriptor_that_is_not_the_verified_file(
    staged: staging.Staged, engines: list[ForkedEngine]
) -> None:
    spec = _spec(staged)
    spec["weights"] = [{**w, "ino": w["ino"] + 1} for w in spec["weights"]]  # what staging verified differs
    engine = ForkedEngine(spec, name="s0", advertise_host="127.0.0.1")
    engines.append(engine)
    with pytest.raises(EngineFailed, match=r"WeightsChanged.*refusing to load weights that were not verified"):
        await engine.arm()


# --- finding 6: engines do not run as root -------------------------------------------------------------------------


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _unprivileged(pid: int) -> None:
    st = _status(pid)
    assert st["Uid"].split() == [str(NOBODY)] * 4, st["Uid"]
    assert st["Gid"].split() == [str(NOBODY)] * 4, st["Gid"]
    assert st["Groups"].strip() == ""
    assert st["NoNewPrivs"].strip() == "1"


@needs_root
async def test_the_zygote_and_its_engines_run_as_nobody_with_no_new_privs(
    staged: staging.Staged, engines: list[ForkedEngine]
) -> None:
    engine = ForkedEngine(_spec(staged, private=True), name="s0", advertise_host="127.0.0.1")
    engines.append(engine)
    await engine.arm()
    assert engine.zygote_pid is not None
    _unprivileged(engine.zygote_pid)
    started = await engine.start(timeout_s=10)
    _unprivileged(started.pid)  # and it still read the 0600 weights: through the descriptors it was given
    async with aiohttp.ClientSession() as s:
        await readiness.check(s, started.endpoint, MODEL, timeout_s=5)
    assert all(stat.S_IMODE(os.stat(f.path).st_mode) == 0o600 for f in staged.files)


_AGENT = """
import asyncio, json, sys
from nodeagent.forked import ForkedEngine

async def main():
    engine = ForkedEngine(json.loads(sys.argv[1]), name="s0", advertise_host="127.0.0.1")
    await engine.arm()
    started = await engine.start(timeout_s=10)
    print(engine.zygote_pid, started.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@needs_root
async def test_a_killed_agent_takes_its_unprivileged_zygote_and_engine_with_it(staged: staging.Staged) -> None:
    """Dropped to nobody, the zygote still goes with the agent: stdin EOF, and the parent-death signal that it sets
    again after the change of user clears it."""
    spec = _spec(staged)
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _AGENT,
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        pass_fds=[w["fd"] for w in spec["weights"]],
    )
    try:
        assert agent.stdout is not None
        zygote, engine = (int(x) for x in (await agent.stdout.readline()).split())
        _unprivileged(zygote)
        agent.kill()
        await agent.wait()
        await wait_for(lambda: not alive(zygote) and not alive(engine), 10, "the zygote and engine to die")
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


@needs_root
async def test_an_unknown_engine_user_fails_arming_with_the_fix(
    staged: staging.Staged, engines: list[ForkedEngine]
) -> None:
    engine = ForkedEngine(_spec(staged, engine_user="no-such-user-x"), name="s0", advertise_host="127.0.0.1")
    engines.append(engine)
    with pytest.raises(EngineFailed, match=r"'no-such-user-x' does not exist.*--engine-user"):
        await engine.arm()


# --- finding 5: a prewarm that changes nothing reads nothing and keeps slots warm ----------------------------------


def test_an_unchanged_restage_reads_no_bytes(model_dir: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = staging.stage(model_dir, shm_dir, MODEL)
    assert first.hashed_bytes == first.nbytes
    reads: list[int] = []
    real = staging._hash_fd
    monkeypatch.setattr(staging, "_hash_fd", lambda fd: reads.append(fd) or real(fd))
    again = staging.stage(model_dir, shm_dir, MODEL, previous=first)
    assert reads == [] and again.hashed_bytes == 0 and again.copied_bytes == 0
    assert [f.fd for f in again.files] == [f.fd for f in first.files]  # the same verified descriptors
    first.close(keep=again)
    # A file changed since it verified (its mtime moved) is read again; the rest still is not.
    shard = again.weights[0]
    os.utime(shard.path, ns=(0, 0))
    third = staging.stage(model_dir, shm_dir, MODEL, previous=again)
    assert len(reads) == 1 and third.hashed_bytes == shard.nbytes
    again.close(keep=third)
    third.close()


async def test_a_prewarm_that_changes_nothing_keeps_slots_warm_and_reads_nothing(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url, slots=2)) as (agent, _):
        for slot in ("s0", "s1"):
            await wait_state(store, key(slot), "warm")
        before = agent.staged
        zygotes = [agent.slots[s].engine.zygote_pid for s in ("s0", "s1")]  # type: ignore[union-attr]
        kv = await nc.jetstream().key_value(protocol.SLOTS_BUCKET)
        seen: list[str] = []
        watcher = await kv.watch(f"{MODEL}.>", include_history=False)

        async def watch() -> None:
            async for entry in watcher:
                if entry is not None and entry.value:
                    seen.append(protocol.decode(entry.value, protocol.SlotRecord).state)

        watching = asyncio.create_task(watch())
        try:
            reply = await request(nc, "prewarm")
            assert reply.ok and reply.fields["accepted"] == ["s0", "s1"]
            await wait_for(lambda: agent.staged is not before and not agent.prewarmer.running, 10, "the prewarm")
            # A write after the prewarm, so everything the prewarm wrote has reached the watcher when it arrives.
            await store.set_state(key("s1"), "warm", expect=["warm"], reason="marker")
            await wait_for(lambda: len(seen) > 2, 5, "the initial values and the marker")
        finally:
            watching.cancel()
            await watcher.stop()
        assert set(seen) == {"warm"}, seen  # claimable all along
        assert agent.staged is not None and agent.staged.hashed_bytes == 0
        assert [agent.slots[s].engine.zygote_pid for s in ("s0", "s1")] == zygotes  # type: ignore[union-attr]
        if os.geteuid() == 0:
            for pid in zygotes:
                assert pid is not None
                _unprivileged(pid)  # the agent's own zygotes too (engine_user defaults to nobody)
