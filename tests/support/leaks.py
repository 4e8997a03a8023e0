"""Leak counting for fault tests: a surviving process must return to its thread and open-fd counts
of before the fault, and nothing of kvwire's may be left in /dev/shm.

``LeakBaseline.take({"prefill-0": pid, ...})`` reads ``/proc/PID/task``, ``/proc/PID/fd`` and the
shared-memory objects each process maps (``/dev/shm/*`` files and memfds, from ``/proc/PID/maps``),
plus the names in /dev/shm. :meth:`LeakBaseline.wait_back` polls (no sleeps as synchronization)
until every survivor is back at or below its counts and no new /dev/shm name is left that no live
process maps; at the deadline it fails the test naming each excess (new sockets as ``tcp :local ->
:remote STATE``, counts by named port). Counts, not identities: a connection closed and reopened is
no leak, one more of them is. Established connections on ``pooled_ports`` (HTTP keep-alive pools,
sized by the load's concurrency and bounded by their client) are not counted; half-closed ones are.

/dev/shm is host-wide, so only kvwire's own names count there (``SHM_PREFIX``, the prefix of the
shared memory kvwire names: ``kvwire-shm-ring``, ``kvwire-shm-grants``, ``kvwire-kv``): another
process's segment, made or left while a test runs, is not the test's leak. kvwire's shared memory is
memfds today, which have no name there and show up in the fd and mapping counts instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Mapping

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvwire-"  # the names kvwire gives its shared memory (memfds: src/kvwire/transfer/memory.py)


@dataclasses.dataclass(frozen=True)
class Footprint:
    threads: int
    fds: int
    shm_maps: int  # distinct shared-memory objects mapped (/dev/shm names and memfds)

    def excess_over(self, base: Footprint) -> dict[str, tuple[int, int]]:
        """Field -> (baseline, now) for every count above ``base``."""
        return {name: (getattr(base, name), getattr(self, name))
                for name in ("threads", "fds", "shm_maps") if getattr(self, name) > getattr(base, name)}


def fd_targets(pid: int) -> dict[str, str]:
    """fd number -> what it is (a file path, ``socket:[inode]``, ``pipe:[...]``, ...)."""
    targets: dict[str, str] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
    return targets


def describe_sockets(pid: int, targets: set[str], names: Mapping[int, str] | None = None) -> list[str]:
    """``socket:[inode]`` targets as TCP ``local -> remote state`` where /proc knows them (ports named
    by ``names`` where given, e.g. ``{8000: "http"}``)."""
    names = names or {}
    inodes = {t[len("socket:["):-1]: t for t in targets if t.startswith("socket:[")}
    states = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "0A": "LISTEN",
              "04": "FIN_WAIT1", "05": "FIN_WAIT2", "09": "LAST_ACK"}
    found: list[str] = []
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/tcp", encoding="ascii") as table:
        for row in list(table)[1:]:
            cols = row.split()
            if cols[9] in inodes:
                local, remote = (int(c.split(":")[1], 16) for c in cols[1:3])
                ends = (f":{p}({names[p]})" if p in names else f":{p}" for p in (local, remote))
                found.append(f"tcp {' -> '.join(ends)} {states.get(cols[3], cols[3])}")
                inodes.pop(cols[9])
    return found + sorted(inodes.values())


def socket_kinds(pid: int, names: Mapping[int, str]) -> collections.Counter[str]:
    """The process's TCP sockets counted by the named port at either end (``other`` when unnamed)."""
    kinds: collections.Counter[str] = collections.Counter()
    inodes = {t[len("socket:["):-1] for t in fd_targets(pid).values() if t.startswith("socket:[")}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/tcp", encoding="ascii") as table:
        for row in list(table)[1:]:
            cols = row.split()
            if cols[9] in inodes:
                ports = [int(c.split(":")[1], 16) for c in cols[1:3]]
                kinds[next((names[p] for p in ports if p in names), "other")] += 1
    return kinds


def footprint(pid: int, pooled_ports: frozenset[int] = frozenset()) -> Footprint:
    """Raises OSError when the process is gone. Connections to or from ``pooled_ports`` are not
    counted (see :class:`LeakBaseline`)."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = len(os.listdir(f"/proc/{pid}/fd")) - _pooled(pid, pooled_ports)
    return Footprint(threads, fds, len(_shm_mapped(pid)))


def _pooled(pid: int, ports: frozenset[int]) -> int:
    """How many of the process's established TCP connections have one end on one of ``ports``:
    accepted there (a server's side of a keep-alive pool) or dialled there (the pool itself). One the
    other end closed (CLOSE_WAIT: a server that never closed its side) still counts."""
    if not ports:
        return 0
    inodes = {t[len("socket:["):-1] for t in fd_targets(pid).values() if t.startswith("socket:[")}
    count = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/tcp", encoding="ascii") as table:
        for row in list(table)[1:]:
            cols = row.split()
            ends = {int(c.split(":")[1], 16) for c in cols[1:3]}
            if cols[9] in inodes and cols[3] == "01" and ends & ports:  # ESTABLISHED only
                count += 1
    return count


def _shm_mapped(pid: int) -> set[str]:
    found: set[str] = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith(SHM_DIR + "/") or path.startswith("/memfd:"):
                found.add(path)
    return found


def shm_names() -> set[str]:
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


def kvwire_shm_names() -> set[str]:
    """The names in /dev/shm that are kvwire's (``SHM_PREFIX``)."""
    return {name for name in shm_names() if name.startswith(SHM_PREFIX)}


def _mapped_anywhere(names: set[str]) -> set[str]:
    """The names of ``names`` some live process on the host maps."""
    mapped: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            paths = _shm_mapped(int(entry))
        except OSError:
            continue  # gone or not ours to read
        mapped |= {name for name in names if f"{SHM_DIR}/{name}" in paths}
    return mapped


@dataclasses.dataclass(frozen=True)
class LeakBaseline:
    pids: Mapping[str, int]  # process name -> pid
    counts: Mapping[str, Footprint]
    shm: frozenset[str]
    fds: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)  # name -> fd targets
    port_names: Mapping[int, str] = dataclasses.field(default_factory=dict)  # for failure messages
    sockets: Mapping[str, collections.Counter[str]] = dataclasses.field(default_factory=dict)
    pooled_ports: frozenset[int] = frozenset()

    @classmethod
    def take(cls, pids: Mapping[str, int], port_names: Mapping[int, str] | None = None,
             pooled_ports: frozenset[int] = frozenset()) -> LeakBaseline:
        """``port_names``: known ports (e.g. ``{8000: "router http"}``) to name in a failure.
        ``pooled_ports``: HTTP ports whose connections belong to a client's keep-alive pool (the
        router's to each instance): such a pool grows with the concurrency the load happened to
        reach and is bounded by its client; neither end counts those connections."""
        counts = {name: footprint(pid, pooled_ports) for name, pid in pids.items()}
        fds = {name: frozenset(fd_targets(pid).values()) for name, pid in pids.items()}
        names = dict(port_names or {})
        sockets = {name: socket_kinds(pid, names) for name, pid in pids.items()}
        return cls(dict(pids), counts, frozenset(kvwire_shm_names()), fds, names, sockets, pooled_ports)

    def without(self, *names: str) -> LeakBaseline:
        """The baseline of the other processes (``names`` were killed on purpose: not survivors)."""
        keep = [n for n in self.pids if n not in names]
        return dataclasses.replace(
            self,
            pids={n: self.pids[n] for n in keep},
            counts={n: self.counts[n] for n in keep},
            fds={n: v for n, v in self.fds.items() if n in keep},
            sockets={n: v for n, v in self.sockets.items() if n in keep},
        )

    def leaks(self) -> list[str]:
        """What is above the baseline now ([] = nothing); a process that died is reported."""
        found: list[str] = []
        for name, pid in self.pids.items():
            try:
                excess = footprint(pid, self.pooled_ports).excess_over(self.counts[name])
            except OSError:
                found.append(f"{name} (pid {pid}) is gone")
                continue
            found += [f"{name}: {what} {was} -> {now}" for what, (was, now) in excess.items()]
            if "fds" in excess:
                with contextlib.suppress(OSError):
                    new_fds = set(fd_targets(pid).values()) - self.fds.get(name, frozenset())
                    found.append(f"{name} new fds: {describe_sockets(pid, new_fds, self.port_names)}")
                    more = socket_kinds(pid, self.port_names) - self.sockets.get(name, collections.Counter())
                    found.append(f"{name} more sockets than before by port: {dict(more)}")
        new = kvwire_shm_names() - self.shm
        if new:
            found += [f"{SHM_DIR}/{name} left behind" for name in sorted(new - _mapped_anywhere(new))]
        return found

    def wait_back(self, timeout_s: float) -> None:
        """Poll until :meth:`leaks` is empty; AssertionError listing them at the deadline."""
        deadline = time.monotonic() + timeout_s
        while (found := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not found, f"not back to the baseline within {timeout_s} s: {'; '.join(found)}"


# --- process groups (the vLLM tier: an API server and its engine / worker / tracker children) ---------


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp, ...
            found.append(int(entry))
    return found


def shm_names_mapped_by(pids: list[int]) -> set[str]:
    """The /dev/shm names (segments, named semaphores) the processes map now."""
    names: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            names |= {p[len(SHM_DIR) + 1:].removesuffix(" (deleted)") for p in _shm_mapped(pid)
                      if p.startswith(SHM_DIR + "/")}
    return names


def orphaned(names: set[str]) -> set[str]:
    """Those of ``names`` still in /dev/shm that no live process maps (left behind)."""
    present = names & shm_names()
    return present - _mapped_anywhere(present)


def remove(names: set[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(f"{SHM_DIR}/{name}")
