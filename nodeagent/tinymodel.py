"""`pulsescale model make-tiny`: write a local-engine model of a given size (safetensors + sha256 manifest).

The model is a small byte-level mixture-of-experts language model (see `engine.local` for the maths). Its size
is set by the number of experts, so a 1 MB and an 8 GB model compute a token in about the same time: like a real
MoE model, each token reads only the experts its router picks. That keeps readiness checks honest (a real forward
pass from the staged weights) while the weights are as large as the benchmark asks.

The directory's layout is `modelformat`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from nodeagent.modelformat import CONFIG_FILE, FORMAT, VOCAB, TinyConfig, write_manifest

__all__ = ["make_tiny", "plan"]


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
    out_dir: str | os.PathLike[str],
    size_bytes: int,
    *,
    shard_bytes: int = 512 * 2**20,
    seed: int = 0,
    extra_config: Mapping[str, object] | None = None,
) -> TinyConfig:
    """Write a model of about `size_bytes` into `out_dir` (created if missing); returns its configuration.
    `extra_config` adds keys to its config.json (the local engine's `token_ms`, say)."""
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
        **(extra_config or {}),
    }
    raw = json.dumps(config, indent=2).encode() + b"\n"
    (out / CONFIG_FILE).write_bytes(raw)
    sums[CONFIG_FILE] = hashlib.sha256(raw).hexdigest()
    write_manifest(out, sums)
    return cfg
