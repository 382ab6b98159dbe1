"""Byte sizes as people type them: ``64MB``, ``1GiB``, ``512k``, plain bytes (SI unless the unit says ``i``).

One reader for every size flag (the agent's ``--shm-budget``, the gateway's ``--body-budget``, ``model make-tiny``).
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["parse_size"]

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
