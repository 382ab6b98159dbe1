"""The model-directory format the node agent stages and the local engine reads.

A model directory holds safetensors files, ``config.json`` and ``sha256sums.txt``, every file listed in the
manifest so staging verifies every byte it copies:

- ``config.json``: ``{"format": "pulsescale-tiny-moe", "version": 1, "engine": "local", "vocab", "dim",
  "layers", "experts", "decay", "files"}``
- ``model-0000i-of-0000n.safetensors``: F32 tensors ``tok_emb [vocab, dim]``, per layer ``layers.<l>.norm [dim]``,
  ``layers.<l>.router [experts, dim]``, ``layers.<l>.experts [experts, dim, dim]``, then ``final_norm [dim]``,
  ``lm_head [vocab, dim]``; sharded so that no file exceeds the shard size (Hugging Face's file naming).
- ``sha256sums.txt``: one ``<hex>  <file>`` line per file, the format of ``sha256sum``, so
  ``sha256sum -c sha256sums.txt`` checks a copy by hand.

Pure apart from reading and writing the manifest: the engine process imports it (see `nodeagent.engine`).
"""

from __future__ import annotations

import errno
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nodeagent.errors import BadModel

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "MANIFEST_FILE",
    "VOCAB",
    "TinyConfig",
    "parse_manifest",
    "read_manifest",
    "write_manifest",
]

FORMAT: Final = "pulsescale-tiny-moe"
CONFIG_FILE: Final = "config.json"
MANIFEST_FILE: Final = "sha256sums.txt"
VOCAB: Final = 256  # bytes: no tokenizer file to ship or stage


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


def write_manifest(model_dir: str | os.PathLike[str], sums: dict[str, str]) -> None:
    lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
    Path(model_dir, MANIFEST_FILE).write_text(lines)


_MANIFEST_LINE: Final = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def read_manifest(model_dir: str | os.PathLike[str], *, dir_fd: int | None = None) -> dict[str, str]:
    """File name -> sha256 hex from ``sha256sums.txt``; refuses names that would leave the directory, and a
    manifest that is a symbolic link (the agent reads it as root). `dir_fd` is an open handle of `model_dir`."""
    path = Path(model_dir, MANIFEST_FILE)
    try:
        fd = os.open(
            MANIFEST_FILE if dir_fd is not None else path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd
        )
        with open(fd, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        raise BadModel(
            f"{model_dir} has no {MANIFEST_FILE}; every staged file must be checksummed "
            f"(write one with `cd {model_dir} && sha256sum *.safetensors config.json > {MANIFEST_FILE}`)"
        ) from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise BadModel(
                f"{path} is a symbolic link; the agent (root) never follows links in a model directory: "
                "put the file itself there"
            ) from None
        raise BadModel(f"cannot read {path}: {err}") from None
    except UnicodeDecodeError as err:
        raise BadModel(f"cannot read {path}: {err}") from None
    return parse_manifest(text, str(path))


def parse_manifest(text: str, where: str) -> dict[str, str]:
    """File name -> sha256 hex from the text of a manifest (`where` names it in errors: a path or a URL). Names
    must be plain file names in the model directory: no ``/``, no ``..``, no leading dot, no control character."""
    path = where
    sums: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _MANIFEST_LINE.match(line.strip())
        if not m:
            raise BadModel(f"{path}:{n}: not a `<sha256 hex>  <file>` line: {line[:80]!r}")
        digest, name = m.groups()
        if "/" in name or "\\" in name or name.startswith(".") or not name.isprintable():
            raise BadModel(f"{path}:{n}: file name {name!r} must be a plain name inside the model directory")
        sums[name] = digest
    if not any(name.endswith(".safetensors") for name in sums):
        raise BadModel(f"{path} lists no .safetensors file")
    return sums
