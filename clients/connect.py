"""Join a federation from a device: ``python -m clients.connect --superlink H:P --profile NAME``.

What a person runs on a device with CPython and PyTorch (a Linux board such as a
Raspberry Pi or a Jetson, a laptop) to train with its own data; a phone joins from its
browser instead (:mod:`clients.gateway`). It checks what it is given, then
becomes a Flower SuperNode (``flower-supernode``, same process id) whose node config
carries what the ClientApp reads on this device:

``device-profile``
    The preset this device declares itself as (``conf/devices/profiles/presets.yaml``);
    its memory budget holds, and its times are its own (nothing is emulated).
``data-path``
    Its own training data (``--data``: a parquet file or folder, see
    :func:`splitlearn.data.local_dataset`); without it the device trains partition
    ``--partition-id`` of ``--num-partitions`` of the run's dataset.
``trunk-root-certificates``
    With ``--root-certificates``: the same roots verify the SuperLink and the trunk
    service, and a task whose trunk is plaintext is refused.
``cache-dir``
    Where the device keeps its training data between rounds (``--cache-dir``; every
    message starts a fresh ClientApp process, which would load it afresh).
``privacy-*``
    Its privacy floor and ledger (:mod:`splitlearn.privacy.floor`,
    :mod:`splitlearn.privacy.ledger`): the server cannot ask it for less.

The SuperNode also serves a runtime API on 127.0.0.1 for the ClientApp processes it
starts, on Flower's port 9094 by default: a second device on the same host finds it
taken, so without ``--port`` this takes a free one and says which, and a ``--port``
that is taken fails here, naming it, instead of in Flower.

Only the client's dependencies are imported here and in the ClientApp (no Ray, Hydra
or W&B). ``--dry-run`` prints the SuperNode command instead of running it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from clients.app import CACHE_KEY, DATA_KEY, TRUNK_ROOTS_KEY
from clients.device import PROFILE_KEY, preset_profiles
from splitlearn.privacy.floor import FLOOR_KEYS, PrivacyFloor
from splitlearn.privacy.ledger import LEDGER_KEY


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line (argparse exits with a message naming a bad flag)."""
    parser = argparse.ArgumentParser(
        prog="python -m clients.connect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--superlink", required=True, metavar="HOST:PORT",
                        help="the SuperLink's Fleet API address")
    parser.add_argument("--profile", required=True, choices=sorted(preset_profiles()),
                        help="the device preset this device is (its memory budget holds)")
    parser.add_argument("--data", type=Path, metavar="PATH",
                        help="this device's own training data (parquet file or folder)")
    security = parser.add_mutually_exclusive_group()
    security.add_argument("--root-certificates", type=Path, metavar="FILE",
                          help="PEM roots that verify the SuperLink and the trunk (TLS)")
    security.add_argument("--insecure", action="store_true",
                          help="no TLS to the SuperLink (testing only; the trunk follows the task)")
    parser.add_argument("--auth-key", type=Path, metavar="FILE",
                        help="this device's EC private key (OpenSSH format), if the SuperLink "
                             "authenticates SuperNodes")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(), metavar="FOLDER",
                        help="where this device keeps its training data between rounds "
                             "(default: %(default)s)")
    parser.add_argument("--no-cache", action="store_true",
                        help="load the training data afresh every round")
    parser.add_argument("--partition-id", type=int, default=0,
                        help="this device's index (its share of the run's data without --data)")
    parser.add_argument("--num-partitions", type=int, default=1)
    parser.add_argument("--port", type=port_number, default=None, metavar="PORT",
                        help="port of the SuperNode's runtime API on 127.0.0.1, one per "
                             f"SuperNode on a host (default: {FLOWER_RUNTIME_PORT}, or a free "
                             "one if that is taken)")
    parser.add_argument("--max-wait-time", type=float, default=None,
                        help="give up after this many seconds without the SuperLink")
    floor = parser.add_argument_group("privacy floor (what this device accepts from the server)")
    floor.add_argument("--privacy-option", choices=["activation_gaussian", "dpsgd_client"])
    floor.add_argument("--min-noise-multiplier", type=float)
    floor.add_argument("--max-delta", type=float)
    floor.add_argument("--epsilon-max", type=float)
    floor.add_argument("--label-epsilon-max", type=float,
                       help="require label DP (randomised response) at this epsilon or below")
    floor.add_argument("--secure-aggregation", action="store_true", default=None,
                       help="send this device's weights only masked by SecAgg+ "
                            "(refuse a round without aggregation.secure)")
    floor.add_argument("--privacy-ledger", type=Path, metavar="FILE",
                       help="where this device keeps its privacy spend across restarts")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    return parser.parse_args(argv)


#: Flower's default port for a SuperNode's runtime API (``flower-supernode --port``).
FLOWER_RUNTIME_PORT = 9094
#: Where the SuperNode serves it (``flower-supernode --host``'s default).
RUNTIME_HOST = "127.0.0.1"


def port_number(text: str) -> int:
    """Parse a TCP port (argparse names the flag with the message this raises)."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return int(text)


def port_is_free(port: int, host: str = RUNTIME_HOST) -> bool:
    """Whether a server could listen on ``host:port`` now (as the SuperNode's would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def runtime_port(requested: int | None) -> tuple[int, str | None]:
    """Return the SuperNode's runtime API port, and a note when it is not the one expected.

    ``requested`` (``--port``) must be free: ValueError naming the flag otherwise. Without
    it, Flower's :data:`FLOWER_RUNTIME_PORT` if free, else any free port (another SuperNode
    on this host holds Flower's). A port could still be taken between this look and the
    SuperNode's start; Flower then fails naming the address.
    """
    if requested is not None:
        if not port_is_free(requested):
            raise ValueError(f"--port {requested}: {RUNTIME_HOST}:{requested} is in use (another "
                             "SuperNode on this host?); give each SuperNode its own --port")
        return requested, None
    if port_is_free(FLOWER_RUNTIME_PORT):
        return FLOWER_RUNTIME_PORT, None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((RUNTIME_HOST, 0))
        port = probe.getsockname()[1]
    return port, (f"port {FLOWER_RUNTIME_PORT} is in use (another SuperNode on this host?): "
                  f"this SuperNode's runtime API takes {port} (choose one with --port)")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/splitlearn``, else ``~/.cache/splitlearn``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitlearn"


def node_config(args: argparse.Namespace) -> dict[str, object]:
    """Return the node config the ClientApp reads (ValueError naming a bad value)."""
    if not 0 <= args.partition_id < args.num_partitions:
        raise ValueError(f"--partition-id {args.partition_id} must be in "
                         f"0..{args.num_partitions - 1} (--num-partitions {args.num_partitions})")
    config: dict[str, object] = {"partition-id": args.partition_id,
                                 "num-partitions": args.num_partitions,
                                 PROFILE_KEY: args.profile}
    paths = {DATA_KEY: args.data, TRUNK_ROOTS_KEY: args.root_certificates,
             LEDGER_KEY: args.privacy_ledger, CACHE_KEY: None if args.no_cache else args.cache_dir}
    for key, path in paths.items():
        if path is not None:
            config[key] = str(path.resolve())
    for flag in ("data", "root_certificates", "auth_key"):
        path = getattr(args, flag)
        if path is not None and not path.exists():
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file or folder")
    floor = {field: getattr(args, field) for field in FLOOR_KEYS
             if getattr(args, field, None) is not None}
    floor |= {"option": args.privacy_option} if args.privacy_option else {}
    PrivacyFloor(**floor)  # checks the values, naming the node-config key
    config |= {FLOOR_KEYS[field]: value for field, value in floor.items()}
    return config


def format_node_config(config: dict[str, object]) -> str:
    """Flower's ``--node-config`` text: space-separated ``key=value``, strings quoted."""
    parts = []
    for key, value in config.items():
        if isinstance(value, bool):
            value = str(value).lower()  # a TOML boolean
        elif isinstance(value, str):
            if '"' in value:
                raise ValueError(f"{key}={value!r}: a value cannot contain a double quote")
            value = json.dumps(value)  # a TOML basic string
        parts.append(f"{key}={value}")
    return " ".join(parts)


def supernode_command(args: argparse.Namespace, *, port: int | None = None,
                      extra: dict[str, object] | None = None) -> list[str]:
    """Return the ``flower-supernode`` command line for ``args``.

    ``port`` is the runtime API's (see :func:`runtime_port`); None: ``--port``, if given.
    ``extra`` adds node-config keys (the gateway's, for a phone's node).
    """
    executable = Path(sys.executable).with_name("flower-supernode")
    command = [str(executable) if executable.exists() else
               shutil.which("flower-supernode") or "flower-supernode",
               "--superlink", args.superlink,
               "--node-config", format_node_config(node_config(args) | (extra or {}))]
    if args.insecure:
        command.append("--insecure")
    elif args.root_certificates is not None:
        command += ["--root-certificates", str(args.root_certificates.resolve())]
    if args.auth_key is not None:
        command += ["--auth-supernode-private-key", str(args.auth_key.resolve())]
    port = args.port if port is None else port
    if port is not None:
        command += ["--port", str(port)]
    if args.max_wait_time is not None:
        command += ["--max-wait-time", str(args.max_wait_time)]
    return command


def main(argv: Sequence[str] | None = None) -> None:
    """Check the arguments, then become the SuperNode (or print its command)."""
    args = parse_args(argv)
    try:
        port, note = runtime_port(args.port)
        command = supernode_command(args, port=port)
    except ValueError as err:
        sys.exit(f"clients.connect: {err}")
    if note is not None:
        print(f"clients.connect: {note}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(" ".join(command))
        return
    print(f"joining {args.superlink} as a {args.profile} (partition {args.partition_id} of "
          f"{args.num_partitions}); Ctrl-C leaves", flush=True)
    os.environ["PATH"] = with_own_tools(os.environ.get("PATH", ""))
    os.execvp(command[0], command)


def with_own_tools(path: str) -> str:
    """Return ``path`` with this interpreter's scripts folder first.

    The SuperNode starts Flower's other tools (``flower-superexec``, ``flwr-clientapp``) by
    name: run by a virtual environment's ``python`` without activating it, it would not
    find them.
    """
    return os.pathsep.join([str(Path(sys.executable).parent), path])


if __name__ == "__main__":
    main()
