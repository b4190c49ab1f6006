"""Emulated hosts on one machine: network namespaces on a switch, with shaped links.

A :class:`Cluster` of N hosts is N network namespaces ``<prefix>h<i>``, each
with one veth interface ``<prefix>e<i>`` (address ``10.<net>.0.<i+1>/24``)
whose peer is a port of the bridge ``br0`` in a switch namespace
``<prefix>sw``. Nothing is attached to the root namespace, so no bench traffic
ever touches the machine's own interfaces.

Each host link is shaped in both directions: a token bucket (``tbf``) on the
host end's egress is the host's upload, one on the switch end's egress its
download. Where the kernel has ``sch_netem`` a one-way delay is added under
each bucket. iproute2's ``tbf`` rate table covers packets up to 2047 bytes, so
the bucket segments GSO super-packets into MTU-sized frames: the counters of a
shaped interface then count frames as a 1500-MTU Ethernet would carry them.

Names carry a per-run prefix (``slb<pid % 10000>``) so that concurrent runs
never collide; :meth:`Cluster.close` (also run by ``atexit``, and SIGTERM /
SIGINT / SIGHUP become an exit that runs it) kills the processes left inside
the cluster's namespaces and deletes every namespace, which deletes their veth
ends.

    python -m bench.netns check          # can this machine create namespaces?
    python -m bench.netns list           # namespaces left by bench runs (slb<digits>...)
    python -m bench.netns cleanup PREFIX # delete the namespaces of a prefix
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import weakref

__all__ = [
    "kill_processes",
    "HEADER_BYTES",
    "MSS",
    "MTU_FRAME",
    "Cluster",
    "delete_prefix",
    "list_namespaces",
    "netem_available",
    "netns_unsupported",
    "tcp_throughput",
]

# Ethernet (14) + IPv4 (20) + TCP with the timestamp option (32): the headers of every frame the
# bench's TCP traffic puts on a link; a 1500-byte MTU leaves MSS = 1448 bytes of payload per frame.
HEADER_BYTES = 14 + 20 + 32
MSS = 1500 - 20 - 32
MTU_FRAME = MSS + HEADER_BYTES
PREFIX_RE = re.compile(r"^slb\d+(sw|h\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str) -> None:
    res = subprocess.run(["tc", *args], check=False, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed: {res.stderr.strip()}")


def _has_cap_net_admin() -> bool:
    """CAP_NET_ADMIN (bit 12) in this process's effective capability set."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 12 & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def netns_unsupported() -> str | None:
    """Why this machine cannot run the bench (None when it can): tools, privileges, a trial namespace."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    if not _has_cap_net_admin():
        return "needs root or CAP_NET_ADMIN to create network namespaces (run as root)"
    probe = f"slb{os.getpid() % 10000}probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"'ip netns add' fails here: {res.stderr.strip() or res.returncode}"
    try:
        res = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if res.returncode != 0:
            return f"cannot create veth pairs: {res.stderr.strip()}"
        res = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"cannot create a bridge: {res.stderr.strip()}"
        res = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit",
                              "burst", "32kb", "limit", "64kb"], check=False, capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            return f"cannot shape links with tc tbf: {res.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether the kernel has the ``netem`` qdisc (link delay); probed in a throwaway namespace."""
    probe = f"slb{os.getpid() % 10000}netem"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        res = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
                             check=False, capture_output=True, text=True, timeout=30)
        return res.returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def list_namespaces(prefix: str | None = None) -> list[str]:
    """Namespaces of the bench (all runs, or those of ``prefix``)."""
    out = _ip("netns", "list").stdout.split()
    names = [w for w in out if PREFIX_RE.match(w)]
    return [n for n in names if prefix is None or re.fullmatch(re.escape(prefix) + r"(sw|h\d+)", n)]


def kill_processes(namespaces: list[str], timeout_s: float = 5.0) -> int:
    """SIGKILL every process inside ``namespaces`` (a process keeps a deleted namespace alive); returns how many."""
    pids = {int(p) for ns in namespaces for p in _ip("netns", "pids", ns, check=False).stdout.split()}
    pids.discard(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in pids):
        time.sleep(0.05)
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def delete_prefix(prefix: str) -> list[str]:
    """Stop the processes in the namespaces of ``prefix``, delete the namespaces (their veth ends go with
    them); returns those that remain."""
    names = list_namespaces(prefix)
    kill_processes(names)
    for name in names:
        _ip("netns", "del", name, check=False)
    return list_namespaces(prefix)


_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()
_HANDLERS_INSTALLED = False


def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


def _on_signal(signum, frame) -> None:
    # an exception, not an exit: the `finally` blocks and context managers of the bench run (its workers are
    # stopped, its clusters closed), then atexit closes whatever is left
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_close_all)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread: atexit and close() still clean up
            pass
    _HANDLERS_INSTALLED = True


def _rate_arg(mbit: float) -> str:
    return f"{round(mbit * 1000)}kbit"


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Depth of each shaped link's token bucket: 2 ms of traffic, at least 64 KiB, so that the bucket's
    timer granularity does not cap the rate. A link idle for burst / rate (52 ms at 10 Mbit/s) sends
    its next burst bytes at once: the scaling model's validation accounts for it."""
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


class Cluster:
    """N hosts on a switch; use as a context manager (or call :meth:`close`)."""

    def __init__(self, hosts: int, *, rate_mbit: float | None = None, delay_ms: float = 0.0,
                 prefix: str | None = None, net: int | None = None):
        if not (isinstance(hosts, int) and 1 <= hosts <= 250):
            raise ValueError(f"invalid hosts={hosts!r}: must be an integer in [1, 250]")
        self.hosts = hosts
        self.prefix = prefix or f"slb{os.getpid() % 10000}"
        if not re.fullmatch(r"slb\d+", self.prefix):
            raise ValueError(f"invalid prefix={self.prefix!r}: must be 'slb' followed by digits")
        self.net = (os.getpid() % 200) + 20 if net is None else net
        self.switch = f"{self.prefix}sw"
        self.ns = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.dev = [f"{self.prefix}e{i}" for i in range(hosts)]        # host end
        self.port = [f"{self.prefix}p{i}" for i in range(hosts)]       # switch end
        self.addr = [f"10.{self.net}.0.{i + 1}" for i in range(hosts)]
        self.rate_mbit: float | None = None
        self.delay_ms = 0.0
        self._closed = False
        _install_handlers()
        _LIVE.add(self)
        if list_namespaces(self.prefix):
            raise RuntimeError(f"namespaces of prefix {self.prefix} exist already (a run of the same pid "
                               f"suffix?): delete them with `python -m bench.netns cleanup {self.prefix}`")
        try:
            self._create()
            self.shape(rate_mbit, delay_ms)
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for ns, dev, port, addr in zip(self.ns, self.dev, self.port, self.addr):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")  # gloo and torchrun's agent use loopback too
            _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def _qdisc(self, ns: str, dev: str, rate_mbit: float | None, delay_ms: float) -> None:
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False, capture_output=True, timeout=30)
        if rate_mbit is None and delay_ms == 0:
            return
        parent = ["root"]
        if rate_mbit is not None:
            rate_bps = rate_mbit * 1e6 / 8
            # limit: 100 ms of traffic (>= 1 MiB) so TCP's window does not overflow it into drops
            burst = tbf_burst_bytes(rate_mbit)
            limit = max(1024 * 1024, int(rate_bps * 0.1))
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", _rate_arg(rate_mbit),
                "burst", str(burst), "limit", str(limit))
            parent = ["parent", "1:1"]
        if delay_ms > 0:
            _tc("-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem", "delay",
                f"{delay_ms}ms", "limit", "100000")

    def shape(self, rate_mbit: float | None, delay_ms: float = 0.0) -> None:
        """Limit every host link to ``rate_mbit`` each way (None: unlimited) with ``delay_ms`` one way."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"invalid rate_mbit={rate_mbit!r}: must be > 0, or None for an unlimited link")
        if not delay_ms >= 0:
            raise ValueError(f"invalid delay_ms={delay_ms!r}: must be >= 0")
        for ns, dev, port in zip(self.ns, self.dev, self.port):
            self._qdisc(ns, dev, rate_mbit, delay_ms)             # upload
            self._qdisc(self.switch, port, rate_mbit, delay_ms)   # download
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms

    def counters(self, i: int) -> dict:
        """Interface counters of host ``i``'s link (host end): tx/rx bytes and packets, drops."""
        out = _ip("-n", self.ns[i], "-s", "-j", "link", "show", "dev", self.dev[i]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {f"{d}_{k}": int(stats[d][k]) for d in ("tx", "rx") for k in ("bytes", "packets", "dropped")}

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host ``i``."""
        return ["ip", "netns", "exec", self.ns[i]]

    def close(self) -> None:
        if self._closed:
            return
        left = delete_prefix(self.prefix)
        if left:
            print(f"[netns] could not delete {left}", file=sys.stderr, flush=True)
        self._closed = True
        _LIVE.discard(self)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Cluster({self.hosts} hosts, prefix={self.prefix}, rate={self.rate_mbit} Mbit/s, "
                f"delay={self.delay_ms} ms)")


_TCP_SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); got, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.perf_counter()
        got += len(b)
    print(got, time.perf_counter() - t0, flush=True)
""")
_TCP_SOURCE = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = bytes(1 << 20); sent = 0
    while sent < int(sys.argv[3]):
        c.sendall(buf); sent += len(buf)
    c.close()
""")


def tcp_throughput(cluster: Cluster, src: int, dst: int, nbytes: int = 32 << 20, port: int = 5201) -> dict:
    """One TCP stream from host ``src`` to ``dst``: payload Mbit/s at the receiver, and the link counters."""
    sink = subprocess.Popen([*cluster.exec_prefix(dst), sys.executable, "-c", _TCP_SINK, cluster.addr[dst],
                             str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("the TCP sink did not start")
        before = cluster.counters(src)
        subprocess.run([*cluster.exec_prefix(src), sys.executable, "-c", _TCP_SOURCE, cluster.addr[dst],
                        str(port), str(nbytes)], check=True, timeout=600)
        got, seconds = sink.communicate(timeout=60)[0].split()
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    after = cluster.counters(src)
    tx_bytes = after["tx_bytes"] - before["tx_bytes"]
    tx_packets = after["tx_packets"] - before["tx_packets"]
    return {"payload_bytes": int(got), "seconds": float(seconds), "mbit_s": int(got) * 8 / float(seconds) / 1e6,
            "tx_bytes": tx_bytes, "tx_packets": tx_packets, "tx_payload_bytes": tx_bytes - HEADER_BYTES * tx_packets,
            "rate_mbit": cluster.rate_mbit, "delay_ms": cluster.delay_ms}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="network namespaces of the bandwidth bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="can this machine create the bench's namespaces?")
    sub.add_parser("list", help="namespaces left by bench runs")
    c = sub.add_parser("cleanup", help="delete the namespaces of a prefix (slb<digits>)")
    c.add_argument("prefix")
    a = p.parse_args(argv)
    if a.cmd == "check":
        why = netns_unsupported()
        print(why or f"ok (netem delay: {'available' if netem_available() else 'not in this kernel'})")
        return 1 if why else 0
    if a.cmd == "list":
        print("\n".join(list_namespaces()))
        return 0
    if not re.fullmatch(r"slb\d+", a.prefix):
        raise SystemExit(f"invalid prefix {a.prefix!r}: must be 'slb' followed by digits (see `list`)")
    left = delete_prefix(a.prefix)
    print(f"left: {left}" if left else "deleted")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
