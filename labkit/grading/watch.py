"""Watching what a rank really sent, below every route an answer could take: the anti-shortcut
tool of the checkers of notebooks 01 to 05 (03 §7 introduced it).

Notebook 03's exercise asks for an all-reduce built from point-to-point messages. Patching
``dist.all_reduce`` or ``dist.isend`` sees only calls made through those two names: an answer
can reach the same gloo collective through the process-group object
(``dist.distributed_c10d._get_default_group().allreduce([t])``), its backend object,
functional collectives, a group it makes itself (``dist.new_group()``, or a
``ProcessGroupGloo`` on a ``FileStore``), and can send through ``group.send`` unseen. So the
checker watches two places no Python route avoids, on gloo (CPU):

* **collectives** — gloo writes every collective it runs, on every process group of the
  process and whatever called it, into PyTorch's flight recorder, a C++ ring buffer that
  torch 2.13 keeps on by default (``TORCH_FR_BUFFER_SIZE``, 2000 entries); point-to-point
  send/recv are not recorded. :meth:`Watch.stop` lists the entries made since
  :meth:`Watch.start` (``record_id`` only grows, so a full buffer hides nothing).
* **bytes** — the kernel counts what every TCP socket has been given to send (``TCP_INFO``,
  Linux 4.19 and later: ``tcpi_bytes_sent`` less retransmissions, plus ``tcpi_notsent_bytes``
  still queued). gloo's messages between ranks travel over TCP, so the growth of that sum over
  the rank's sockets is what the rank put on the wire, gloo's framing included (measured on
  torch 2.13: 144 bytes per isend/irecv pair on top of the payload). The sockets of the
  process group's TCPStore (those on ``MASTER_PORT``) are left out: the store is a side
  channel, not point-to-point, so data an answer passes through it counts for nothing. A
  checker then asks for a **lower** bound too: every rank's input has to leave it, so a rank
  whose gloo sockets sent fewer bytes than its tensor holds moved the data some other way
  (the store, a file, shared memory).

Both claims are reproduced by ``tests/collectives/test_watch.py``. What stays out of reach:
code running inside the rank can rewrite anything in that process, the checker included, and an
answer that both sends enough bytes of padding and reads the real data from a side channel is
not told apart by these counters (the bytes are counted, not their content). The
grader's own process never runs an answer; the rank watches what an honest or lazy answer
could not hide.

Example (inside a rank)::

    w = Watch()                      # probes the flight recorder with one all_reduce
    w.start()
    my_ring(t)
    seen = w.stop()                  # {"collectives": [], "sent": 96, "error": ""}
"""
from __future__ import annotations

import math
import os
import pickle
import socket
import struct

__all__ = ["Watch", "tcp_bytes_sent", "store_port", "recorded_collectives", "recorded",
           "last_record_id", "ALLOWED"]

# Synchronisation without data: not a way to all-reduce, so an answer may use it.
ALLOWED = ("gloo:barrier",)
_TCP_INFO_LEN = 232
# offsets in struct tcp_info (linux/tcp.h): what the application has written to a socket is
# what TCP sent (retransmissions aside) plus what still waits in the send queue.
_NOTSENT_AT, _BYTES_SENT_AT, _RETRANS_AT = 144, 200, 208


def _entries() -> list[dict]:
    import torch._C._distributed_c10d as c10d
    dump = c10d._dump_fr_trace(True, False, False)   # collectives, no stacks, all entries
    return pickle.loads(dump).get("entries", [])


def last_record_id() -> int:
    """The id of the newest flight-recorder entry of this process (-1 when there is none)."""
    return max((e["record_id"] for e in _entries()), default=-1)


def recorded(since: int) -> list[tuple[str, int]]:
    """``(name, input elements)`` of each collective gloo ran here after entry ``since``."""
    out = []
    for e in sorted(_entries(), key=lambda e: e["record_id"]):
        if e["record_id"] > since:
            numel = sum(math.prod(shape) for shape in e.get("input_sizes") or [])
            out.append((e["profiling_name"], int(numel)))
    return out


def recorded_collectives(since: int) -> list[str]:
    """Collectives gloo ran in this process after entry ``since``: ``["gloo:all_reduce", ...]``."""
    return [name for name, _ in recorded(since)]


def tcp_bytes_sent(skip_port: int | None = None) -> int | None:
    """Bytes written so far to all TCP sockets of this process (None: no TCP socket).

    ``skip_port``: leave out sockets whose local or remote port it is (the TCPStore's).
    """
    total, found = 0, False
    fds = os.listdir("/proc/self/fd")
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:                    # closed meanwhile, or not a socket after all
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                continue
            if skip_port is not None and skip_port in (_port(sock.getsockname),
                                                        _port(sock.getpeername)):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) >= _RETRANS_AT + 8:
                sent, retrans = struct.unpack_from("QQ", info, _BYTES_SENT_AT)
                total += sent - retrans + struct.unpack_from("I", info, _NOTSENT_AT)[0]
                found = True
        except OSError:
            pass
        finally:
            sock.close()                   # closes the duplicate only
    return total if found else None


def _port(address) -> int | None:
    try:
        return address()[1]
    except OSError:                        # not connected
        return None


def store_port() -> int | None:
    """The port of this process group's TCPStore (``MASTER_PORT``, as lk.run and torchrun set)."""
    port = os.environ.get("MASTER_PORT", "")
    return int(port) if port.isdigit() else None


class Watch:
    """Collectives (flight recorder) and bytes sent (TCP counters, the store's sockets left
    out) of this rank, per window.

    Construct it inside a rank of a gloo job: it runs one 1-element ``dist.all_reduce`` on
    every rank to prove the flight recorder sees it (all ranks must construct it together).
    ``error`` is empty when both observers work, else it says why the rank cannot be watched.
    """

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        self.error, self._skip = "", store_port()
        if dist.get_backend() != "gloo":
            self.error = (f"the checker watches gloo's traffic, and this job runs "
                          f"{dist.get_backend()}")
            return
        mark = last_record_id()
        dist.all_reduce(torch.zeros(1))
        if "gloo:all_reduce" not in recorded_collectives(mark):
            self.error = ("PyTorch's flight recorder is off in this process, so a collective "
                          "would go unseen (is TORCH_FR_BUFFER_SIZE=0 set? unset it)")
        elif tcp_bytes_sent(self._skip) is None:
            self.error = "this rank has no TCP socket whose byte counter can be read"
        self._mark, self._sent = -1, 0

    def start(self) -> None:
        """Open a window: what this rank does from now on is counted."""
        if not self.error:
            self._mark, self._sent = last_record_id(), tcp_bytes_sent(self._skip) or 0

    def stop(self) -> dict:
        """Close the window: ``{"collectives": [...], "sent": bytes, "error": why-not}``."""
        if self.error:
            return {"collectives": [], "sent": 0, "error": self.error}
        used = [c for c in recorded_collectives(self._mark) if c not in ALLOWED]
        sent = tcp_bytes_sent(self._skip)
        return {"collectives": used, "sent": (sent or 0) - self._sent, "error": ""}
