"""The process's open-files limit, raised to what the system allows.

Containers usually start with a low soft limit on open files (1,024 under containerd
2's and systemd's defaults) and a high hard one. A server holds a descriptor per
connection, so under a soft limit of 1,024 anyone who can open that many connections
to it leaves no descriptor for the API server's. Go's runtime raises the soft limit to
the hard one at start for this reason; Python does not, so the webhook's entry point
does it here. The hard limit stays the bound the admin set.
"""

from __future__ import annotations

import resource

__all__ = ["raise_open_files_limit"]


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns (before, after).

    Call it from a process's entry point: it changes the whole process, which a library
    has no business doing. Where the system refuses (it should not: an unprivileged
    process may raise its soft limit up to its hard one), the limit stays as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard
