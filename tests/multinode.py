"""Nodes on this machine for the multi-node tests: network namespaces with an sshd each.

Each node is a network namespace (its own address on a veth pair between the two, `NODE_IFNAME` inside both)
and a UTS namespace (its own hostname), with an sshd listening on that address only. The nodes share this
machine's filesystem, standing in for the shared filesystem the multi-node recipe requires. The harness
generates its own client key, host keys, `authorized_keys`, `known_hosts` and ssh client config under its
directory and puts an `ssh` wrapper (`ssh -F <config>`) first on PATH for the launcher and pdsh, so nothing
in ~/.ssh or /etc/ssh is read or written. The root namespace gets no address on that subnet: traffic between
the nodes stays on the namespace addresses. `stop` kills what runs in the namespaces (sshd, stage processes a
failed test left) and deletes them, the veth pair with them.

Needs root, `ip`, `unshare`, `sshd` (openssh-server), `ssh` and `pdsh`; `.ci/run` installs the packages.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.251.0"  # exists only between the namespaces (the root namespace has no route to it)
NODE_IFNAME = "smdnet"  # the same name in every namespace, so one GLOO_SOCKET_IFNAME fits all nodes
NO_SSHD_PORT = 2222  # a port nothing listens on: the hostfile entry "with no sshd behind it"
SSH_CONNECT_TIMEOUT_S = 5  # the harness's own client config (the launcher's check sets its own)
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "sshd": "openssh-server", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client", "pdsh": "pdsh"}


def setup_problem() -> str | None:
    """Why the nodes cannot be brought up here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = sorted({pkg for tool, pkg in TOOLS.items() if not _which(tool)})
    if missing:
        return f"missing packages: {' '.join(missing)} (.ci/run installs them with apt-get)"
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


def _run(argv: list[str], timeout: float = 30) -> str:
    """Run a setup command; a failure raises with its stderr (the test then fails with that reason)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


@dataclass
class Node:
    name: str  # hostname inside the node, ssh alias and hostfile name
    netns: str
    address: str
    sshd: subprocess.Popen | None = None


@dataclass
class Cluster:
    root: Path  # keys, configs, logs
    nodes: list[Node]
    ssh_config: Path
    bin_dir: Path  # holds the `ssh` wrapper
    env_file: Path  # DS_ENV_FILE: variables the launcher exports to every node
    veths: list[str] = field(default_factory=list)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def hostfile(self, names: list[str], slots: int = 1) -> Path:
        """A hostfile in the launcher's format, one `name slots=N` line per node."""
        path = self.root / f"hosts-{'-'.join(names)}"
        path.write_text("".join(f"{name} slots={slots}\n" for name in names))
        return path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with the ssh wrapper first on PATH and DS_ENV_FILE set."""
        return {**base, "PATH": f"{self.bin_dir}{os.pathsep}{base.get('PATH', '')}", "DS_ENV_FILE": str(self.env_file)}

    def ssh_argv(self, node: str, command: str) -> list[str]:
        """ssh from the first node (the root namespace has no route to the nodes) to `node`, running `command`
        there: what a user logged in on the launching node does."""
        return ["ip", "netns", "exec", self.nodes[0].netns, str(self.bin_dir / "ssh"), node, command]

    def ssh(self, node: str, command: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a shell command on a node over ssh (see `ssh_argv`)."""
        return subprocess.run(self.ssh_argv(node, command), capture_output=True, text=True, timeout=timeout, **kwargs)

    def pids_in(self, name: str) -> list[int]:
        """Processes whose network namespace is the node's."""
        target = os.stat(f"/run/netns/{self.node(name).netns}").st_ino
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.stat(entry / "ns" / "net").st_ino == target:
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def start(root: Path, names: tuple[str, ...] = ("node1", "node2"), env_lines: tuple[str, ...] = ()) -> Cluster:
    """Bring up the nodes (see the module docstring); on any failure tear down what exists and raise.
    `env_lines` (`NAME=value`) go to the launcher's environment file."""
    assert len(names) == 2, "one veth pair joins exactly two namespaces"
    root.mkdir(parents=True, exist_ok=True)
    tag = f"smd{os.getpid()}"  # unique per test process: other sessions may run the harness at the same time
    remove_stale()
    nodes = [Node(name, f"{tag}-{name}", f"{SUBNET}.{i + 1}") for i, name in enumerate(names)]
    cluster = Cluster(root, nodes, root / "ssh_config", root / "bin", root / "deepspeed_env")
    try:
        _network(cluster, tag)
        _keys_and_configs(cluster, env_lines)
        for node in nodes:
            _start_sshd(cluster, node)
        _wait_for_ssh(cluster)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _network(cluster: Cluster, tag: str) -> None:
    a, b = cluster.nodes
    for node in cluster.nodes:
        _run(["ip", "netns", "add", node.netns])
    ends = [f"{tag}a", f"{tag}b"]  # names in the root namespace only until moved (IFNAMSIZ: 15 chars)
    cluster.veths = ends
    _run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]])
    for node, end in zip((a, b), ends):
        _run(["ip", "link", "set", end, "netns", node.netns])
        inside = ["ip", "netns", "exec", node.netns]
        _run([*inside, "ip", "link", "set", end, "name", NODE_IFNAME])
        _run([*inside, "ip", "addr", "add", f"{node.address}/24", "dev", NODE_IFNAME])
        _run([*inside, "ip", "link", "set", NODE_IFNAME, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])


def _keygen(path: Path) -> str:
    for old in (path, path.with_suffix(".pub")):
        old.unlink(missing_ok=True)  # ssh-keygen would ask before overwriting
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)])
    return path.with_suffix(".pub").read_text().strip()


def _keys_and_configs(cluster: Cluster, env_lines: tuple[str, ...]) -> None:
    root = cluster.root
    client = _keygen(root / "id_ed25519")
    (root / "authorized_keys").write_text(client + "\n")
    known = []
    for node in cluster.nodes:
        host_key = _keygen(root / f"host_{node.name}")
        known.append(f"{node.name},{node.address} {' '.join(host_key.split()[:2])}")
        (root / f"sshd_{node.name}.conf").write_text("\n".join([
            f"ListenAddress {node.address}", "Port 22", f"HostKey {root / f'host_{node.name}'}",
            f"AuthorizedKeysFile {root / 'authorized_keys'}", f"PidFile {root / f'sshd_{node.name}.pid'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "PrintMotd no", "MaxStartups 64", "LogLevel ERROR", ""]))
    (root / "known_hosts").write_text("\n".join(known) + "\n")
    hosts = [f"Host {n.name}\n  HostName {n.address}\n" for n in cluster.nodes]
    # An entry whose address answers but where no sshd listens (connection refused).
    hosts.append(f"Host {cluster.nodes[1].name}-nosshd\n  HostName {cluster.nodes[1].address}\n  Port {NO_SSHD_PORT}\n"
                 f"  HostKeyAlias {cluster.nodes[1].name}\n")
    cluster.ssh_config.write_text("".join(hosts) + "\n".join([
        "Host *", "  User root", f"  IdentityFile {root / 'id_ed25519'}", "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {root / 'known_hosts'}", "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking yes", "  CheckHostIP no", "  BatchMode yes",
        f"  ConnectTimeout {SSH_CONNECT_TIMEOUT_S}", "  LogLevel ERROR", ""]))
    cluster.bin_dir.mkdir(exist_ok=True)
    wrapper = cluster.bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {_which("ssh")} -F {cluster.ssh_config} "$@"\n')
    wrapper.chmod(0o755)
    cluster.env_file.write_text("".join(f"{line}\n" for line in env_lines))


def _start_sshd(cluster: Cluster, node: Node) -> None:
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    log = open(cluster.root / f"sshd_{node.name}.log", "w")
    # A UTS namespace too, so that each node has its own hostname (what error messages name).
    node.sshd = subprocess.Popen(
        ["ip", "netns", "exec", node.netns, _which("unshare"), "--uts", "sh", "-c",
         f"hostname {node.name} && exec {_which('sshd')} -D -e -f {cluster.root / f'sshd_{node.name}.conf'}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()


def _wait_for_ssh(cluster: Cluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    for node in cluster.nodes:
        while True:
            if node.sshd is not None and node.sshd.poll() is not None:
                log = (cluster.root / f"sshd_{node.name}.log").read_text()[-500:]
                raise RuntimeError(f"sshd on {node.name} exited ({node.sshd.returncode}): {log}")
            probe = cluster.ssh(node.name, "hostname", timeout=15)
            if probe.returncode == 0 and probe.stdout.strip() == node.name:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ssh to {node.name} ({node.address}) failed: {probe.stderr.strip()[-300:]}")
            time.sleep(0.2)


def remove_stale() -> None:
    """Delete the namespaces of harness runs whose test process is gone (killed before its teardown ran),
    with what still runs in them; a live process's namespaces are left alone."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in re.findall(r"^(smd(\d+)-\S+)", listing, flags=re.MULTILINE):
        netns, pid = name[0], int(name[1])
        if not Path(f"/proc/{pid}").exists():
            stale = Cluster(Path("/nonexistent"), [Node(netns.split("-", 1)[1], netns, "")], Path(), Path(), Path())
            stop(stale)


def stop(cluster: Cluster) -> None:
    """Kill every process in the nodes' namespaces (sshd and what it started), delete the namespaces (and so
    the veth pair). Safe to call on a half-built cluster and twice."""
    for node in cluster.nodes:
        if Path(f"/run/netns/{node.netns}").exists():
            for pid in cluster.pids_in(node.name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if node.sshd is not None:
            if node.sshd.poll() is None:
                os.killpg(node.sshd.pid, signal.SIGKILL)
            node.sshd.wait(timeout=10)
    for node in cluster.nodes:
        subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
    for end in cluster.veths:  # only if never moved into a namespace
        subprocess.run(["ip", "link", "del", end], capture_output=True)
