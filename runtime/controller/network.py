"""Which network interface a rank's collectives use: the one holding the address it is reached at.

Left alone, gloo picks its interface from the hostname, which many hosts resolve to 127.0.1.1, so
ranks on other nodes cannot connect (or hang); NCCL's socket bootstrap guesses too. Each worker
sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (before joining its group) to the interface that
holds its node's Ray address, the address its peers reach it at. The user's own setting wins:
exported on the driver (passed to every worker) or in a node's environment (`ray start` there).
"""

from __future__ import annotations

import ipaddress
import os

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_of(ip: str) -> str | None:
    """The name of the interface that holds `ip` (a loopback address: the loopback interface, which
    answers all of 127.0.0.0/8); None when no interface has it."""
    import psutil

    want = ipaddress.ip_address(ip)
    loopback = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                have = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue  # a link-layer address
            if have == want:
                return name
            if have.is_loopback and have.version == want.version:
                loopback = name
    return loopback if want.is_loopback else None


def set_socket_interfaces(ip: str, given: dict[str, str]) -> dict[str, str]:
    """Set this process's IFNAME variables: `given` (the driver's), else the node's own, else the
    interface of `ip`. Returns what they are now (for the workers' info and the logs)."""
    derived = interface_of(ip)
    for var in IFNAME_VARS:
        value = given.get(var) or os.environ.get(var) or derived
        if value:
            os.environ[var] = value
    return {var: os.environ[var] for var in IFNAME_VARS if var in os.environ}


def driver_settings() -> dict[str, str]:
    """The IFNAME variables the user exported where the run was started."""
    return {var: os.environ[var] for var in IFNAME_VARS if os.environ.get(var)}
