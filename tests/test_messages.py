"""The messages between trainer rank 0 and generator rank 0 (:mod:`megatron_rl.distributed.messages`):
each kind survives the trip through JSON, and a malformed one -- a field missing or of another
type, another protocol, a kind nobody sends -- stops at receipt with one error naming the
message's kind and the field."""

from __future__ import annotations

import json

import pytest

from megatron_rl.distributed import messages
from megatron_rl.distributed.messages import (
    PROTOCOL,
    TRAINER_MESSAGES,
    GeneratedRollout,
    GenerationRequest,
    GenerationResult,
    MessageError,
    SamplingSettings,
    Stop,
    WeightsPush,
    decode,
    encode,
)

ROLLOUT = GeneratedRollout(prompt_index=[0, 0], response_ids=[[5, 6], [7]], response_logprobs=[[-0.5, -1.25], [-2.0]],
                           finish_reason=["stop", "length"], token_versions=[[3, 4], [4]])
EXAMPLES = {
    "settings": SamplingSettings({"temperature": 1.0, "top_p": 0.9, "n": 2, "stop_token_ids": [2]}),
    "weights": WeightsPush(version=7),
    "request": GenerationRequest(step=3, prompt_ids=[[1, 2], [3]], seed=1234, records=[{"answer": "4"}, {}]),
    "stop": Stop(),
    "result": GenerationResult(ROLLOUT, version=4, generate_s=0.25, idle_s=0.0, refit_s=0.125, refit_bytes=96,
                               shard_bytes=96),
}
# Per kind, a field that must be present and a value of the wrong type for it.
REQUIRED = {"settings": ("sampling", [1.0]), "weights": ("version", "7"), "request": ("seed", 1.5),
            "result": ("generate_s", "fast")}


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_message_survives_the_trip_through_json(kind):
    message = EXAMPLES[kind]
    wire = json.loads(encode(message))
    assert wire["kind"] == kind and wire["protocol"] == PROTOCOL
    assert decode(encode(message)) == message
    assert decode(encode(message).encode()) == message  # as the store returns it: bytes


def test_a_multi_turn_rollout_and_a_request_without_records_survive_the_trip():
    multi = GeneratedRollout([0], [[5, 9]], [[-0.5, 0.0]], ["stop"], prompt_ids=[[1, 2]], response_mask=[[1, 0]],
                             env_info=[{"turns": 2}])
    result = GenerationResult(multi, 1, 1.0, 2.0, 0.0, 0, 0)
    assert decode(encode(result)) == result
    assert decode(encode(GenerationRequest(1, [[1]], 5))).records is None


def _error(wire) -> MessageError:
    with pytest.raises(MessageError) as caught:
        messages.from_wire(wire)
    return caught.value


@pytest.mark.parametrize("kind", sorted(REQUIRED))
def test_a_missing_field_is_named(kind):
    field, _ = REQUIRED[kind]
    wire = messages.to_wire(EXAMPLES[kind])
    del wire[field]
    err = _error(wire)
    assert (err.kind, err.field) == (kind, field)
    assert str(err) == f"malformed {kind!r} message: field {field!r} is missing"


@pytest.mark.parametrize("kind", sorted(REQUIRED))
def test_a_field_of_another_type_is_named(kind):
    field, wrong = REQUIRED[kind]
    wire = {**messages.to_wire(EXAMPLES[kind]), field: wrong}
    err = _error(wire)
    assert (err.kind, err.field) == (kind, field)
    assert f"field {field!r} has type {type(wrong).__name__}" in str(err)


def test_a_bool_is_not_an_int_and_a_nested_field_is_named_by_its_path():
    assert _error({**messages.to_wire(EXAMPLES["weights"]), "version": True}).field == "version"
    wire = messages.to_wire(EXAMPLES["result"])
    del wire["rollout"]["finish_reason"]
    err = _error(wire)
    assert (err.kind, err.field) == ("result", "rollout.finish_reason")
    wire["rollout"] = [1, 2]
    assert _error(wire).field == "rollout"


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_a_message_of_another_protocol_is_refused(kind):
    for protocol in (PROTOCOL + 1, None, "1"):
        wire = {**messages.to_wire(EXAMPLES[kind]), "protocol": protocol}
        if protocol is None:
            del wire["protocol"]
        err = _error(wire)
        assert (err.kind, err.field) == (kind, "protocol")
        assert f"this side speaks protocol {PROTOCOL}" in str(err)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_an_unknown_field_is_named(kind):
    err = _error({**messages.to_wire(EXAMPLES[kind]), "colour": "red"})
    assert (err.kind, err.field) == (kind, "colour")


@pytest.mark.parametrize("wire", [{"kind": "reboot", "protocol": PROTOCOL}, {"protocol": PROTOCOL}, {"kind": 3}])
def test_an_unknown_kind_is_refused(wire):
    err = _error(wire)
    assert (err.kind, err.field) == (str(wire.get("kind")), "kind")
    assert "is not one of" in str(err)


def test_a_result_in_the_trainers_stream_and_text_that_is_not_json_are_refused():
    with pytest.raises(MessageError) as caught:
        decode(encode(EXAMPLES["result"]), expect=TRAINER_MESSAGES)
    err = caught.value
    assert (err.kind, err.field) == ("result", "kind")
    with pytest.raises(MessageError, match="not JSON"):
        decode(b"\x80\x04 pickled")
    with pytest.raises(MessageError, match="not an object"):
        decode("[1, 2]")


def test_the_bridge_carries_typed_messages_in_order():

    from megatron_rl.distributed.bridge import Bridge
    from tests.test_bridge import _store_pair

    host, client = _store_pair()
    trainer, generator = Bridge(host), Bridge(client)
    stream = [EXAMPLES[k] for k in ("settings", "weights", "request")]
    for message in stream:
        trainer.post(message)
    trainer.post_stop()
    assert generator.peek_message() == stream[0]
    assert [generator.next_message() for _ in range(4)] == [*stream, Stop()]
    generator.put_result(3, EXAMPLES["result"])
    assert trainer.take_result(3) == EXAMPLES["result"]
    trainer.store.set("msg/4", json.dumps({"kind": "weights", "protocol": PROTOCOL}))
    with pytest.raises(MessageError, match="'weights' message: field 'version' is missing"):
        generator.next_message()
