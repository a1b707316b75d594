"""Trainer rank 0 <-> generator rank 0: how the training and the generating world talk.

Through the job's TCP store (:func:`megatron_rl.distributed.runtime.job_store`):

- **messages**, trainer -> generators: an ordered stream (``msg/0``, ``msg/1``, ...) of small JSON
  records (sampling settings, weight pushes, generation requests, stop; typed and checked on
  receipt by :mod:`megatron_rl.distributed.messages`).  The generators act on
  them in order, so a request is always generated with the last weights pushed before it: the
  staleness of every batch is fixed by the order the trainer posts in, not by timing.
- **results**, generators -> trainer: one key per generated batch (``result/<step>``), JSON.  A
  store write never waits for the reader, so generators run ahead while the trainer trains.
- **weights** move rank to rank, each generator receiving its own shard from the trainers that
  hold it (megatron-core's resharding over a group of the whole job,
  :mod:`megatron_rl.distributed.cross_world`).  A :class:`WeightSender` on every trainer rank
  starts its part of a push only when generator rank 0 says the generators are receiving, so
  neither side's timeout runs while the other is busy, and the trainers never wait for the copy.

JSON only through the store: nothing received from it is unpickled.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Optional

import torch.distributed as dist

from megatron_rl.distributed.messages import (
    TRAINER_MESSAGES,
    GenerationResult,
    Stop,
    WeightsPush,
    decode,
    encode,
)

WAIT_SLICE = datetime.timedelta(hours=1)  # one blocking wait; the store's socket logs a warning when it runs out
WAKE_S = 0.5  # how often a waiting main thread lets Python run its signal handlers


class KeyWaiter:
    """Waits for keys of ``store`` (under ``prefix``) and wakes the moment one is written.

    Looking at the store again and again would notice a key only at the next look (up to the
    pause between looks late, for every message of every step), so the wait blocks in the store
    instead.  A blocking wait holds its connection's lock, so each waiting thread blocks on a
    connection of its own, never on the one the rest of the process posts through; and it blocks
    on a helper thread while the caller waits on an event, so a trainer's main thread still runs
    its signal handlers (a second Ctrl-C aborts at once)."""

    def __init__(self, store, prefix: str):
        self.store = dist.PrefixStore(prefix, store)
        self._base, self._prefix = store, prefix
        self._local = threading.local()

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            base = self._base
            if isinstance(base, dist.TCPStore):
                base = dist.TCPStore(base.host, base.port, is_master=False, timeout=base.timeout)
            conn = self._local.conn = dist.PrefixStore(self._prefix, base)
        return conn

    def wait(self, key: str) -> bytes:
        """The value of ``key`` once some process sets it, however long that takes (a dead writer
        ends the job through the launcher; a dead store host raises here)."""
        if self.store.check([key]):
            return self.store.get(key)
        conn, done, error = self._connection(), threading.Event(), []

        def block():
            try:
                while True:
                    try:
                        conn.wait([key], WAIT_SLICE)
                        return
                    except dist.DistStoreError as err:
                        if "timeout" not in str(err):
                            raise
            except BaseException as err:  # noqa: BLE001 -- raised on the waiting thread below
                error.append(err)
            finally:
                done.set()

        threading.Thread(target=block, name="store-wait", daemon=True).start()
        while not done.wait(WAKE_S):
            pass
        if error:
            raise error[0]
        return self.store.get(key)


class Bridge:
    """One side of the link (``trainer`` on trainer rank 0, ``generator`` on generator rank 0)."""

    def __init__(self, store):
        self.waiter = KeyWaiter(store, "bridge")
        self.store = self.waiter.store
        self.posted = 0  # trainer: messages posted
        self.read = 0  # generator: messages read
        self._peeked: Optional[tuple[int, object]] = None  # generator: (index, message) looked at ahead

    # ---------------------------------------------------------------- trainer side

    def post(self, message) -> None:
        """Post one of :data:`~megatron_rl.distributed.messages.TRAINER_MESSAGES` after the others."""
        self.store.set(f"msg/{self.posted}", encode(message))
        self.posted += 1

    def take_result(self, step: int) -> GenerationResult:
        key = f"result/{step}"
        value = decode(self.waiter.wait(key), expect=(GenerationResult,))
        self.store.delete_key(key)
        return value

    def post_stop(self) -> None:
        """Tell the generators to stop once they have acted on every message before this one."""
        self.post(Stop())

    def wait_stopped(self) -> None:
        """Wait until the generators have stopped (this process hosts the store they read)."""
        self.waiter.wait("stopped")

    # ---------------------------------------------------------------- generator side

    def next_message(self):
        key = f"msg/{self.read}"
        peeked = self._peeked if self._peeked is not None and self._peeked[0] == self.read else None
        message = peeked[1] if peeked is not None else decode(self.waiter.wait(key), expect=TRAINER_MESSAGES)
        self.store.delete_key(key)
        self.read += 1
        return message

    def peek_message(self):
        """The next message if the trainer has posted it, without taking it (read once, kept)."""
        if self._peeked is not None and self._peeked[0] == self.read:
            return self._peeked[1]
        key = f"msg/{self.read}"
        if not self.store.check([key]):
            return None
        self._peeked = (self.read, decode(self.store.get(key), expect=TRAINER_MESSAGES))
        return self._peeked[1]

    def receiving(self, push: WeightsPush) -> None:
        """Tell the trainers' :class:`WeightSender`\\ s the generators are taking ``push``."""
        self.store.set(f"receiving/{push.version}", "1")

    def put_result(self, step: int, result: GenerationResult) -> None:
        self.store.set(f"result/{step}", encode(result))

    def stopped(self) -> None:
        self.store.set("stopped", "1")

    # ---------------------------------------------------------------- either side

    def stop_asked(self) -> Optional[str]:
        """Who asked the job to stop from the other world (:func:`ask_to_stop`), if anyone did."""
        return self.store.get(STOP_ASKED).decode() if self.store.check([STOP_ASKED]) else None


STOP_ASKED = "stop_asked"


def ask_to_stop(store, who: str) -> None:
    """A stop signal that reached a generator rank only: the trainers see it at their next step
    boundary (:meth:`Bridge.stop_asked`) and checkpoint and exit as if it had reached them."""
    dist.PrefixStore("bridge", store).set(STOP_ASKED, who)


class WeightSender:
    """A trainer rank's part of each weight push, run on a thread of its own: ``send(payload)``
    once the generators are receiving push ``version`` (every trainer rank joins the copy)."""

    def __init__(self, store, send):
        self.waiter = KeyWaiter(store, "bridge")
        self.send = send
        self._queue: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: list[BaseException] = []

    def put(self, version: int, payload) -> None:
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="weight-push", daemon=True)
            self._thread.start()
        self._queue.put((version, payload))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            version, payload = item
            try:
                self.waiter.wait(f"receiving/{version}")
                self.send(payload)
            except (RuntimeError, ValueError, OSError, dist.DistError) as err:  # raised at the next push or close
                self._error.append(err)
                return

    def _raise_error(self) -> None:
        if self._error:
            raise RuntimeError("pushing weights to the generator ranks failed") from self._error[0]

    def close(self) -> None:
        """Wait until every push is delivered."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_error()
