"""Two test hosts on one machine, for multi-node jobs without a cluster (needs root).

`make_two_hosts` creates two network namespaces joined by a veth pair: hosts h0
and h1 with addresses .1 and .2 of a private /24 on interface `mnv`, loopback
up, and no default route, so nothing they run can reach any address outside
the two namespaces. A command runs "on" a host through the `onhost` wrapper:
its namespace, plus private UTS and mount namespaces where the host gets its
own hostname (two ranks with one hostname confuse DeepSpeed's local-rank
check) and a hosts file naming h0 and h1. Directories listed with `hide()` are
covered by an empty tmpfs on that host only: a host that does not share a
filesystem with the other.

The `ssh` in `agent_dir` stands in for ssh between the hosts: it drops ssh's
options, takes the host name and runs the command through a shell with a clean
environment (`env -i`, as sshd does) on that host. Put `agent_dir` first on
PATH: Open MPI's rsh launcher and the deepspeed runner both call `ssh` by name.

Both namespace names carry the creating process id, so a run never meets
another run's hosts, and namespaces left by a killed run are removed by the
next one. Manual use (tears the hosts down on exit, Ctrl-C or SIGTERM)::

    sudo .venv/bin/python -m tests.multinode -- bash launch/run_mpi.sh --hostfile {hostfile} ...
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from tests.launching import REPO, job_env

HOSTS = ("h0", "h1")
INTERFACE = "mnv"
SUBNET = "10.77.0"  # a private /24 that exists only inside the two namespaces
NAMESPACE_PREFIX = "dsctest"
# The PATH sshd gives a command: the stand-in agent starts remote commands with it, like ssh would.
SSHD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAMESPACE_NAME = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)x\d+h\d$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def cannot_make_hosts() -> Optional[str]:
    """Why two test hosts cannot be made here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "multi-node tests need root (network namespaces, hostnames, bind mounts)"
    missing = [tool for tool in ("ip", "unshare", "mount", "mpirun") if shutil.which(tool) is None]
    if missing:
        return f"multi-node tests need {', '.join(missing)} on PATH"
    probe = f"{NAMESPACE_PREFIX}{os.getpid()}x0probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        inside = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "--mount", "true"],
                                capture_output=True, text=True, timeout=30)
        if inside.returncode != 0:
            return f"cannot make UTS and mount namespaces: {inside.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot create namespaces: {err}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL what still runs in one of our namespaces (only our jobs ever run there)."""
    listed = _ip("netns", "pids", namespace, check=False)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_stale_namespaces() -> None:
    """Delete test namespaces whose creating process is gone (a run killed before its teardown)."""
    listed = _ip("netns", "list", check=False)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAMESPACE_NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _kill_namespace_processes(name)
            _ip("netns", "delete", name, check=False)


ON_HOST_SCRIPT = """#!/bin/sh
# Run a command "on" a test host: in its network namespace, with its own hostname and hosts file
# (private UTS and mount namespaces; unshare makes mounts private, so nothing leaks to the machine),
# and with the folders listed in hide.HOST covered by an empty tmpfs (a host not sharing them).
set -eu
host=${{1:?usage: onhost HOST COMMAND...}}; shift
case $host in
{cases}
  *) echo "onhost: no test host named $host" >&2; exit 255 ;;
esac
exec ip netns exec "$namespace" unshare --uts --mount sh -c '
  mount --bind "$1" /etc/hosts && hostname "$2" || exit 255
  if [ -f "$3" ]; then
    while IFS= read -r folder; do mount -t tmpfs none "$folder" || exit 255; done < "$3"
  fi
  shift 3; exec "$@"' onhost {hosts_file} "$host" {root}/hide."$host" "$@"
"""

AGENT_SCRIPT = """#!/bin/sh
# ssh stand-in for the test hosts: drop ssh's options, take the host name, and run the command the
# way sshd does (one shell command line, clean environment) on that host.
while [ $# -gt 0 ]; do
  case $1 in
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;  # an option and its value
    -*) shift ;;                            # a flag, or an option with its value attached (-oX=y)
    *) break ;;
  esac
done
host=${{1:?usage: ssh [options] HOST [COMMAND...]}}; shift
case $host in
  {known}) ;;
  *) echo "ssh: Could not resolve hostname $host: Name or service not known" >&2; exit 255 ;;
esac
exec env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/sh PATH={sshd_path} \\
  {on_host} "$host" /bin/sh -c "$*"
"""


@dataclass
class TwoHosts:
    """Hosts h0 and h1 (see the module docstring); `teardown` removes them, and is safe to repeat."""

    root: Path
    namespaces: dict[str, str]
    addresses: dict[str, str]
    interface: str = INTERFACE
    _torn_down: bool = field(default=False, repr=False)

    @property
    def on_host(self) -> Path:
        return self.root / "onhost"

    @property
    def agent_dir(self) -> Path:
        """A folder holding only `ssh`, the stand-in agent: put it first on PATH."""
        return self.root / "agent"

    def hostfile(self, hosts: Sequence[str] = HOSTS, slots: int = 1, name: str = "hostfile") -> Path:
        path = self.root / name
        path.write_text("".join(f"{host} slots={slots}\n" for host in hosts))
        return path

    @contextlib.contextmanager
    def hide(self, host: str, folder: Path) -> Iterator[None]:
        """While inside, commands started on `host` see an empty tmpfs at `folder`."""
        listing = self.root / f"hide.{host}"
        listing.write_text(f"{folder}\n")
        try:
            yield
        finally:
            listing.unlink(missing_ok=True)

    def env(self, extra: Optional[dict] = None) -> dict:
        """The job environment of tests.launching for a two-host job: gloo and MPI on the veth link,
        rank 0's address from MPI (no MASTER_ADDR), the ssh stand-in first on PATH."""
        env = job_env({"GLOO_SOCKET_IFNAME": self.interface, "NET_IF": self.interface, **(extra or {})})
        env.pop("MASTER_ADDR", None)
        env["PATH"] = f"{self.agent_dir}{os.pathsep}{env['PATH']}"
        return env

    def run(self, host: str, command: Sequence[str], timeout: float, env_extra: Optional[dict] = None,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        """Run `command` on `host` with a timeout; on timeout everything in both hosts is killed."""
        process = subprocess.Popen([str(self.on_host), host, *command], cwd=cwd or REPO, env=self.env(env_extra),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_jobs()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(process.args, timeout, stdout, stderr) from None
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def kill_jobs(self) -> None:
        for namespace in self.namespaces.values():
            _kill_namespace_processes(namespace)

    def teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self.kill_jobs()
        for namespace in self.namespaces.values():
            _ip("netns", "delete", namespace, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def make_two_hosts(root: Optional[Path] = None) -> TwoHosts:
    """Create h0 and h1; on any failure whatever was made is removed before the error propagates."""
    remove_stale_namespaces()
    root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="two_hosts_"))
    root.mkdir(parents=True, exist_ok=True)
    run_id = f"{NAMESPACE_PREFIX}{os.getpid()}x{time.monotonic_ns() % 10**9}"
    hosts = TwoHosts(root=root, namespaces={host: f"{run_id}{host}" for host in HOSTS},
                     addresses={host: f"{SUBNET}.{index + 1}" for index, host in enumerate(HOSTS)})
    atexit.register(hosts.teardown)  # a backstop: pytest's finalizer normally runs first
    try:
        for namespace in hosts.namespaces.values():
            _ip("netns", "add", namespace)
        first, second = (hosts.namespaces[host] for host in HOSTS)
        _ip("link", "add", INTERFACE, "netns", first, "type", "veth", "peer", "name", INTERFACE, "netns", second)
        for host, namespace in hosts.namespaces.items():
            _ip("-n", namespace, "addr", "add", f"{hosts.addresses[host]}/24", "dev", INTERFACE)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
        _write_scripts(hosts)
    except BaseException:
        hosts.teardown()
        raise
    return hosts


def _write_scripts(hosts: TwoHosts) -> None:
    hosts_file = hosts.root / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in hosts.addresses.items()))
    cases = "\n".join(f"  {host}) namespace={namespace} ;;" for host, namespace in hosts.namespaces.items())
    hosts.on_host.write_text(ON_HOST_SCRIPT.format(cases=cases, hosts_file=hosts_file, root=hosts.root))
    hosts.agent_dir.mkdir(exist_ok=True)
    agent = hosts.agent_dir / "ssh"
    agent.write_text(AGENT_SCRIPT.format(known="|".join(HOSTS), sshd_path=SSHD_PATH, on_host=hosts.on_host))
    for script in (hosts.on_host, agent):
        script.chmod(0o755)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Create two test hosts, run a command on h0 ('{hostfile}' in it is replaced by a hostfile "
                    "naming h0 and h1), remove the hosts.")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the command is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    reason = cannot_make_hosts()
    if reason:
        parser.exit(2, f"{reason}\n")
    hosts = make_two_hosts()
    # SIGTERM becomes an exception, so the finally below removes the hosts on that path too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        hostfile = str(hosts.hostfile())
        result = hosts.run("h0", [part.replace("{hostfile}", hostfile) for part in command], timeout=args.timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        return result.returncode
    finally:
        hosts.teardown()


if __name__ == "__main__":
    sys.exit(main())
