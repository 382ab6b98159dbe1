"""The `pulsescale` dispatcher, run as a user runs it: a real process."""

from __future__ import annotations

import json
import subprocess
import sys

from warmpool.embedded import NatsServer


def pulsescale(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_help_lists_every_group() -> None:
    r = pulsescale("--help")
    assert r.returncode == 0
    for word in ("daemons:", "on-call:", "autoscaler", "agent", "scale", "drain", "bench"):
        assert word in r.stdout


def test_unknown_command_fails_with_usage() -> None:
    r = pulsescale("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr and "usage" in r.stderr.lower()
    r = pulsescale("sclae")  # a typo gets the command it is close to, in one line
    assert r.returncode == 2 and r.stderr == "pulsescale: unknown command 'sclae'; did you mean 'scale'?\n", r.stderr
    r = pulsescale("bench", "decdie")
    assert r.returncode == 2 and "unknown benchmark 'decdie'; did you mean 'decide'?" in r.stderr, r.stderr


def test_help_does_not_import_the_daemons() -> None:
    code = (
        "import sys; from pulsescale import cli; cli.main(['--help']); "
        "print(sorted(m for m in ('autoscaler', 'nodeagent', 'nats', 'kopf') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip().endswith("[]")


def test_bench_claims_prints_figures() -> None:
    r = pulsescale(
        "bench", "claims", "--slots", "40", "--nodes", "4", "--claims", "60", "--concurrency", "1", "4", "--json"
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["slots"], doc["nodes"], doc["slots_per_node"]) == (40, 4, 10)  # --slots spread over --nodes
    assert [level["claimers"] for level in doc["levels"]] == [1, 4]
    assert all(level["claims"] == 60 and level["claims_per_s"] > 0 for level in doc["levels"])


def test_slots_lists_the_registry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from warmpool import connect
    from warmpool.registry import KvSlotStore
    from warmpool.seed import seed_pool

    with NatsServer(tmp_path) as server:

        async def seed() -> None:
            nc = await connect.connect(connect.NatsOptions(servers=(server.url,)))
            async with await KvSlotStore.open(nc) as store:
                await seed_pool(store, "llama", nodes=2, slots_per_node=1)
            await nc.close()

        asyncio.run(seed())
        r = pulsescale("slots", "--nats", server.url)
    assert r.returncode == 0, r.stderr
    assert "llama.node-0.s0" in r.stdout and "warm" in r.stdout and "2 slot(s)" in r.stdout


def test_unreachable_nats_is_one_clear_line() -> None:
    from warmpool.embedded import free_port

    r = pulsescale("slots", "--nats", f"nats://127.0.0.1:{free_port()}", "--nats-connect-timeout", "0.5")
    assert r.returncode == 3  # unreachable (pulsescale.cli.EXIT_UNREACHABLE); a refusal is 1
    assert r.stderr.startswith("pulsescale slots: cannot connect to NATS") and r.stderr.count("\n") == 1


# --- machine output and durations on every command that prints ------------------------------------------------


def test_model_tools_print_json_and_yaml_on_stdout_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    import yaml

    m = tmp_path / "m"
    r = pulsescale("model", "make-tiny", str(m), "--size", "1MB", "-o", "json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)  # all of stdout is the object: nothing else printed there
    assert made["format"] == "tiny" and made["weights_bytes"] > 0 and made["files"]
    r = pulsescale("model", "verify", str(m), "--json")
    assert r.returncode == 0, r.stderr
    checked = json.loads(r.stdout)
    assert checked["ok"] is True and {f["name"] for f in checked["files"]} >= set(made["files"])
    assert all(f["ok"] for f in checked["files"])
    shard = m / made["files"][0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    r = pulsescale("model", "verify", str(m), "-o", "yaml")
    bad = yaml.safe_load(r.stdout)
    assert r.returncode == 1 and bad["ok"] is False
    assert [f["detail"] for f in bad["files"] if not f["ok"]] == ["sha256 mismatch with the manifest"]
    r = pulsescale("model", "verify", str(m))  # text: the file named once
    assert r.returncode == 1 and f"BAD   {shard.name}: sha256 mismatch with the manifest\n" in r.stdout
    r = pulsescale("model", "verify", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and r.stderr.startswith("pulsescale model verify: "), r.stderr


def test_slots_and_sample_print_json_and_take_durations(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import json

    from warmpool import connect
    from warmpool.registry import KvSlotStore
    from warmpool.seed import seed_pool

    with NatsServer(tmp_path) as server:

        async def seed() -> None:
            nc = await connect.connect(connect.NatsOptions(servers=(server.url,)))
            async with await KvSlotStore.open(nc) as store:
                await seed_pool(store, "llama", nodes=1, slots_per_node=2)
            await nc.close()

        asyncio.run(seed())
        r = pulsescale("slots", "--nats", server.url, "-o", "json")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [(s["key"], s["state"], s["agent"]) for s in rows] == [
            ("llama.node-0.s0", "warm", "fresh"),
            ("llama.node-0.s1", "warm", "fresh"),
        ]
        r = pulsescale("sample", "llama", "--queue-depth", "3", "--for", "300ms", "--every", "100ms", "--nats",
                       server.url, "--json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        sent = json.loads(r.stdout)
        assert sent["model"] == "llama" and sent["queue_depth"] == 3 and 3 <= sent["samples"] <= 5
    r = pulsescale("sample", "llama", "--queue-depth", "3", "--every", "10min")
    assert r.returncode == 2 and "argument --every: '10min' is not a duration such as 500ms, 90s" in r.stderr


def test_daemons_take_durations_and_refuse_bad_ones_by_flag() -> None:
    r = pulsescale("gateway", "--timeout-s", "1d")
    assert r.returncode == 2 and "argument --timeout-s: '1d' is not a duration" in r.stderr and "write 24h" in r.stderr
    r = pulsescale("agent", "--model", ".", "--node", "n", "--lease-s=-3s")
    assert r.returncode == 2 and "argument --lease-s: '-3s' is not a duration" in r.stderr
    for flag in ("--lease", "--activation-deadline", "--gc-freeze-every", "--nats-connect-timeout"):
        r = pulsescale("autoscaler", flag, "soon")
        assert r.returncode == 2 and f"argument {flag}: 'soon' is not a duration" in r.stderr, r.stderr


def test_crd_prints_its_object_as_json_or_yaml() -> None:
    import json

    import yaml

    r = pulsescale("crd", "-o", "json")
    assert r.returncode == 0, r.stderr
    crd = json.loads(r.stdout)
    assert (crd["kind"], crd["metadata"]["name"]) == ("CustomResourceDefinition", "scaledobjects.pulsescale.io")
    r = pulsescale("crd", "-o", "yaml")
    assert r.returncode == 0 and yaml.safe_load(r.stdout) == crd
    r = pulsescale("crd", "--json", "--schema")
    assert r.returncode == 2 and "--schema and --docs print something else" in r.stderr


def test_nats_help_cites_what_ships() -> None:
    r = pulsescale("nats", "--help")
    assert r.returncode == 0 and "DESIGN.md" not in r.stdout and "README, 'Security'" in " ".join(r.stdout.split())
