"""Seeds for independent random streams, derived from the one ``run.seed``.

Each stream (rollout sampling at a step on a data-parallel rank, the mini-batch order of an
epoch, the SFT data order...) gets its own seed from ``(base, *tags)`` through a cryptographic
hash, so streams never collide the way ``seed * A + step * B + rank`` sums can, and the value
is the same in every process and Python session (unlike ``hash()``, which is salted).
"""

from __future__ import annotations

import hashlib

_SEED_BITS = 63  # torch.Generator.manual_seed takes any non-negative int below 2**64


def derive_seed(base: int, *tags: int | str) -> int:
    """A seed for the stream named by ``tags`` (ints and strings) under ``base``."""
    text = repr((int(base),) + tuple(tags)).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)
