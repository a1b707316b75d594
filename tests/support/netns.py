"""Two "nodes" on one machine: network namespaces joined by a veth pair, for multi-node tests.

Each namespace has its own loopback and one interface with an address that exists only there, so
a process in one reaches the other only over the veth, as two hosts reach each other over a
network.  A process started with :meth:`NodePair.popen` also gets the node's own hostname (a UTS
namespace) and an ``/etc/hosts`` (bind-mounted in a private mount namespace, the machine's file is
untouched) that resolves both nodes' names to their veth addresses: what torchrun (is this the
rendezvous host?) and gloo (which address do I listen on?) look at on a cluster node.  The
filesystem is otherwise shared, as a cluster's shared filesystem would be.

    with NodePair() as nodes:
        nodes.popen(0, ["python", "-c", "..."])      # runs on the first node

Creating namespaces needs root and the ``ip`` tool (iproute2); :class:`NetnsUnavailable` says
why when they cannot be made, so a test can skip with that reason.  :meth:`NodePair.close`
kills whatever still runs in the namespaces and deletes them (the veth goes with them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

IFNAME = "mrl0"  # the same interface name in both namespaces: one GLOO_SOCKET_IFNAME fits every node


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


class NodePair:
    """Two namespaces ``<prefix>-0`` and ``<prefix>-1`` with addresses ``10.231.0.1`` and ``.2``."""

    def __init__(self, prefix: str | None = None, subnet: str = "10.231.0"):
        self.names = [f"{prefix or f'mrl{os.getpid()}'}-{i}" for i in range(2)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(2)]
        self.hostnames = [f"mrl-node{i}" for i in range(2)]
        self._made: list[str] = []
        self._dir: str | None = None

    def start(self) -> "NodePair":
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        for tool in ("ip", "unshare", "mount", "hostname"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"no `{tool}` tool")
        self._dir = tempfile.mkdtemp(prefix="mrl_netns_")
        with open(os.path.join(self._dir, "hosts"), "w") as fh:
            fh.write("127.0.0.1 localhost\n")
            fh.writelines(f"{addr} {name}\n" for addr, name in zip(self.addrs, self.hostnames))
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self._made.append(name)
            a, b = self.names
            _ip("link", "add", IFNAME, "netns", a, "type", "veth", "peer", "name", IFNAME, "netns", b)
            for name, addr in zip(self.names, self.addrs):
                _ip("-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", IFNAME, "up")
            probe = subprocess.run(self.argv(0, ["hostname"]), capture_output=True, text=True, timeout=30)
            if probe.returncode != 0 or probe.stdout.strip() != self.hostnames[0]:
                raise RuntimeError(f"a node's own hostname and /etc/hosts: {probe.stderr.strip()}")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            self.close()
            raise NetnsUnavailable(f"cannot create network namespaces: {err}") from err
        return self

    def __enter__(self) -> "NodePair":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def argv(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``node``: in its namespace, under its hostname, with the nodes' hosts file."""
        setup = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "--mount", "sh", "-c", setup,
                "node", os.path.join(self._dir, "hosts"), self.hostnames[node], *argv]

    def popen(self, node: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(node, argv), **kwargs)

    def sent_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent over the veth (to the other node) since it was created."""
        link = json.loads(_ip("-n", self.names[node], "-s", "-j", "link", "show", IFNAME).stdout)[0]
        return int(link["stats64"]["tx"]["bytes"])

    def pids(self, node: int) -> list[int]:
        """Every process in node ``node``'s namespace."""
        res = _ip("netns", "pids", self.names[node], check=False)
        return [int(p) for p in res.stdout.split()]

    def kill_all(self, node: int, sig: int = signal.SIGKILL) -> list[int]:
        """``sig`` to every process of node ``node`` (a node lost as a whole); returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        for i, name in enumerate(self.names):
            if name not in self._made:
                continue
            for _ in range(50):  # processes started while we kill (a forking parent) get the next round
                if not self.kill_all(i):
                    break
                time.sleep(0.1)
            _ip("netns", "del", name, check=False)
        self._made.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
