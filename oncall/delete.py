"""`pulsescale delete`: ScaledObjects out of KV `pulse_scalers`, by name or every one of ``-f FILE|DIR``.

``delete`` writes `pulse_scalers`, so it needs the operator's NATS user, as ``apply`` does (and ``-f`` reads the
files as ``apply -f`` does: `oncall.apply.load_manifests`); the autoscaler sees the delete in its watch and stops
scaling the model. Each delete is a compare-and-set on the revision read: a ScaledObject re-applied meanwhile is
not deleted unseen. Exit codes: 0 done; 1 a refusal or a missing object (unless ``--ignore-not-found``); 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from manifests import scaledobject
from oncall.apply import load_manifests
from oncall.client import EXIT_REFUSED, CommandFailed
from oncall.get import KV_TIMEOUT_S, kind_arg
from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool import protocol
from warmpool.errors import PermissionDenied

__all__ = ["Deleted", "delete"]


class Deleted(msgspec.Struct, kw_only=True):
    """One ScaledObject as `delete -o json|yaml` reports it."""

    key: str
    action: str
    """``deleted``, or ``exists`` with --dry-run (nothing written)."""


async def _delete(nc: Client, keys: list[str], args: argparse.Namespace) -> list[Deleted]:
    js = nc.jetstream(timeout=KV_TIMEOUT_S)
    try:
        kv = await js.key_value(protocol.SCALERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        kv = None
    done: list[Deleted] = []
    for key in keys:
        entry = None
        if kv is not None:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:  # KeyDeletedError too: deleted is not found
                entry = None
        if entry is None or entry.value is None:
            if args.ignore_not_found:
                continue
            namespace, _, name = key.partition(".")
            raise CommandFailed(
                f'scaledobject "{name}" not found in namespace {namespace} (`pulsescale get so -A` lists them; '
                "--ignore-not-found makes this not an error)",
                EXIT_REFUSED,
            )
        if args.dry_run:
            done.append(Deleted(key=key, action="exists"))
            continue
        assert kv is not None
        # CAS on the revision read: a ScaledObject re-applied meanwhile is not deleted unseen.
        await kv.delete(key, last=entry.revision)
        done.append(Deleted(key=key, action="deleted"))
    return done


def delete(argv: list[str], prog: str, *, stdin: Any = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"Remove ScaledObjects from KV {protocol.SCALERS_BUCKET} (needs the operator's NATS user, as "
        "apply does); the autoscaler stops scaling their models. By name, or every ScaledObject of -f FILE|DIR.",
    )
    p.add_argument("kind", nargs="?", type=kind_arg, metavar="KIND", help="scaledobject (so)")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("-n", "--namespace", default=scaledobject.DEFAULT_NAMESPACE, help="[default]")
    p.add_argument("-f", "--filename", action="append", metavar="FILE|DIR", help="the ScaledObjects of these files")
    p.add_argument("-R", "--recursive", action="store_true", help="with -f DIR: its subdirectories too")
    p.add_argument("--ignore-not-found", action="store_true", help="a missing ScaledObject is not an error")
    p.add_argument("--dry-run", action="store_true", help="check that they exist, delete nothing")
    out.add_output_argument(p)
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    if args.filename:
        if args.kind or args.names:
            p.error("give either -f FILE|DIR or KIND NAME..., not both")
        try:
            manifests = load_manifests(
                args.filename, recursive=args.recursive, stdin=stdin or sys.stdin, now=0.0, max_replicas=10**9
            )
        except scaledobject.ScaledObjectError as err:
            print(f"{prog}: {err}", file=sys.stderr)
            return EXIT_REFUSED
        keys = [m.record.key for m in manifests]
    else:
        if args.kind != "scaledobject" or not args.names:
            p.error("give the ScaledObjects to delete: `scaledobject NAME...` or `-f FILE|DIR` (slots and models "
                    "are not deleted: `pulsescale drain NODE` empties a node)")  # fmt: skip
        for name in args.names:
            if not protocol.is_name(name):
                p.error(f"{name!r} is not a ScaledObject name ({protocol.NAME_PATTERN})")
        if not protocol.is_name(args.namespace):
            p.error(f"{args.namespace!r} is not a namespace name ({protocol.NAME_PATTERN})")
        keys = [f"{args.namespace}.{name}" for name in args.names]
    opts = nats_connect.options_from_args(args, name="pulsescale-delete")
    try:
        done = asyncio.run(nats_connect.run_client(opts, lambda nc: _delete(nc, keys, args)))
    except CommandFailed as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return err.code
    except PermissionDenied as err:
        print(f"{prog}: {err}; deleting from {protocol.SCALERS_BUCKET} needs the operator's NATS user, as apply "
              "does", file=sys.stderr)  # fmt: skip
        return EXIT_REFUSED
    except (nats.errors.Error, TimeoutError) as err:
        print(f"{prog}: deleting from {protocol.SCALERS_BUCKET} failed: {err}", file=sys.stderr)
        return EXIT_REFUSED
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(done, fmt))  # a list, [] when --ignore-not-found found none
    elif done:
        tail = " (dry run: nothing written)"
        print("\n".join(f"scaledobject {d.key} deleted{tail if d.action == 'exists' else ''}" for d in done))
    return 0
