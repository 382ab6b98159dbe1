"""Request traces: both formats read from files written here (never third-party data), speed, the service-time
rule, per-model traces, every bad row named by its line, and an hour of Azure-format rows read fast."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from warmpool import traces
from warmpool.traces import BadTrace, Trace, read_trace

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:50.9951690,3180,8
2023-11-16 18:15:51.1220000,110,27
"""


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_azure_format(tmp_path: Path) -> None:
    t = read_trace(write(tmp_path, AZURE))
    assert (t.format, t.models, len(t), t.speed, t.reordered) == ("azure", None, 3, 1.0, 0)
    # 7 fractional digits kept (to 100 ns): offsets from the first request, exact to well under a microsecond.
    assert t.t_s.tolist() == pytest.approx([0.0, 4.314579, 4.44141], abs=1e-7)
    assert t.context_tokens.tolist() == [4808, 3180, 110] and t.generated_tokens.tolist() == [10, 8, 27]
    assert t.duration_s == pytest.approx(4.44141) and t.source == str(tmp_path / "trace.csv")
    assert not t.t_s.flags.writeable
    # Headerless, CRLF, a BOM, a comment and blank lines, other fraction lengths: the same kind of trace.
    text = "\ufeff# from a test\r\n2023-11-16 23:59:59.5,1,2\r\n\r\n2023-11-17 00:00:00,3,4\r\n"
    text += "2023-11-17T00:00:01.25,5,6\r\n"
    t = read_trace(write(tmp_path, text))
    assert t.format == "azure" and t.t_s.tolist() == [0.0, 0.5, 1.75] and t.generated_tokens.tolist() == [2, 4, 6]


def test_plain_format(tmp_path: Path) -> None:
    # No header: each row says by its fields; a second field of digits is tokens, else a model.
    text = "# t_s[,model][,tokens]\n\n5.0\n5.5,llama-8b\n6,300\n7.25,qwen,12\n8,,40\n  9 , llama-8b ,  \n"
    t = read_trace(write(tmp_path, text))
    assert (t.format, len(t)) == ("plain", 6)
    assert t.t_s.tolist() == [0.0, 0.5, 1.0, 2.25, 3.0, 4.0]  # from the first request
    assert t.models == (None, "llama-8b", None, "qwen", None, "llama-8b")
    assert t.generated_tokens.tolist() == [-1, -1, 300, 12, 40, -1]
    assert t.context_tokens.tolist() == [-1] * 6
    # A header names the columns: here a digits-only model name is a model.
    t = read_trace(write(tmp_path, "t_s,model\n0,405\n1.5\n"))
    assert t.models == ("405", None) and t.generated_tokens.tolist() == [-1, -1]
    t = read_trace(write(tmp_path, "T_S,Tokens\n0,7\n1,\n"))
    assert t.models is None and t.generated_tokens.tolist() == [7, -1]


def test_rows_out_of_order_are_sorted_and_counted(tmp_path: Path) -> None:
    t = read_trace(write(tmp_path, "t_s,model,tokens\n3,a,3\n1,b,1\n2,c,2\n2,d,22\n"))
    assert t.t_s.tolist() == [0.0, 1.0, 1.0, 2.0] and t.reordered == 1
    assert t.models == ("b", "c", "d", "a") and t.generated_tokens.tolist() == [1, 2, 22, 3]  # stable: c before d


def test_speed_divides_the_offsets(tmp_path: Path) -> None:
    path = write(tmp_path, "0\n1\n4\n")
    t = read_trace(path, speed=10)
    assert t.t_s.tolist() == pytest.approx([0.0, 0.1, 0.4]) and t.speed == 10 and t.duration_s == pytest.approx(0.4)
    assert read_trace(path, speed=0.5).t_s.tolist() == [0.0, 2.0, 8.0]
    for speed in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="speed must be finite and > 0"):
            read_trace(path, speed=speed)


def test_service_time(tmp_path: Path) -> None:
    t = read_trace(write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                   "2024-05-10 00:00:00.0000000,5000,50\n"
                                   "2024-05-10 00:00:01.0000000,0,0\n"
                                   "2024-05-10 00:00:02.0000000,1000,500\n"))  # fmt: skip
    # context / 5000 tokens/s + generated / 50 tokens/s, never below MIN_SERVICE_S.
    assert t.service_s().tolist() == pytest.approx([2.0, traces.MIN_SERVICE_S, 10.2])
    assert t.service_s(decode_tokens_per_s=100, prefill_tokens_per_s=1000).tolist() == pytest.approx([5.5, 0.05, 6.0])
    plain = read_trace(write(tmp_path, "0,100\n1\n2,0\n"))  # no context; one without generated tokens
    assert plain.service_s().tolist() == pytest.approx([2.0, traces.DEFAULT_GENERATED_TOKENS / 50, 0.05])
    assert plain.service_s(default_generated=10, default_context=500).tolist() == pytest.approx([2.1, 0.3, 0.1])
    with pytest.raises(ValueError, match="decode_tokens_per_s"):
        plain.service_s(decode_tokens_per_s=0)


def test_for_model(tmp_path: Path) -> None:
    t = read_trace(write(tmp_path, "0,a,1\n1,b,2\n2,,3\n3,a,4\n"), speed=2)
    a = t.for_model("a")
    # The requests naming the model, at their offsets in the whole trace (so the models' traces line up).
    assert (a.t_s.tolist(), a.generated_tokens.tolist(), a.models) == ([0.0, 1.5], [1, 4], ("a", "a"))
    assert (a.format, a.source, a.speed, a.duration_s) == ("plain", t.source, 2, 1.5)
    assert len(t.for_model("b")) == 1 and t.for_model("b").t_s.tolist() == [0.5]
    none = t.for_model("zzz")
    assert (len(none), none.duration_s, none.service_s().tolist()) == (0, 0.0, [])
    azure = read_trace(write(tmp_path, AZURE))
    assert azure.for_model("anything") is azure  # a trace that names no models is every model's


BAD = [
    # (content, line, what the message says)
    ("", None, "no requests"),
    ("# only a comment\n\n", None, "no requests"),
    ("t_s,model,tokens\n", None, "no requests"),
    ("when,what\n0,a\n", 1, "neither a row nor a header"),
    ("t_s,tokens,model\n0,1,a\n", 1, "neither a row nor a header"),
    ("0\n1,a,2,3\n", 2, "4 fields .* expected 1 to 3"),
    ("t_s,tokens\n0,1\n\n1,2,3\n", 4, "3 fields .* expected at most 2: t_s,tokens \\(the header on line 1\\)"),
    ("0\n# c\nsoon\n", 3, "t_s 'soon' is not a number"),
    ("0\n,a\n", 2, "t_s '' is not a number"),
    ("0\n-1\n", 2, "t_s '-1' is not a finite number >= 0"),
    ("0\nnan\n", 2, "t_s 'nan' is not a finite number >= 0"),
    ("inf\n", 1, "t_s 'inf' is not a finite number >= 0"),
    ("0,a\n1,Llama.3\n", 2, "model 'Llama.3' is not a model name"),
    ("0,a,1\n1,b,-5\n", 2, "tokens '-5' is negative"),
    ("0,a,1\n1,b,2.5\n", 2, "tokens '2.5' is not a whole number"),
    (AZURE + "2023-11-16 18:15:52.0,1\n", 5, "2 fields .* expected 3: TIMESTAMP,ContextTokens,GeneratedTokens"),
    (AZURE + "2023-11-16 18:15:52.0,1,2,3\n", 5, "4 fields"),
    (AZURE + "yesterday,1,2\n", 5, "TIMESTAMP 'yesterday' is not a date and time; expected YYYY-MM-DD"),
    (AZURE + "2023-13-16 18:15:52.0,1,2\n", 5, "TIMESTAMP '2023-13-16 18:15:52.0' is not a date"),
    (AZURE + "2023-11-16 18:15:52.0Z,1,2\n", 5, "without a time zone"),
    (AZURE + "2023-11-16 18:15:52.0,-1,2\n", 5, "ContextTokens '-1' is negative"),
    (AZURE + "2023-11-16 18:15:52.0,1,x\n", 5, "GeneratedTokens 'x' is not a whole number"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0.5,1,2\n", 2, "TIMESTAMP '0.5' is not a date"),
]


@pytest.mark.parametrize(("content", "line", "message"), BAD)
def test_bad_rows_name_the_file_and_line(tmp_path: Path, content: str, line: int | None, message: str) -> None:
    path = write(tmp_path, content)
    where = f"trace {path} line {line}: " if line is not None else f"trace {path}: "
    with pytest.raises(BadTrace, match=f"^{where}") as err:
        read_trace(path)
    assert err.match(message) and err.value.line == line and err.value.source == str(path)
    assert err.value.code == "bad_trace"


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(BadTrace, match=r"^trace \S+missing.csv: cannot read it: No such file"):
        read_trace(tmp_path / "missing.csv")
    (tmp_path / "bin.csv").write_bytes(b"0\n\xff\xfe\n")
    with pytest.raises(BadTrace, match="not UTF-8 text"):
        read_trace(tmp_path / "bin.csv")


def azure_rows(n: int, seed: int = 0) -> tuple[str, np.ndarray]:
    """An hour of Azure-format rows, as the public traces spell them; the arrival offsets in nanoseconds."""
    rng = np.random.default_rng(seed)
    ns = np.sort(rng.integers(0, 3600 * 10**9 // 100, n)) * 100  # 100 ns steps: 7 fractional digits
    stamps = np.datetime64("2023-11-16T18:00:00", "ns") + ns.astype("timedelta64[ns]")
    text = np.datetime_as_string(stamps, unit="ns")
    ctx, gen = rng.integers(1, 8000, n), rng.integers(0, 1000, n)
    rows = [f"{s[:10]} {s[11:27]},{c},{g}\n" for s, c, g in zip(text, ctx, gen, strict=True)]
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(rows), ns - ns[0]


def test_an_hour_of_azure_rows_reads_fast(tmp_path: Path) -> None:
    text, ns = azure_rows(25_000)
    path = write(tmp_path, text)
    t0 = time.perf_counter()
    t = read_trace(path)
    elapsed = time.perf_counter() - t0
    assert len(t) == 25_000 and np.abs(t.t_s - ns / 1e9).max() < 1e-6
    assert elapsed < 1.0, f"{elapsed:.3f} s for 25k rows"  # ~0.05 s here; generous for a loaded machine


def test_blocks_read_as_rows_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are parsed a block at a time, and a block with anything unusual row by row: the two agree, and a bad
    row deep in a file, past many blocks, is named by its own line."""
    text, _ = azure_rows(3000)
    whole = read_trace(write(tmp_path, text))
    monkeypatch.setattr(traces, "_CHUNK_CHARS", 500)  # ~12 rows a block
    small = read_trace(write(tmp_path, text))
    lines = text.splitlines(keepends=True)
    lines[1000] = "# a comment: this block is read row by row\n"
    lines.insert(2000, "\n")
    mixed = read_trace(write(tmp_path, "".join(lines)))
    keep = np.arange(3000) != 999  # row 1000 (line 1001) became the comment
    for t in (small, mixed):
        ref = (whole.t_s[keep], whole.context_tokens[keep]) if t is mixed else (whole.t_s, whole.context_tokens)
        assert np.array_equal(t.t_s, ref[0] - ref[0][0]) and np.array_equal(t.context_tokens, ref[1])
    lines[2500] = lines[2500].replace(",", ";", 1)
    with pytest.raises(BadTrace, match="line 2501: 2 fields"):  # lines[0] is line 1
        read_trace(write(tmp_path, "".join(lines)))


def test_trace_is_a_value(tmp_path: Path) -> None:
    t = read_trace(write(tmp_path, "0,a\n"))
    assert isinstance(t, Trace) and len(t) == 1 and t.duration_s == 0.0
    with pytest.raises(AttributeError):
        t.speed = 2.0  # type: ignore[misc]
