"""A shaped network of hosts on one machine: Linux network namespaces, veth pairs, a bridge, ``tc``.

Each host is a network namespace with one interface ``gc<i>v`` and the address ``10.77.0.<i+1>``.
Two hosts are joined by one veth pair; more hosts each get a veth into a bridge that lives in a
namespace of its own. Each host's interface is shaped on egress with
``tc qdisc add dev IF root tbf rate R burst 256kb latency 50ms``, so the traffic between ranks is
real TCP through the kernel at a real bandwidth limit. Only addresses inside the namespaces made
here are used; nothing touches the machine's own interfaces.

Every namespace is named ``lgcb<pid>-<suffix>``: the prefix marks it as ours and the pid says which
process made it, so :func:`cleanup` can remove the leftovers of a run that was killed without
touching a run that is still going. Interfaces are created directly inside the namespaces, so no
name ever appears in the machine's own namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["PREFIX", "Topology", "available", "cleanup", "list_namespaces", "parse_rate", "rank_prefix"]

PREFIX = "lgcb"
BURST = "256kb"
LATENCY = "50ms"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(rate: str) -> float:
    """``"100mbit"`` -> 1e8 bits per second (the units ``tc`` takes: bit, kbit, mbit, gbit)."""
    m = _RATE.match(rate.strip().lower())
    if not m:
        raise ValueError(f"rate must look like 10mbit, 100mbit or 1gbit (units: {', '.join(_UNITS)}), got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def available() -> tuple[bool, str]:
    """Whether namespaces can be built here, and why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return False, f"cannot create a network namespace: {made.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def _owner_alive(name: str, prefix: str) -> bool:
    m = re.match(re.escape(prefix) + r"(\d+)-", name)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str = PREFIX, force: bool = False) -> list[str]:
    """Delete namespaces of ``prefix`` left by runs whose process is gone (all of them with
    ``force``). Returns the names deleted."""
    removed = []
    for name in list_namespaces(prefix):
        if force or not _owner_alive(name, prefix):
            if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


class Topology:
    """``hosts`` namespaces joined at ``rate``; a context manager that always tears down.

    Attributes:
        namespaces: the host namespaces, rank order.
        ifaces: each host's interface name (inside its namespace).
        addrs: each host's address; ``addrs[0]`` is the rendezvous (MASTER_ADDR).
    """

    def __init__(self, hosts: int, rate: str, prefix: str = PREFIX, tag: str = "") -> None:
        if hosts < 2:
            raise ValueError(f"hosts must be >= 2, got {hosts}")
        parse_rate(rate)
        self.hosts = hosts
        self.rate = rate
        base = f"{prefix}{os.getpid()}-{tag}"
        self.namespaces = [f"{base}h{i}" for i in range(hosts)]
        self.bridge = f"{base}br" if hosts > 2 else None
        self.ifaces = [f"gc{i}v" for i in range(hosts)]
        self.addrs = [f"10.77.0.{i + 1}" for i in range(hosts)]
        self.made: list[str] = []

    # ----------------------------------------------------------------------------------------------
    def up(self) -> Topology:
        try:
            for ns in self.namespaces + ([self.bridge] if self.bridge else []):
                _run(["ip", "netns", "add", ns])
                self.made.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.bridge is None:
                a, b = self.namespaces
                _run(
                    [
                        "ip",
                        "-n",
                        a,
                        "link",
                        "add",
                        self.ifaces[0],
                        "type",
                        "veth",
                        "peer",
                        "name",
                        self.ifaces[1],
                        "netns",
                        b,
                    ]
                )
            else:
                br = self.bridge
                _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
                _run(["ip", "-n", br, "link", "set", "br0", "up"])
                for i, ns in enumerate(self.namespaces):
                    port = f"p{i}"
                    _run(
                        [
                            "ip",
                            "-n",
                            ns,
                            "link",
                            "add",
                            self.ifaces[i],
                            "type",
                            "veth",
                            "peer",
                            "name",
                            port,
                            "netns",
                            br,
                        ]
                    )
                    _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
                    _run(["ip", "-n", br, "link", "set", port, "up"])
            for ns, iface, addr in zip(self.namespaces, self.ifaces, self.addrs):
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface])
                _run(["ip", "-n", ns, "link", "set", iface, "up"])
                _run(["ip", "netns", "exec", ns] + shape_command("add", iface, self.rate))
        except BaseException:
            self.down()
            raise
        return self

    def set_rate(self, rate: str) -> None:
        for ns, iface in zip(self.namespaces, self.ifaces):
            _run(["ip", "netns", "exec", ns] + shape_command("change", iface, rate))
        self.rate = rate

    def exec_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program on host ``rank``."""
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def down(self) -> None:
        """Delete every namespace this topology made (the veths and the bridge go with them)."""
        while self.made:
            _run(["ip", "netns", "del", self.made.pop()], check=False)

    def __enter__(self) -> Topology:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def shape_command(action: str, iface: str, rate: str) -> list[str]:
    """``tc qdisc {add,change} dev IF root tbf rate R burst 256kb latency 50ms``."""
    return ["tc", "qdisc", action, "dev", iface, "root", "tbf", "rate", rate, "burst", BURST, "latency", LATENCY]


def rank_prefix(rank: int, hosts: int, master: str, port: int, topo: Topology | None = None) -> list[str]:
    """The command prefix that starts rank ``rank`` the way a multi-node Lightning user starts a
    node: on its host (``topo``'s namespace; ``None``: loopback), with Lightning's environment
    (``MASTER_ADDR``, ``NODE_RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``, gloo's interface) and pinned
    to one core with ``taskset`` where it exists (core ``rank`` modulo the usable cores)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env = {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(hosts),
        "NODE_RANK": str(rank),
        "LOCAL_RANK": "0",
        "GLOO_SOCKET_IFNAME": topo.ifaces[rank] if topo else "lo",
        "OMP_NUM_THREADS": "1",
    }
    cmd = (topo.exec_prefix(rank) if topo else []) + ["env"] + [f"{k}={v}" for k, v in env.items()]
    return cmd + (["taskset", "-c", str(cores[rank % len(cores)])] if shutil.which("taskset") else [])
