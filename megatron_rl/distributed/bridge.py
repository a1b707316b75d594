"""Trainer rank 0 <-> generator rank 0: the one link between the training and the generating world.

Three channels, all from the job's TCP store (:func:`megatron_rl.distributed.runtime.job_store`):

- **messages**, trainer -> generators: an ordered stream (``msg/0``, ``msg/1``, ...) of small JSON
  records (sampling settings, weight pushes, generation requests, stop).  The generators act on
  them in order, so a request is always generated with the last weights pushed before it: the
  staleness of every batch is fixed by the order the trainer posts in, not by timing.
- **results**, generators -> trainer: one key per generated batch (``result/<step>``), JSON.  A
  store write never waits for the reader, so generators run ahead while the trainer trains.
- **weights**, trainer -> generators: one flat byte buffer per push through a two-rank gloo group
  (a full canonical copy; the generators load their own shards from it).  The trainer's sender
  thread starts the transfer only when the generator says it is receiving, so neither side's
  gloo timeout runs while the other is busy, and the trainer never waits for the copy.

JSON and raw bytes only: nothing received is unpickled.
"""

from __future__ import annotations

import datetime
import json
import math
import queue
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

MAX_POLL_S = 0.05  # longest pause between two looks at the store for a key

WEIGHTS, REQUEST, SETTINGS, STOP = "weights", "request", "settings", "stop"


def wait_for_key(store, key: str) -> bytes:
    """The value of ``key`` once some process sets it, however long that takes (a dead writer
    ends the job through the launcher; a dead store host raises here).  Polled with ``check``:
    a blocking ``wait`` past its timeout logs a warning from the store's socket layer each time."""
    pause = 0.001
    while not store.check([key]):
        time.sleep(pause)
        pause = min(2 * pause, MAX_POLL_S)
    return store.get(key)


def flatten_weights(canonical: dict[str, torch.Tensor]) -> tuple[list, torch.Tensor]:
    """``(manifest, bytes)``: every tensor's bytes one after another in name order, and the
    ``[name, shape, dtype]`` list that reads them back."""
    names = sorted(canonical)
    manifest = [[n, list(canonical[n].shape), str(canonical[n].dtype).removeprefix("torch.")] for n in names]
    flat = torch.cat([canonical[n].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for n in names])
    return manifest, flat


def unflatten_weights(manifest: list, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of :func:`flatten_weights` (views into ``flat``)."""
    out, offset = {}, 0
    for name, shape, dtype in manifest:
        dt = getattr(torch, dtype)
        nbytes = math.prod(shape) * dt.itemsize
        out[name] = flat[offset:offset + nbytes].view(dt).reshape(shape)
        offset += nbytes
    return out


class Bridge:
    """One side of the link (``trainer`` on trainer rank 0, ``generator`` on generator rank 0)."""

    def __init__(self, store, side: str, timeout_s: float):
        self.store = dist.PrefixStore("bridge", store)
        self.posted = 0  # trainer: messages posted
        self.read = 0  # generator: messages read
        # Rank 0 of the pair sends weights; built on both sides before anything else.
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), 0 if side == "trainer" else 1, 2,
                                           datetime.timedelta(seconds=timeout_s))
        self._sends: Optional[queue.Queue] = None
        self._sender: Optional[threading.Thread] = None
        self._send_error: list[BaseException] = []
        self._peeked: Optional[tuple[int, dict]] = None  # generator: (index, message) looked at ahead

    # ---------------------------------------------------------------- trainer side

    def post(self, message: dict) -> None:
        self.store.set(f"msg/{self.posted}", json.dumps(message))
        self.posted += 1

    def push_weights(self, version: int, canonical: dict[str, torch.Tensor]) -> int:
        """Post a weight push and hand its bytes to the sender thread; returns the bytes sent."""
        manifest, flat = flatten_weights(canonical)
        self.post({"kind": WEIGHTS, "version": version, "manifest": manifest, "bytes": flat.numel()})
        if self._sender is None:
            self._sends = queue.Queue()
            self._sender = threading.Thread(target=self._send_loop, name="weight-push", daemon=True)
            self._sender.start()
        self._raise_send_error()
        self._sends.put((version, flat))
        return flat.numel()

    def _send_loop(self) -> None:
        while True:
            item = self._sends.get()
            if item is None:
                return
            version, flat = item
            try:
                wait_for_key(self.store, f"receiving/{version}")
                self.group.broadcast(flat, 0).wait()
            except (RuntimeError, dist.DistError) as err:  # raised in the main thread at its next push or close
                self._send_error.append(err)
                return

    def _raise_send_error(self) -> None:
        if self._send_error:
            raise RuntimeError("pushing weights to the generator ranks failed") from self._send_error[0]

    def take_result(self, step: int) -> dict:
        key = f"result/{step}"
        value = json.loads(wait_for_key(self.store, key))
        self.store.delete_key(key)
        return value

    def close(self) -> None:
        """Tell the generators to stop, wait until every push is delivered and they have stopped
        (this process hosts the store they read)."""
        self.post({"kind": STOP})
        if self._sender is not None:
            self._sends.put(None)
            self._sender.join()
            self._raise_send_error()
        wait_for_key(self.store, "stopped")

    # ---------------------------------------------------------------- generator side

    def next_message(self) -> dict:
        key = f"msg/{self.read}"
        peeked = self._peeked if self._peeked is not None and self._peeked[0] == self.read else None
        message = peeked[1] if peeked is not None else json.loads(wait_for_key(self.store, key))
        self.store.delete_key(key)
        self.read += 1
        return message

    def peek_message(self) -> Optional[dict]:
        """The next message if the trainer has posted it, without taking it (read once, kept)."""
        if self._peeked is not None and self._peeked[0] == self.read:
            return self._peeked[1]
        key = f"msg/{self.read}"
        if not self.store.check([key]):
            return None
        self._peeked = (self.read, json.loads(self.store.get(key)))
        return self._peeked[1]

    def receive_weights(self, message: dict) -> torch.Tensor:
        """The flat bytes of the push ``message`` announced (:func:`unflatten_weights` reads them)."""
        flat = torch.empty(int(message["bytes"]), dtype=torch.uint8)
        self.store.set(f"receiving/{message['version']}", "1")
        self.group.broadcast(flat, 0).wait()
        return flat

    def put_result(self, step: int, result: dict) -> None:
        self.store.set(f"result/{step}", json.dumps(result))

    def stopped(self) -> None:
        self.store.set("stopped", "1")
