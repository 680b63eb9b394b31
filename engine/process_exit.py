"""What the process does at exit for the engines it built and the process group Tiers started.

Note [shutting down at exit]
Training scripts rarely close their engines or destroy the process group (DeepSpeed's examples never
do). Left to interpreter finalization, gloo's worker threads are torn down while the interpreter is half
gone, and a rank can abort after training has finished ("terminate called without an active exception",
tests/test_shutdown.py). So at exit, while the interpreter is whole, every engine still alive is closed
(its monitor flushes, an offloaded optimizer removes its swap files) and the process group Tiers started
from torchrun's environment (initialize() or deepspeed.init_distributed()) is destroyed. A group the
script started itself is the script's to destroy. An engine the script still holds at exit keeps its
groups' threads until the interpreter frees it (as any torch object holding a group does): scripts/train.py
closes and deletes its engine before destroying the group. A background checkpoint save needs nothing here: its
thread is not a daemon, so Python waits for it before running these handlers (Note [asynchronous save]).
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Callable

import torch.distributed as dist


class _AtExit:
    # one process, one exit: this state is per process by nature, like atexit's own
    closers: list[weakref.WeakMethod] = []
    destroys_group = False
    registered = False

    @classmethod
    def register(cls) -> None:
        if not cls.registered:
            atexit.register(cls.finish)
            cls.registered = True

    @classmethod
    def finish(cls) -> None:
        closers, cls.closers = cls.closers, []
        for ref in closers:
            _call_if_alive(ref)
        gc.collect()  # engines dropped in cycles let go of their groups before the groups are destroyed
        if cls.destroys_group and dist.is_initialized():
            dist.destroy_process_group()


def _call_if_alive(ref: weakref.WeakMethod) -> None:
    close = ref()  # a local of its own: nothing here keeps the engine alive after the call
    if close is None:
        return
    try:
        close()
    except Exception as e:  # the other engines still close and the group is still destroyed
        print(f"tiers: closing an engine at exit failed: {type(e).__name__}: {e}", file=sys.stderr)


def close_at_exit(close: Callable[[], None]) -> None:
    """Calls `close` (a bound method; its object held weakly) at exit if its object is still alive then."""
    _AtExit.closers.append(weakref.WeakMethod(close))
    _AtExit.register()


def destroy_group_at_exit() -> None:
    """The process group just started by Tiers is destroyed at exit (Note [shutting down at exit])."""
    _AtExit.destroys_group = True
    _AtExit.register()
