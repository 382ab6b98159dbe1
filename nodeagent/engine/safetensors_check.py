"""Parse and validate a safetensors header before anything maps the file.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of UTF-8
JSON (an object: tensor name -> {dtype, shape, data_offsets: [begin, end]}, plus an optional ``__metadata__``
object of strings), then the data buffer; offsets are relative to the buffer. We check what the reference
implementation checks (known dtypes, offsets inside the buffer, tensors covering it exactly with no overlap and
no gap, shape x dtype size == byte span) and refuse absurd header sizes before reading them. Every refusal is a
`BadWeights(file, reason)` that names the file and the tensor.

Pure: reads the file's first bytes and its size, nothing else.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Final

from nodeagent.errors import BadWeights

__all__ = ["DTYPE_SIZES", "MAX_HEADER_BYTES", "Header", "TensorInfo", "parse_header", "read_header", "read_header_fd"]

# Bytes per element. Sub-byte float formats (F4, F6_*) are left out on purpose: the local engine cannot use them
# and a span check would need bit arithmetic; add them with the engine that needs them.
DTYPE_SIZES: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
"""The reference implementation's limit: a real header of 100k tensors is a few MB; more is corruption."""

_LEN: Final = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Offset of the first byte from the start of the *file* (not the buffer)."""
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    file: str
    file_bytes: int
    data_offset: int
    """Where the data buffer starts: 8 + header length."""
    tensors: tuple[TensorInfo, ...]
    """Sorted by offset."""
    metadata: dict[str, str]

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - self.data_offset

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at `path`."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return parse_header(f, size, file=os.path.basename(name))
    except OSError as err:
        raise BadWeights(os.path.basename(name), f"cannot read: {err.strerror or err}") from None


def read_header_fd(fd: int, file: str) -> Header:
    """Read and validate the header of the open file `fd` (named `file` in errors) with positional reads, so
    the descriptor's offset, shared with every process that inherited it, is never moved."""
    try:
        size = os.fstat(fd).st_size
        return parse_header(_PositionalReader(fd), size, file=file)
    except OSError as err:
        raise BadWeights(file, f"cannot read: {err.strerror or err}") from None


class _PositionalReader:
    """`read(n)` over ``pread``: what `parse_header` needs of a file, without touching the shared offset."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.at = 0

    def read(self, n: int) -> bytes:
        parts = []
        while n > 0:
            chunk = os.pread(self.fd, min(n, 2**30), self.at)
            if not chunk:
                break
            parts.append(chunk)
            self.at += len(chunk)
            n -= len(chunk)
        return b"".join(parts)


def parse_header(f: BinaryIO | _PositionalReader, file_bytes: int, *, file: str) -> Header:
    """Validate a header read from `f` (positioned at the start) of a file of `file_bytes` bytes."""
    if file_bytes < _LEN.size:
        raise BadWeights(file, f"truncated: {file_bytes} bytes, not even the 8-byte header length")
    (n,) = _LEN.unpack(f.read(_LEN.size))
    if n > MAX_HEADER_BYTES:
        raise BadWeights(file, f"header length {n} bytes is absurd (limit {MAX_HEADER_BYTES}); not a safetensors file")
    if n == 0:
        raise BadWeights(file, "header length is 0; a header is at least '{}'")
    if _LEN.size + n > file_bytes:
        raise BadWeights(
            file, f"truncated: header says {n} bytes but the file has only {file_bytes - _LEN.size} after it"
        )
    raw = f.read(n)
    if len(raw) != n:
        raise BadWeights(file, f"truncated: read {len(raw)} of {n} header bytes")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as err:
        raise BadWeights(file, f"header is not UTF-8 ({err.reason} at byte {err.start})") from None
    except _Duplicate as dup:
        raise BadWeights(file, f"header names tensor {dup.name!r} twice") from None
    except ValueError as err:  # json.JSONDecodeError
        raise BadWeights(file, f"header is not valid JSON: {err}") from None
    except RecursionError:
        raise BadWeights(file, "header JSON is nested too deeply to be a safetensors header") from None
    except Exception as err:  # noqa: BLE001 - any parser failure is a bad file, never a crash of the caller
        raise BadWeights(file, f"header cannot be parsed: {type(err).__name__}: {err}") from None
    if not isinstance(obj, dict):
        raise BadWeights(file, f"header is JSON {type(obj).__name__}, not an object")
    data_offset = _LEN.size + n
    return _tensors(file, obj, file_bytes, data_offset)


class _Duplicate(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _tensors(file: str, obj: dict[str, Any], file_bytes: int, data_offset: int) -> Header:
    data_bytes = file_bytes - data_offset
    metadata = obj.pop("__metadata__", {})  # only a missing key defaults: [], null or false are corrupt
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadWeights(file, "__metadata__ must be an object of strings")
    infos = []
    for name, spec in obj.items():
        where = f"tensor {name!r}"
        if not isinstance(spec, dict):
            raise BadWeights(file, f"{where}: entry is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise BadWeights(file, f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_SIZES)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise BadWeights(file, f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise BadWeights(file, f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if begin > end:
            raise BadWeights(file, f"{where}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_bytes:
            raise BadWeights(
                file,
                f"truncated or corrupt: {where} ends at byte {end} of the data buffer, which has {data_bytes} bytes "
                f"(data_offsets [{begin}, {end}] out of range)",
            )
        want = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != want:
            raise BadWeights(file, f"{where}: {dtype}{shape} needs {want} bytes but data_offsets span {end - begin}")
        infos.append(TensorInfo(name, dtype, tuple(shape), data_offset + begin, data_offset + end))
    infos.sort(key=lambda t: (t.begin, t.end))
    cursor = data_offset
    prev = None
    for t in infos:
        if t.begin < cursor:
            raise BadWeights(file, f"tensor {t.name!r} overlaps tensor {prev!r} (bytes {t.begin - data_offset}..)")
        if t.begin > cursor:
            raise BadWeights(file, f"gap of {t.begin - cursor} bytes before tensor {t.name!r}; the header is corrupt")
        cursor, prev = t.end, t.name
    if cursor != file_bytes:
        raise BadWeights(file, f"{file_bytes - cursor} bytes after the last tensor; the header does not cover the file")
    return Header(file, file_bytes, data_offset, tuple(infos), dict(metadata))


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
