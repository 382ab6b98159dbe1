"""`pulsescale model make-tiny DIR --format hf`: a tiny Llama in the Hugging Face layout, generated locally.

What real engines (vLLM) load: ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (random F32 weights
under Llama's tensor names), ``tokenizer.json`` + ``tokenizer_config.json`` (a byte-level BPE), a
``generation_config.json``, and our ``sha256sums.txt`` so the agent's staging verifies every file as it does
for the local engine's models. Nothing is downloaded: the weights are drawn from a seeded generator and the
tokenizer is trained here on one sentence with Hugging Face's `tokenizers` (when it is not installed the
tokenizer is the untrained byte-level BPE: 256 byte tokens, no merges; still a valid BPE that encodes any text).

Shapes are chosen for vLLM's CPU backend: its attention kernels refuse a head size of 16, so heads are 64 wide
(hidden 128 = 2 heads of 64). The weights are written with numpy, so neither torch nor transformers is needed to
make the model (transformers, when installed, loads it: the tests check that).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from safetensors.numpy import save

from nodeagent.modelformat import CONFIG_FILE, write_manifest

__all__ = ["TRAINING_TEXT", "HfConfig", "make_tiny_hf"]

TRAINING_TEXT: Final = (
    "The warm pool says a pulse of requests came in, so the autoscaler woke a standby engine and the first "
    "token left in seconds, not minutes."
)
"""The tokenizer's whole training corpus: enough for a few dozen merges on top of the 256 byte tokens."""
BOS: Final = "<s>"
EOS: Final = "</s>"
WEIGHTS_FILE: Final = "model.safetensors"
TOKENIZER_FILE: Final = "tokenizer.json"


@dataclass(frozen=True)
class HfConfig:
    hidden: int = 128
    heads: int = 2
    """hidden / heads = 64: vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, ... (not 16)."""
    kv_heads: int = 2
    layers: int = 2
    intermediate: int = 256
    vocab_size: int = 320
    """Asked of the BPE trainer: 256 byte tokens, 2 special tokens, the rest merges (fewer if the text runs out)."""
    max_position: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _train_tokenizer(vocab_size: int) -> dict[str, Any]:
    """tokenizer.json of a byte-level BPE trained on `TRAINING_TEXT` (or untrained without `tokenizers`)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        return _byte_level_bpe_json()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: no unknowns, ever
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    out: dict[str, Any] = json.loads(tok.to_str())
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def _byte_level_bpe_json() -> dict[str, Any]:
    vocab = {BOS: 0, EOS: 1}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate((BOS, EOS))
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def _weights(cfg: HfConfig, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, kv = cfg.hidden, cfg.kv_heads * cfg.head_dim

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": np.ones(h, np.float32),
            f"{p}.self_attn.q_proj.weight": w(h, h),
            f"{p}.self_attn.k_proj.weight": w(kv, h),
            f"{p}.self_attn.v_proj.weight": w(kv, h),
            f"{p}.self_attn.o_proj.weight": w(h, h),
            f"{p}.post_attention_layernorm.weight": np.ones(h, np.float32),
            f"{p}.mlp.gate_proj.weight": w(cfg.intermediate, h),
            f"{p}.mlp.up_proj.weight": w(cfg.intermediate, h),
            f"{p}.mlp.down_proj.weight": w(h, cfg.intermediate),
        }
    out["model.norm.weight"] = np.ones(h, np.float32)
    out["lm_head.weight"] = w(vocab, h)
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_tiny_hf(out_dir: str | os.PathLike[str], cfg: HfConfig | None = None, *, seed: int = 0) -> dict[str, Any]:
    """Write the model into `out_dir` (created if missing); returns its ``config.json``."""
    cfg = cfg or HfConfig()
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise ValueError(f"hidden {cfg.hidden} must split into {cfg.heads} heads, in groups of {cfg.kv_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(cfg.vocab_size)
    vocab = tokenizer["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    bos, eos = vocab[BOS], vocab[EOS]
    n_vocab = max(vocab.values()) + 1
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": n_vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    # Written as bytes (not safetensors' save_file, which makes the file 0600): the umask decides, as for the
    # other files, so an engine user can read the directory the operator made readable.
    weights = save(_weights(cfg, n_vocab, np.random.default_rng(seed)), metadata={"format": "pt"})
    (out / WEIGHTS_FILE).write_bytes(weights)
    _write_json(out / CONFIG_FILE, config)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    _write_json(out / TOKENIZER_FILE, tokenizer)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "model_max_length": cfg.max_position,
            "clean_up_tokenization_spaces": False,
        },
    )
    files = [WEIGHTS_FILE, CONFIG_FILE, "generation_config.json", TOKENIZER_FILE, "tokenizer_config.json"]
    write_manifest(out, {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in files})
    return config
