"""Starting tensor-parallel ranks for one command: ``mxc generate`` on a tp=N artifact.

``run_ranks(fn, world_size, device, *args)`` spawns ``world_size`` processes
with torch.multiprocessing, initialises torch.distributed in each (gloo on
CPUs, NCCL on GPUs, one GPU per rank) through a rendezvous store the parent
serves on a port it holds from bind to the end (a port picked free and then
released can be taken by another job's ranks before ours bind it), and calls
``fn(rank, world_size, device, *args)`` in each; a rank's ``MxcError`` reaches
the caller as one, and so does a rank ended by a signal (the out-of-memory
killer's SIGKILL) or by an exit status without an error (``exit_error``); a
rank's other exceptions are bugs and keep their traceback. Interrupted (Ctrl-C,
or a SIGTERM or SIGHUP sent to the command alone), also while it is still
starting them, it ends the ranks (``stop_ranks``) before it re-raises: they
would decode on, or wait for the others at the rendezvous, and the parent's
exit would wait for them. Killed (SIGKILL, which it cannot handle), it leaves
that to the ranks: each ends when its parent dies (``_follow_parent``). A
multi-node user starts the ranks with torchrun instead and calls
``mxc.load(path, rank=..., world_size=...)`` (with NCCL, without
``destroy_process_group()`` after decoding: see ``_run``).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time

import torch


def rendezvous_store():
    """The ranks' rendezvous: a TCP store served by the calling process on a port the system picks and the store
    holds while it lives, so no other job can take it between choosing and binding."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _follow_parent(parent: int) -> None:
    """Have the kernel end this rank with SIGTERM when ``parent`` (the process in ``run_ranks``) dies, on Linux.

    A parent killed with SIGKILL (the out-of-memory killer, ``kill -9``) cannot stop its ranks: they would be
    left to init, decoding on, or waiting for a dead peer, for ever. torch sets SIGINT as the death signal, which
    does nothing where SIGINT is ignored (a command started in the background by a shell script: ``mxc generate
    ... &``) or caught; SIGTERM, restored to its default here, ends the process wherever it is, in native code
    too. The signal is tied to the thread that started the rank, which ``run_ranks`` keeps waiting in ``join``
    until the ranks end. A parent already dead before the ``prctl`` (the rank is then someone else's child) is
    caught by the check after it. Elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # one ignored by the parent would be by the rank too
    try:
        prctl = ctypes.CDLL(None).prctl  # libc's, through the interpreter's own symbols
    except (OSError, AttributeError):  # a static or unusual build: as torch leaves it
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _entry(rank: int, world_size: int, device: str, port: int, fn, args, errors, parent: int) -> None:
    """One rank: ``_run``; a user error (``MxcError``) goes to the parent through ``errors`` as one line, and the
    rank exits with status 2 (``run_ranks`` raises it there; the other ranks are stopped). It ends if ``parent``
    dies (``_follow_parent``)."""
    from mxc.errors import MxcError

    _follow_parent(parent)
    try:
        _run(rank, world_size, device, port, fn, args)
    except MxcError as e:
        errors.put((rank, str(e)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)


def _run(rank: int, world_size: int, device: str, port: int, fn, args) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)  # the parent's (rendezvous_store)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if backend == "gloo":
        try:
            fn(rank, world_size, device, *args)
        finally:
            dist.destroy_process_group()
        return
    fn(rank, world_size, device, *args)
    # NCCL: destroy_process_group() hangs once NCCL collectives were captured in CUDA graphs
    # (pytorch/pytorch#115388, seen here with torch 2.11 on two H200s: both ranks stuck in it
    # after finishing their work). The rank's work is done and its results written: finish the
    # GPU work, flush, and leave without tearing NCCL down. Errors still raise above.
    torch.cuda.synchronize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, device: str, *args) -> None:
    """Run ``fn`` in ``world_size`` ranks; a user error in one of them, or a rank that ends without one (a signal,
    an exit status; ``exit_error``), is raised here as an ``MxcError``."""
    import torch.multiprocessing as mp

    from mxc.errors import MxcError

    errors = mp.get_context("spawn").SimpleQueue()
    quiet = logging.getLogger("torch.multiprocessing.spawn")  # its line on stopping the other ranks
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    store = rendezvous_store()  # held here until the ranks are done
    before = set(multiprocessing.active_children())
    ranks = None
    try:
        try:
            ranks = mp.start_processes(_entry, args=(world_size, device, store.port, fn, args, errors, os.getpid()),
                                       nprocs=world_size, join=False, start_method="spawn")
            while not ranks.join():  # a rank that fails stops the others (torch's ProcessContext.join)
                pass
        except BaseException:  # KeyboardInterrupt, the command's Terminated (SIGTERM, SIGHUP): the ranks run on
            # interrupted while they were being started: those started so far are this call's new children
            stop_ranks(ranks.processes if ranks is not None
                       else [p for p in multiprocessing.active_children() if p not in before])
            raise
    except mp.ProcessExitedException as e:
        if errors.empty():
            raise MxcError(exit_error(e.error_index, e.exit_code)) from None
        rank, message = errors.get()
        raise MxcError(message if world_size == 1 else f"rank {rank}: {message}") from None
    finally:
        quiet.setLevel(level)


def exit_error(rank: int, exit_code: int) -> str:
    """The line for a rank that ended without an error of its own: killed by a signal (``exit_code`` is minus
    its number, as ``multiprocessing`` gives it), or an exit status."""
    if exit_code >= 0:
        return (f"rank {rank} exited with status {exit_code} without an error message; its output above may say "
                f"why")
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = f"signal {-exit_code}"
    if name == "SIGKILL":
        why = "out of memory? `dmesg` lists the system's out-of-memory kills; free some memory and run again"
    elif name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
        why = "a crash in native code; please report it with the command that did it"
    else:
        why = "sent by another process; the other ranks were stopped"
    return f"rank {rank} ended by {name} ({why})"


def stop_ranks(processes, grace: float = 5.0) -> None:
    """End the rank processes still running: SIGTERM, then SIGKILL for any left after ``grace`` seconds, or at once
    if the wait is interrupted (a second Ctrl-C): a rank left running would keep the command from exiting."""
    processes = list(processes)
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    try:
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
