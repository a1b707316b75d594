"""The link between trainer rank 0 and generator rank 0 (:mod:`megatron_rl.distributed.bridge`):
a side waiting for the other learns of its message as soon as it is written, not at its next look."""

import statistics
import threading
import time

import torch.distributed as dist

from megatron_rl.distributed.bridge import Bridge
from megatron_rl.distributed.messages import GeneratedRollout, GenerationResult, WeightsPush


def _result(step: int) -> GenerationResult:
    return GenerationResult(GeneratedRollout([0], [[step]], [[0.0]], ["stop"]), version=step, generate_s=0.0,
                            idle_s=0.0, refit_s=0.0, refit_bytes=0, shard_bytes=0)


def _store_pair() -> tuple:
    """A master TCPStore on a port the kernel picks as it binds, and a client of it.  (Asking for a
    free port first and binding it later left a window in which another process on a busy machine
    could take it, and the client then read someone else's store.)"""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return host, dist.TCPStore("127.0.0.1", host.port, is_master=False)


def test_a_waiting_trainer_takes_a_result_as_soon_as_the_generator_writes_it():
    host, client = _store_pair()
    trainer = Bridge(host)
    generator = Bridge(client)
    late = []
    for step, after_s in enumerate((0.27, 0.31, 0.42, 0.23, 0.36), start=1):
        written = []

        def write(step=step, after_s=after_s):
            time.sleep(after_s)
            written.append(time.perf_counter())
            generator.put_result(step, _result(step))

        threading.Thread(target=write).start()
        assert trainer.take_result(step) == _result(step)
        late.append(time.perf_counter() - written[0])
    # Looking again every 50 ms would take 25 ms on average to notice; a waiting side must not.
    assert statistics.median(late) < 0.01, [f"{x * 1000:.1f} ms" for x in late]


def test_a_weight_push_starts_as_soon_as_the_generators_say_they_receive_it():
    from megatron_rl.distributed.bridge import WeightSender

    host, client = _store_pair()
    generator = Bridge(client)
    sent = []
    sender = WeightSender(host, lambda payload: sent.append((payload, time.perf_counter())))
    late = []
    for version, after_s in enumerate((0.27, 0.31, 0.42)):
        sender.put(version, f"weights {version}")
        time.sleep(after_s)
        said = time.perf_counter()
        generator.receiving(WeightsPush(version))
        while len(sent) <= version:
            time.sleep(0.0005)
        late.append(sent[version][1] - said)
    sender.close()
    assert [p for p, _ in sent] == ["weights 0", "weights 1", "weights 2"]
    assert statistics.median(late) < 0.01, [f"{x * 1000:.1f} ms" for x in late]
