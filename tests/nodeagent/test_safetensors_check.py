"""The safetensors header check, beyond the refusal table in test_nodeagent_weights.py: zero-size tensors, files
that cannot be read, entries that are not objects, refusals that name the tensor, the metadata, the edges of the
header length and the data buffer."""

from __future__ import annotations

import errno
import io
import json
import os
import struct
from pathlib import Path

import pytest

from nodeagent.engine import safetensors_check
from nodeagent.engine.safetensors_check import MAX_HEADER_BYTES, parse_header, read_header
from nodeagent.errors import BadWeights

NAME = "model.layers.0.mlp.weight"


def st_file(header: dict[str, object] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype: object, shape: object, begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def parse(data: bytes, *, file_bytes: int | None = None) -> safetensors_check.Header:
    return parse_header(io.BytesIO(data), len(data) if file_bytes is None else file_bytes, file="w.safetensors")


def refusal(data: bytes, *, file_bytes: int | None = None) -> str:
    with pytest.raises(BadWeights) as err:
        parse(data, file_bytes=file_bytes)
    assert err.value.file == "w.safetensors"
    return err.value.reason


def test_zero_size_tensors_are_valid_anywhere() -> None:
    # Real checkpoints carry empty tensors (an unused bias, a [0, n] buffer): they take no bytes and must not be
    # read as a gap, an overlap or an out-of-range offset, at the start, between others or at the very end.
    header = {
        "first": entry("F32", [0], 0, 0),
        "a": entry("F16", [2], 0, 4),
        "middle": entry("I64", [3, 0], 4, 4),
        "b": entry("U8", [4], 4, 8),
        "last": entry("BF16", [0, 7], 8, 8),
    }
    hdr = parse(st_file(header, bytes(8)))
    sizes = {t.name: t.nbytes for t in hdr.tensors}
    assert sizes == {"first": 0, "a": 4, "middle": 0, "b": 4, "last": 0}
    assert hdr.tensor("last").begin == hdr.data_offset + 8 == hdr.file_bytes
    assert hdr.tensor("middle").shape == (3, 0)


def test_a_header_without_tensors_is_a_valid_empty_file() -> None:
    hdr = parse(st_file({}))
    assert hdr.tensors == () and hdr.data_bytes == 0 and hdr.metadata == {}


def test_tensors_are_given_in_file_order_with_file_offsets() -> None:
    # The loaders map each tensor at `begin` of the *file*; JSON order is not file order.
    header = {"late": entry("F32", [1], 8, 12), "early": entry("F32", [2], 0, 8)}
    hdr = parse(st_file(header, bytes(12)))
    assert [t.name for t in hdr.tensors] == ["early", "late"]
    assert (hdr.tensor("early").begin, hdr.tensor("early").end) == (hdr.data_offset, hdr.data_offset + 8)
    assert (hdr.tensor("late").begin, hdr.tensor("late").end) == (hdr.data_offset + 8, hdr.data_offset + 12)
    assert hdr.tensor("late").dtype == "F32" and hdr.tensor("late").nbytes == 4
    assert hdr.data_offset == 8 + len(json.dumps(header).encode())
    assert hdr.file_bytes == hdr.data_offset + 12 and hdr.data_bytes == 12
    with pytest.raises(KeyError, match="absent"):
        hdr.tensor("absent")


def test_metadata_is_kept_and_is_not_a_tensor() -> None:
    header = {"__metadata__": {"format": "pt", "source": "make-tiny"}, NAME: entry("U8", [2], 0, 2)}
    hdr = parse(st_file(header, bytes(2)))
    assert hdr.metadata == {"format": "pt", "source": "make-tiny"}
    assert [t.name for t in hdr.tensors] == [NAME]


@pytest.mark.parametrize(
    ("name", "spec", "data", "needle"),
    [
        ("a list", [1, 2], b"", "entry is not an object"),
        ("a number", 7, b"", "entry is not an object"),
        ("a string", "F32", b"", "entry is not an object"),
        ("null", None, b"", "entry is not an object"),
        ("no dtype", {"shape": [1], "data_offsets": [0, 1]}, bytes(1), "unknown dtype None"),
        ("dtype not a string", entry(4, [1], 0, 4), bytes(4), "unknown dtype 4"),
        ("unknown dtype", entry("F7", [1], 0, 4), bytes(4), "unknown dtype 'F7'"),
        ("shape not a list", entry("U8", 3, 0, 3), bytes(3), "shape 3"),
        ("negative dim", entry("U8", [2, -1], 0, 2), bytes(2), "shape [2, -1]"),
        ("float dim", entry("U8", [1.0], 0, 1), bytes(1), "shape [1.0]"),
        ("bool dim", entry("U8", [True], 0, 1), bytes(1), "shape [True]"),
        ("offsets not a list", {"dtype": "U8", "shape": [1], "data_offsets": 1}, bytes(1), "data_offsets 1"),
        ("three offsets", {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}, bytes(2), "data_offsets"),
        ("negative offset", entry("U8", [0], -1, -1), b"", "data_offsets [-1, -1]"),
        (
            "bool offset",
            {"dtype": "U8", "shape": [1], "data_offsets": [False, True]},
            bytes(1),
            "data_offsets [False, True]",
        ),
        ("reversed", entry("U8", [0], 2, 1), bytes(2), "end before they begin"),
        ("past the buffer", entry("U8", [3], 0, 3), bytes(2), "out of range"),
        ("span too short", entry("I32", [2, 2], 0, 12), bytes(12), "needs 16 bytes but data_offsets span 12"),
        ("span too long", entry("F16", [3], 0, 8), bytes(8), "needs 6 bytes but data_offsets span 8"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_tensor(name: str, spec: object, data: bytes, needle: str) -> None:
    # An operator with a 300-tensor checkpoint needs to know which tensor is wrong, not only which file.
    reason = refusal(st_file({NAME: spec}, data))
    assert f"tensor {NAME!r}" in reason, (name, reason)
    assert needle in reason, (name, reason)


def test_overlaps_and_gaps_name_the_tensors() -> None:
    overlap = refusal(st_file({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, bytes(6)))
    assert "'b'" in overlap and "'a'" in overlap and "overlaps" in overlap
    gap = refusal(st_file({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, bytes(5)))
    assert "gap of 1 bytes before tensor 'b'" in gap
    leading = refusal(st_file({"a": entry("U8", [2], 1, 3)}, bytes(3)))
    assert "gap of 1 bytes before tensor 'a'" in leading
    trailing = refusal(st_file({"a": entry("U8", [2], 0, 2)}, bytes(5)))
    assert "3 bytes after the last tensor" in trailing


@pytest.mark.parametrize(
    ("name", "meta"),
    [("a number value", {"k": 1}), ("a nested object", {"k": {"x": "y"}}), ("a string", "pt"), ("a list", ["pt"])],
)
def test_metadata_must_be_an_object_of_strings(name: str, meta: object) -> None:
    assert "__metadata__" in refusal(st_file({"__metadata__": meta})), name


def test_the_header_length_edges() -> None:
    # 8 bytes are the smallest file that says anything; fewer are truncated, not an unpacking crash.
    assert "not even the 8-byte header length" in refusal(bytes(7))
    assert "header length is 0" in refusal(bytes(8))
    # Exactly the limit is not absurd, only truncated here; one byte over is refused before anything is read.
    assert "truncated" in refusal(st_file(b"{}", length=MAX_HEADER_BYTES))
    assert "absurd" in refusal(st_file(b"{}", length=MAX_HEADER_BYTES + 1))
    # A header that ends exactly at the end of the file is complete; one byte short is truncated.
    assert parse(st_file(b"{}")).data_bytes == 0
    short = st_file(b"{} ")[:-1]
    assert "header says 3 bytes but the file has only 2 after it" in refusal(short)


def test_a_file_shorter_than_its_stated_size_is_truncated() -> None:
    # The size comes from fstat and the bytes from a read: a file cut between the two reads short.
    assert "read 2 of 4 header bytes" in refusal(struct.pack("<Q", 4) + b"{}", file_bytes=100)


def test_a_tensor_named_twice_is_named() -> None:
    twice = (
        b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"' + NAME.encode() + b'":{},"' + NAME.encode() + b'":{}}'
    )
    assert f"names tensor {NAME!r} twice" in refusal(st_file(twice))


def test_unreadable_files_are_refused_by_name(tmp_path: Path) -> None:
    # A missing shard or a directory where a shard should be: a named refusal, never an OSError in the caller.
    with pytest.raises(BadWeights) as err:
        read_header(tmp_path / "missing.safetensors")
    assert err.value.file == "missing.safetensors" and "cannot read" in err.value.reason
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(BadWeights) as err:
        read_header(tmp_path / "dir.safetensors")
    assert err.value.file == "dir.safetensors" and "cannot read" in err.value.reason


def test_read_header_reads_the_file_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(st_file({NAME: entry("F32", [2], 0, 8)}, bytes(8)))
    hdr = read_header(path)
    assert hdr.file == "shard.safetensors" and hdr.file_bytes == path.stat().st_size
    assert hdr.tensor(NAME).end == hdr.file_bytes


# --- read_header_fd: positional reads of a shared descriptor ----------------------------------------------------------


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """A valid shard whose header (about 70 bytes) is longer than the short reads below."""
    path = tmp_path / "shard.safetensors"
    path.write_bytes(st_file({NAME: entry("F32", [2], 0, 8)}, bytes(8)))
    return path


def _short_preads(monkeypatch: pytest.MonkeyPatch, most: int, *, eof: int | None = None) -> list[tuple[int, int]]:
    """Make every ``os.pread`` return at most `most` bytes (a pread may return fewer than asked: a network or FUSE
    file system does), and nothing from offset `eof` on (a file cut while it is read). Returns (asked, offset)
    of each call."""
    calls: list[tuple[int, int]] = []
    real = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        calls.append((n, offset))
        if eof is not None:
            n = min(n, max(eof - offset, 0))
        return real(fd, min(n, most), offset)

    monkeypatch.setattr(os, "pread", pread)
    return calls


def test_read_header_fd_reads_the_header_in_two_preads_and_leaves_the_offset(shard: Path) -> None:
    """One pread for the length and one for the header when the file gives what is asked; the descriptor's
    offset, shared with every process that inherited it, stays where it was."""
    calls: list[tuple[int, int]] = []
    real = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        calls.append((n, offset))
        return real(fd, n, offset)

    with open(shard, "rb") as f, pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "pread", pread)
        f.seek(3)
        hdr = safetensors_check.read_header_fd(f.fileno(), "shard.safetensors")
        assert f.tell() == 3
    assert hdr == read_header(shard)
    header_len = hdr.data_offset - 8
    assert calls == [(8, 0), (header_len, 8)]


@pytest.mark.parametrize("most", [1, 3, 7, 64])
def test_a_read_spanning_several_preads_is_joined_in_order(
    shard: Path, monkeypatch: pytest.MonkeyPatch, most: int
) -> None:
    """Short preads (7 leaves 1 byte of the length for a second call): each continues where the last ended, and
    the pieces join to the bytes of the file."""
    calls = _short_preads(monkeypatch, most)
    fd = os.open(shard, os.O_RDONLY)
    try:
        hdr = safetensors_check.read_header_fd(fd, "shard.safetensors")
    finally:
        os.close(fd)
    assert hdr == read_header(shard)
    # Each call asks for what is still missing, at the offset right after the bytes already read.
    total = hdr.data_offset
    offsets = [offset for _, offset in calls]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert sum(min(n, most) for n, _ in calls) == total
    assert len(calls) == -(-8 // most) + -(-(total - 8) // most)


def test_a_file_cut_while_its_header_is_read_is_truncated(shard: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pread returns nothing at the (new) end: the read stops with what it has, a named refusal follows."""
    size = shard.stat().st_size
    header_len = size - 8 - 8
    _short_preads(monkeypatch, 16, eof=8 + 20)
    fd = os.open(shard, os.O_RDONLY)
    try:
        with pytest.raises(BadWeights) as err:
            safetensors_check.read_header_fd(fd, "shard.safetensors")
    finally:
        os.close(fd)
    assert err.value.file == "shard.safetensors"
    assert err.value.reason == f"truncated: read 20 of {header_len} header bytes"


def test_read_header_fd_names_the_file_in_every_refusal(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(st_file({NAME: entry("F32", [2], 0, 8)}, bytes(4)))
    fd = os.open(bad, os.O_RDONLY)
    try:
        with pytest.raises(BadWeights) as err:
            safetensors_check.read_header_fd(fd, "bad.safetensors")
    finally:
        os.close(fd)
    assert err.value.file == "bad.safetensors" and "out of range" in err.value.reason
    # A descriptor that is not open: the OSError's own words, named, never an OSError in the caller.
    closed = os.open(bad, os.O_RDONLY)
    os.close(closed)
    with pytest.raises(BadWeights) as err:
        safetensors_check.read_header_fd(closed, "bad.safetensors")
    assert err.value.file == "bad.safetensors"
    assert err.value.reason == f"cannot read: {os.strerror(errno.EBADF)}"


def test_read_header_says_why_a_file_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(BadWeights) as err:
        read_header(tmp_path / "missing.safetensors")
    assert err.value.reason == f"cannot read: {os.strerror(errno.ENOENT)}"


# --- what a refusal says --------------------------------------------------------------------------------------------


def test_a_header_that_is_not_an_object_names_its_json_type() -> None:
    assert refusal(st_file(b"[]")) == "header is JSON list, not an object"
    assert refusal(st_file(b'"x"')) == "header is JSON str, not an object"


def test_any_failure_of_the_json_parser_is_a_named_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the parser raises (here a LookupError, outside the ones handled by name) is a BadWeights naming the
    file and the failure, never an exception in the caller."""

    def broken(*args: object, **kw: object) -> object:
        raise LookupError("codec trouble")

    monkeypatch.setattr(json, "loads", broken)
    assert refusal(st_file({})) == "header cannot be parsed: LookupError: codec trouble"


def test_the_figures_in_a_refusal_are_the_header_s() -> None:
    """The byte counts an operator reads are relative to the data buffer, as the header's offsets are."""
    span = refusal(st_file({NAME: entry("F16", [3], 4, 12), "z": entry("U8", [4], 0, 4)}, bytes(12)))
    assert span == f"tensor {NAME!r}: F16[3] needs 6 bytes but data_offsets span 8"
    overlap = refusal(st_file({"a": entry("U8", [6], 0, 6), "b": entry("U8", [4], 4, 8)}, bytes(8)))
    assert overlap == "tensor 'b' overlaps tensor 'a' (bytes 4..)"
    trailing = refusal(st_file({"a": entry("U8", [2], 0, 2)}, bytes(5)))
    assert trailing == "3 bytes after the last tensor; the header does not cover the file"


def test_a_header_split_inside_a_tensor_entry_by_a_short_pread_is_joined(tmp_path: Path) -> None:
    """The first pread of the header stops between the "F" and the "32" of the tensor's dtype (a short read: a
    network or FUSE file system returns fewer bytes than asked); the second asks for exactly the 5 bytes still
    missing, at the byte after the first piece, and the joined header is the file's."""
    header = {"__metadata__": {"format": "pt"}, NAME: {"shape": [2], "data_offsets": [0, 8], "dtype": "F32"}}
    raw = json.dumps(header).encode()
    assert len(raw) == 119
    split = raw.index(b'"F32"') + 2  # the first piece ends with '"F'
    path = tmp_path / "split.safetensors"
    path.write_bytes(st_file(raw, bytes(8)))
    with pytest.MonkeyPatch.context() as mp:
        calls = _short_preads(mp, split)
        fd = os.open(path, os.O_RDONLY)
        try:
            hdr = safetensors_check.read_header_fd(fd, "split.safetensors")
        finally:
            os.close(fd)
    # (asked, offset): the length, then the header in two pieces, the second right after the first.
    assert calls == [(8, 0), (119, 8), (119 - split, 8 + split)]
    assert hdr.data_offset == 8 + 119 and hdr.file_bytes == 8 + 119 + 8
    tensor = hdr.tensor(NAME)
    assert (tensor.dtype, tensor.shape, tensor.begin, tensor.end) == ("F32", (2,), 127, 135)
    assert hdr.metadata == {"format": "pt"}
    assert hdr == read_header(path)


def test_no_pread_asks_for_more_than_an_int_can_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read larger than INT_MAX is asked for in pieces (macOS refuses a pread over INT_MAX bytes with EINVAL,
    Linux returns at most 2 GiB - 4 KiB): each call asks for at most 2**31 - 1 bytes, the next one from where the
    last ended. (The header limit keeps real reads far below; the reader does not rely on it.)"""
    asked: list[tuple[int, int]] = []
    pieces = [b"ab", b"cde", b""]

    def pread(fd: int, n: int, offset: int) -> bytes:
        asked.append((n, offset))
        return pieces[len(asked) - 1]

    monkeypatch.setattr(os, "pread", pread)
    want = 3 * 2**30
    assert safetensors_check._PositionalReader(-1).read(want) == b"abcde"  # the file ended after 5 bytes
    assert [offset for _, offset in asked] == [0, 2, 5]
    assert all(n <= 2**31 - 1 for n, _ in asked), asked


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (bytes(8), "header length is 0; a header is at least '{}'"),
        (
            st_file(b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
            "header JSON is nested too deeply to be a safetensors header",
        ),
        (st_file({"__metadata__": {"k": 1}}), "__metadata__ must be an object of strings"),
    ],
    ids=["empty header", "deep nesting", "metadata"],
)
def test_a_refusal_says_exactly_what_is_wrong(data: bytes, reason: str) -> None:
    assert refusal(data) == reason


def test_an_unknown_dtype_is_refused_with_the_list_of_known_ones() -> None:
    reason = refusal(st_file({NAME: entry("F7", [1], 0, 4)}, bytes(4)))
    prefix = f"tensor {NAME!r}: unknown dtype 'F7' (known: "
    assert reason.startswith(prefix) and reason.endswith(")")
    known = reason[len(prefix) : -1].split(", ")
    # The dtypes a reader may look for, each by its safetensors name, comma-separated.
    assert {"BOOL", "U8", "F16", "BF16", "F32", "F64", "I64", "F8_E4M3"} <= set(known)
    assert set(known) == set(safetensors_check.DTYPE_SIZES) and len(known) == len(safetensors_check.DTYPE_SIZES)
