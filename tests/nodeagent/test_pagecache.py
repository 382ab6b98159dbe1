"""Page-cache residency (`nodeagent.pagecache`): measured with mincore, warmed with fadvise + reads, on real files of
a disk-backed filesystem (tmp_path; tmpfs pages cannot be dropped, so a drop there would prove nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent import pagecache
from tests.helpers import can_lock, without_ipc_lock

MiB = 1 << 20


def _tree(root: Path) -> dict[str, int]:
    """A small tree: files of several sizes (an empty one, a partial last page), flushed so a drop can evict them."""
    sizes = {"a.bin": 3 * MiB, "sub/b.py": 12_345, "sub/deeper/c.so": MiB + 1, "empty": 0}
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())  # a dirty page is never dropped: make them clean
    return sizes


@pytest.fixture(name="tree")
def tree_fixture(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    _tree(root)
    pagecache.drop(root)
    if pagecache.residency(root).pct > 50:
        pytest.skip(f"{root}: this filesystem does not drop clean pages on POSIX_FADV_DONTNEED (tmpfs?)")
    return root


def test_residency_counts_pages_of_regular_files_only(tree: Path) -> None:
    (tree / "link").symlink_to(tree / "a.bin")
    os.mkfifo(tree / "fifo")
    res = pagecache.residency(tree)
    page = pagecache.PAGE_BYTES
    want_pages = sum(-(-n // page) for n in (3 * MiB, 12_345, MiB + 1))
    assert res.files == 4  # the empty file counts as a file with no pages; link and fifo are not walked
    assert res.pages == want_pages
    assert res.bytes == want_pages * page


def test_warm_brings_a_dropped_tree_to_full_residency(tree: Path) -> None:
    before = pagecache.residency(tree)
    assert before.pct < 50, before
    warmed = pagecache.warm(tree)
    assert warmed.files == 4 and warmed.skipped == 0
    assert warmed.read_bytes == 3 * MiB + 12_345 + MiB + 1
    after = pagecache.residency(tree)
    assert after.pct >= 99.0, after
    assert after.resident_pages == after.pages


def test_measuring_does_not_warm(tree: Path) -> None:
    """mincore reads nothing: measuring a dropped tree twice gives the same low figure."""
    first = pagecache.residency(tree)
    second = pagecache.residency(tree)
    assert first.resident_pages == second.resident_pages
    assert second.pct < 50


def test_drop_then_warm_again(tree: Path) -> None:
    pagecache.warm(tree)
    assert pagecache.residency(tree).pct >= 99.0
    assert pagecache.drop(tree) == 4
    assert pagecache.residency(tree).pct < 50
    pagecache.warm(tree)
    assert pagecache.residency(tree).pct >= 99.0


def test_a_manifest_warms_only_its_paths(tree: Path) -> None:
    warmed = pagecache.warm(tree, ["sub/b.py", tree / "sub/deeper/c.so"])
    assert warmed.files == 2
    assert pagecache.residency(tree, ["sub/b.py", "sub/deeper/c.so"]).pct >= 99.0
    assert pagecache.residency(tree, ["a.bin"]).pct < 50


def test_a_manifest_naming_a_fifo_a_link_or_a_missing_file_is_skipped_not_blocking(tree: Path) -> None:
    os.mkfifo(tree / "fifo")  # opening a FIFO for reading would block until a writer comes
    (tree / "link").symlink_to(tree / "a.bin")
    warmed = pagecache.warm(tree, ["fifo", "link", "missing", "sub/b.py"])
    assert (warmed.files, warmed.skipped) == (1, 3)
    res = pagecache.residency(tree, ["fifo", "link", "missing", "sub/b.py"])
    assert (res.files, res.unreadable) == (1, 3)
    assert pagecache.residency(tree, ["a.bin"]).pct < 50  # the link was not followed


def test_an_empty_set_is_fully_resident(tmp_path: Path) -> None:
    assert pagecache.residency(tmp_path).pct == 100.0


def test_a_pinned_tree_is_read_in_and_stays_resident_through_a_drop_until_released(tree: Path) -> None:
    """What a warm tree cannot promise: pages a drop (or the kernel's own proactive page-out) would evict stay,
    because they are locked; released, they go again."""
    if not can_lock(5 * MiB):
        pytest.skip("no CAP_IPC_LOCK and RLIMIT_MEMLOCK under 5 MiB: mlock would be refused")
    pinned = pagecache.pin(tree)
    try:
        assert pinned.refused is None
        assert pinned.files == 3 and pinned.bytes == 3 * MiB + 12_345 + MiB + 1  # the empty file maps nothing
        assert pagecache.residency(tree).pct == 100.0  # the lock read them in
        assert pagecache.drop(tree) == 4
        assert pagecache.residency(tree).pct == 100.0
    finally:
        pinned.release()
    pinned.release()  # idempotent
    pagecache.drop(tree)
    assert pagecache.residency(tree).pct < 50


def test_a_refused_lock_says_why_and_pins_nothing_more(tree: Path) -> None:
    """Without CAP_IPC_LOCK and over RLIMIT_MEMLOCK the first lock is refused: said, and the rest not tried."""

    code = (
        "import resource, sys; from nodeagent import pagecache\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))\n"
        "p = pagecache.pin(sys.argv[1]); print(p.files, p.bytes, p.refused)\n"
    )
    # With CAP_IPC_LOCK it locks whatever the limit: the child runs without it.
    argv = without_ipc_lock([sys.executable, "-c", code, str(tree)])
    if argv is None:
        pytest.skip("CAP_IPC_LOCK held and no setpriv (util-linux) to drop it for the child")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    out = done.stdout.split(maxsplit=2)
    assert out[:2] == ["0", "0"], out
    assert out[2].startswith("mlock of ") and "not permitted" in out[2], out
