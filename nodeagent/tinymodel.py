"""`pulsescale model make-tiny`: write a local-engine model of a given size (safetensors + sha256 manifest).

The model is a small byte-level mixture-of-experts language model (see `engines.local` for the maths). Its size
is set by the number of experts, so a 1 MB and an 8 GB model compute a token in about the same time: like a real
MoE model, each token reads only the experts its router picks. That keeps readiness checks honest (a real forward
pass from the staged weights) while the weights are as large as the benchmark asks.

Layout of the directory (all files listed in the manifest, so staging verifies every byte it copies):

- ``config.json``: ``{"format": "pulsescale-tiny-moe", "version": 1, "engine": "local", "vocab", "dim",
  "layers", "experts", "decay", "files"}``
- ``model-0000i-of-0000n.safetensors``: F32 tensors ``tok_emb [vocab, dim]``, per layer ``layers.<l>.norm [dim]``,
  ``layers.<l>.router [experts, dim]``, ``layers.<l>.experts [experts, dim, dim]``, then ``final_norm [dim]``,
  ``lm_head [vocab, dim]``; sharded so that no file exceeds the shard size (Hugging Face's file naming).
- ``sha256sums.txt``: one ``<hex>  <file>`` line per file, the format of ``sha256sum``, so
  ``sha256sum -c sha256sums.txt`` checks a copy by hand.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from nodeagent.errors import BadModel

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "MANIFEST_FILE",
    "TinyConfig",
    "make_tiny",
    "parse_size",
    "plan",
    "read_manifest",
    "write_manifest",
]

FORMAT: Final = "pulsescale-tiny-moe"
CONFIG_FILE: Final = "config.json"
MANIFEST_FILE: Final = "sha256sums.txt"
VOCAB: Final = 256  # bytes: no tokenizer file to ship or stage

_SIZE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS: Final = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """``64MB`` -> 64_000_000, ``1GiB`` -> 2**30, ``512k`` -> 512_000 (SI unless the unit says ``i``)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"size {text!r} is not a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    factor = 1024 ** ("kmgt".index(unit[0]) + 1) if unit.endswith("i") else _UNITS[unit]
    return int(float(m.group(1)) * factor)


@dataclass(frozen=True)
class TinyConfig:
    dim: int
    layers: int
    experts: int
    vocab: int = VOCAB
    decay: float = 0.8
    """How much of the running context state each new byte keeps: the model's whole notion of context."""

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        d, e, v = self.dim, self.experts, self.vocab
        out: list[tuple[str, tuple[int, ...]]] = [("tok_emb", (v, d))]
        for layer in range(self.layers):
            out += [
                (f"layers.{layer}.norm", (d,)),
                (f"layers.{layer}.router", (e, d)),
                (f"layers.{layer}.experts", (e, d, d)),
            ]
        out += [("final_norm", (d,)), ("lm_head", (v, d))]
        return out

    @property
    def nbytes(self) -> int:
        return sum(4 * math.prod(shape) for _, shape in self.tensors())


def plan(size_bytes: int, shard_bytes: int = 512 * 2**20) -> TinyConfig:
    """Pick dim, layers and experts so the weights come to about `size_bytes` and no layer's expert tensor is
    larger than a shard."""
    dim = 256 if size_bytes >= 4 * 2**20 else 64
    fixed = 2 * VOCAB * dim * 4
    per_expert = (dim * dim + dim) * 4
    budget = max(size_bytes - fixed, 2 * per_expert)
    layers = max(2, math.ceil(budget / max(shard_bytes - per_expert, per_expert)))
    experts = max(1, round(budget / (layers * per_expert)))
    return TinyConfig(dim=dim, layers=layers, experts=experts)


def _chunks(rng: np.random.Generator, shape: tuple[int, ...], scale: float, ones: bool) -> Iterator[bytes]:
    """The tensor's bytes in pieces of at most ~64 MB, so a multi-GB model never sits in memory at once."""
    if ones:
        yield np.ones(shape, np.float32).tobytes()
        return
    rows = shape[0]
    row_elems = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, (16 * 2**20) // row_elems)
    for start in range(0, rows, step):
        n = min(step, rows - start) * row_elems
        # Uniform in [-a, a] has variance a^2/3: a = sqrt(3) * scale keeps activations O(1). Uniform is ~3x
        # cheaper to draw than normal, which matters for multi-GB models.
        block = rng.random(n, dtype=np.float32)
        block *= np.float32(2 * math.sqrt(3) * scale)
        block -= np.float32(math.sqrt(3) * scale)
        yield block.tobytes()


def _write_file(path: Path, entries: list[tuple[str, tuple[int, ...]]], make: Callable[[str], Iterator[bytes]]) -> str:
    header: dict[str, object] = {"__metadata__": {"format": "pt", "generator": FORMAT}}
    offset = 0
    for name, shape in entries:
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads to 8 bytes so the data buffer is aligned
    h = hashlib.sha256()
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        for piece in (struct.pack("<Q", len(raw)), raw):
            h.update(piece)
            f.write(piece)
        for name, _ in entries:
            for piece in make(name):
                h.update(piece)
                f.write(piece)
    os.replace(tmp, path)
    return h.hexdigest()


def make_tiny(
    out_dir: str | os.PathLike[str], size_bytes: int, *, shard_bytes: int = 512 * 2**20, seed: int = 0
) -> TinyConfig:
    """Write a model of about `size_bytes` into `out_dir` (created if missing); returns its configuration."""
    if size_bytes <= 0:
        raise ValueError("size must be > 0")
    cfg = plan(size_bytes, shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = dict(cfg.tensors())

    def make(name: str) -> Iterator[bytes]:
        shape = shapes[name]
        scale = 1.0 if name == "tok_emb" else 1.0 / math.sqrt(cfg.dim)
        return _chunks(rng, shape, scale, ones=name.endswith("norm"))

    # Greedy sharding in tensor order, as Hugging Face's save_pretrained does.
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in cfg.tensors():
        n = 4 * math.prod(shape)
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += n
    sums: dict[str, str] = {}
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, entries in zip(files, shards, strict=True):
        sums[name] = _write_file(out / name, entries, make)
    config = {
        "format": FORMAT,
        "version": 1,
        "engine": "local",
        "vocab": cfg.vocab,
        "dim": cfg.dim,
        "layers": cfg.layers,
        "experts": cfg.experts,
        "decay": cfg.decay,
        "files": files,
    }
    raw = json.dumps(config, indent=2).encode() + b"\n"
    (out / CONFIG_FILE).write_bytes(raw)
    sums[CONFIG_FILE] = hashlib.sha256(raw).hexdigest()
    write_manifest(out, sums)
    return cfg


def write_manifest(model_dir: str | os.PathLike[str], sums: dict[str, str]) -> None:
    lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
    Path(model_dir, MANIFEST_FILE).write_text(lines)


_MANIFEST_LINE: Final = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def read_manifest(model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """File name -> sha256 hex from ``sha256sums.txt``; refuses names that would leave the directory."""
    path = Path(model_dir, MANIFEST_FILE)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadModel(
            f"{model_dir} has no {MANIFEST_FILE}; every staged file must be checksummed "
            f"(write one with `cd {model_dir} && sha256sum *.safetensors config.json > {MANIFEST_FILE}`)"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise BadModel(f"cannot read {path}: {err}") from None
    sums: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _MANIFEST_LINE.match(line.strip())
        if not m:
            raise BadModel(f"{path}:{n}: not a `<sha256 hex>  <file>` line: {line[:80]!r}")
        digest, name = m.groups()
        if "/" in name or name in (".", "..") or name.startswith("."):
            raise BadModel(f"{path}:{n}: file name {name!r} must be a plain name inside the model directory")
        sums[name] = digest
    if not any(name.endswith(".safetensors") for name in sums):
        raise BadModel(f"{path} lists no .safetensors file")
    return sums
