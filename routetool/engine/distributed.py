"""One command over several processes (torchrun): who does which unit of work, and the reduction.

``torchrun --nproc-per-node N -m routetool replay RUN`` (also ``validate`` and ``balance``)
starts N processes with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR`` set;
:func:`join` makes them a ``torch.distributed`` process group: NCCL when every process of the
host has a GPU of its own (``cuda:LOCAL_RANK``), else gloo (CPU runs, or more processes than
GPUs, which then share them). Without those variables, or with one process, nothing is joined
and the command runs as one process.

A command splits its work into units that are independent of each other (replay and validate:
one rank's layer; balance: a layer, over every rank that holds it) and :meth:`Workers.run` deals
them out round-robin in their order: process ``p`` of ``W`` takes units ``p, p + W, ...``. Every
unit's result comes back to every process in unit order (``all_gather_object``), so the
reduction that follows, and the report, are exactly one process's. A unit that raises stops its
process's share; the error of the first failing unit in unit order is raised on every process,
as one process would have raised it. Process 0 alone renders and writes outputs; every process
exits with the verdict's exit code, once every process has finished (:func:`leave`), so that
torchrun, which stops the other processes when one exits with an error, never cuts the first
process's report short. Results travel pickled, so they hold CPU data only.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from routetool.errors import RouteToolError

T = TypeVar("T")
R = TypeVar("R")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Workers:
    """The processes one command runs on.

    Attributes:
        rank / world_size: this process's rank and the number of processes (0 / 1 alone).
        backend: the process group's backend (``nccl`` or ``gloo``), None alone.
        local_rank: its rank on its host (its GPU, with NCCL).
    """

    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    local_rank: int = 0

    @property
    def is_first(self) -> bool:
        """Whether this process renders and writes (rank 0)."""
        return self.rank == 0

    def run(self, units: Sequence[T], work: Callable[[T], R]) -> list[R]:
        """``work(unit)`` for this process's share of ``units``; every unit's result, in unit order.

        Raises:
            Exception: the exception of the first failing unit (in unit order), on every process.
        """
        mine: dict[int, R] = {}
        error: tuple[int, BaseException] | None = None
        for i in range(self.rank, len(units), self.world_size):
            try:
                mine[i] = work(units[i])
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
                if self.world_size == 1:
                    raise
                error = (i, _portable(exc))
                break
        if self.world_size == 1:
            return [mine[i] for i in range(len(units))]
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        _collective(lambda: dist.all_gather_object(gathered, (mine, error)), "gathered their results")
        errors = [e for _, e in gathered if e is not None]
        if errors:
            raise min(errors, key=lambda e: e[0])[1]
        merged: dict[int, R] = {}
        for part, _ in gathered:
            merged.update(part)
        return [merged[i] for i in range(len(units))]



def leave() -> bool:
    """Wait for every process of the group, then leave it: called once as the command ends, after
    the first process has printed and written (its report, or its one error line), so that no
    process exits earlier (torchrun stops the others when one exits with an error). Returns
    whether a group had been joined (nothing happens otherwise)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        _collective(dist.barrier, "left together")
    except PeerLost:
        pass  # (this process's verdict and line stand; torchrun reports the process that is gone)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group whose peers are gone may not close cleanly
            pass
    return True


class PeerLost(RouteToolError):
    """Another process of the torchrun job stopped (killed, out of memory, crashed) while this
    one waited for it in a collective: one line, exit 2, printed once for the job, by the first
    survivor to report it whatever its rank (:attr:`speaks`), instead of the backend's traceback."""

    speaks = True


def _first_to_report() -> bool:
    """Whether this process is the first of the job to report a lost peer: counted in torchrun's
    store (the agent's, which outlives its workers); True where the store cannot be reached."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store().add("routetool/peer_lost", 1) == 1
    except Exception:  # noqa: BLE001 - no store: say it rather than say nothing
        return True


def _collective(call: Callable[[], R], what: str) -> R:
    """``call()``, a collective of the group; a failure of the collective itself (gloo's
    "Connection closed by peer", NCCL's errors: another process is gone) becomes
    :class:`PeerLost`, a one-line error instead of the backend's traceback.

    Raises:
        PeerLost: naming what the processes were doing and the backend's first line.
    """
    from routetool.errors import first_line

    try:
        return call()
    except RouteToolError:
        raise
    except Exception as exc:  # noqa: BLE001 - RuntimeError (gloo), DistBackendError (NCCL), ...
        err = PeerLost(f"another process of this torchrun job stopped while the processes {what} "
                       f"({first_line(exc, 160)}): its own line, or torchrun's report, says why",
                       fix="fix what stopped it (a process killed for memory: fewer processes per GPU or host), "
                           "then run again")
        err.speaks = _first_to_report()
        raise err from None


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (routetool's errors do), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception that cannot travel
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one of several."""
    if any(v not in os.environ for v in _LAUNCHER_VARS):
        return False
    world = os.environ["WORLD_SIZE"]
    return world.isascii() and world.isdigit() and int(world) > 1


def join(device: str = "auto") -> Workers:
    """This process's :class:`Workers`: joined into torchrun's process group when :func:`launched`.

    Args:
        device: the command's ``--device`` (``cpu`` keeps the group on gloo).

    Call it once, before the command's engine picks its device: with NCCL it makes
    ``cuda:LOCAL_RANK`` the current CUDA device, the GPU the process then runs on.

    Raises:
        RouteToolError: the launcher's variables are not plain integers; the other processes did
            not join within :data:`JOIN_TIMEOUT_S` (or the rendezvous failed).
    """
    if not launched():
        return Workers()
    from routetool.errors import RouteToolError

    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        text = os.environ.get(name, "0" if name == "LOCAL_RANK" else os.environ["WORLD_SIZE"])
        if not (text.isascii() and text.isdigit()):
            raise RouteToolError(f"the launcher set {name}={text!r}, not an integer",
                                 fix="start the command with torchrun --nproc-per-node N -m routetool ...")
        values[name] = int(text)
    import torch
    import torch.distributed as dist

    local, local_world = values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    backend = "nccl" if gpus and gpus >= local_world else "gloo"
    if gpus:
        torch.cuda.set_device(local % gpus)
    _init_group(backend, RouteToolError)
    return Workers(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend, local_rank=local)


JOIN_TIMEOUT_S = 120.0
"""How long :func:`join` waits for the other processes (``ROUTETOOL_JOIN_TIMEOUT_S`` overrides it)."""


MAX_JOIN_TIMEOUT_S = 86400.0


def join_timeout(error: type) -> float:
    """:data:`JOIN_TIMEOUT_S`, or ``ROUTETOOL_JOIN_TIMEOUT_S`` when set: a plain decimal number of
    seconds, > 0 and at most a day (``nan``, ``inf``, ``1e309`` or ``2_0`` would wait forever or
    mean something else than written).

    Raises:
        error: (the caller's error type) a value that is not such a number, naming the variable.
    """
    from routetool.errors import printable
    from routetool.numtext import parse_float

    text = os.environ.get("ROUTETOOL_JOIN_TIMEOUT_S", "")
    if not text:
        return JOIN_TIMEOUT_S
    value = parse_float(text, special=True)
    if value is None or not 0 < value <= MAX_JOIN_TIMEOUT_S:
        raise error(printable(f"ROUTETOOL_JOIN_TIMEOUT_S={text!r} is not a number of seconds > 0 and at most "
                              f"{MAX_JOIN_TIMEOUT_S:g}"),
                    fix=f"e.g. ROUTETOOL_JOIN_TIMEOUT_S=120, or unset it for {JOIN_TIMEOUT_S:g} s")
    return value


def _init_group(backend: str, error: type) -> None:
    """``init_process_group`` on a thread of its own, so that this one keeps handling Ctrl-C and
    SIGTERM (the rendezvous blocks in C), given up after :data:`JOIN_TIMEOUT_S`: launcher variables
    inherited by a process that no launcher started (a script run from a torchrun job) would
    otherwise wait for peers that never come."""
    import threading
    import time

    import torch.distributed as dist

    timeout = join_timeout(error)
    failed: list[BaseException] = []

    def init() -> None:
        try:
            dist.init_process_group(backend)
        except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
            failed.append(exc)

    thread = threading.Thread(target=init, name="routetool-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        thread.join(0.1)
        if thread.is_alive() and time.monotonic() > deadline:
            raise error(f"torchrun's variables are set (RANK={os.environ['RANK']}, WORLD_SIZE={os.environ['WORLD_SIZE']}, "
                        f"MASTER_ADDR={os.environ['MASTER_ADDR']}, MASTER_PORT={os.environ['MASTER_PORT']}), but the "
                        f"other processes did not join within {timeout:g} s",
                        fix="start the command with torchrun --nproc-per-node N -m routetool ..., or unset RANK, "
                            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT to run it as one process")
    if failed:
        from routetool.errors import first_line

        raise error(f"cannot join torchrun's process group ({first_line(failed[0])})",
                    fix="start the command with torchrun --nproc-per-node N -m routetool ...")
