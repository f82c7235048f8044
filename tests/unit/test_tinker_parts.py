"""The Tinker service's parts that need no process: the hand-written protobuf codec against bytes of the SDK's
own schema, the batch checks, Tinker's loss formulas on the rank, and `rayless tinker-server`'s flag checks.

The protobuf bytes are built here by hand, field by field (tinker_public.proto's numbers), so the codec is
checked without the SDK; with the SDK installed, its own encoder and decoders are checked against ours too.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from coordinator.tinker import requests as req
from coordinator.tinker import wire
from coordinator.tinker.cli import main as tinker_main
from workers import protocol
from workers.boundary.http_gates import HttpReply
from workers.train_rank.tinker_ops import datum_loss


def field(number: int, payload: bytes) -> bytes:
    return wire._key(number, 2) + wire._encode_varint(len(payload)) + payload


def tensor(values: np.ndarray, dtype: int) -> bytes:
    return field(1, values.tobytes()) + wire._key(3, 0) + wire._encode_varint(dtype)


def request_bytes(loss: str, datums: int = 1, tokens: tuple[int, ...] = (5, 6, 7)) -> bytes:
    chunk = field(1, field(1, np.asarray(tokens, dtype="<i4").tobytes()))
    inputs = (field(2, field(1, b"target_tokens") + field(2, tensor(np.asarray([6, 7, 8], "<i8"), 2)))
              + field(2, field(1, b"weights") + field(2, tensor(np.ones(3, "<f4"), 1))))
    body = field(1, b"m-1") + wire._key(2, 0) + wire._encode_varint(4) + field(4, loss.encode())
    body += field(5, field(1, b"clip_low_threshold") + wire._key(2, 1) + struct.pack("<d", 0.7))
    return body + field(3, field(1, chunk) + inputs) * datums


def test_the_forward_backward_request_decodes_field_by_field() -> None:
    parsed = wire.decode_forward_backward(request_bytes("ppo", datums=2), max_datums=4, max_tokens=16)
    assert (parsed.model_id, parsed.seq_id, parsed.loss_fn, parsed.forward_only) == ("m-1", 4, "ppo", False)
    assert parsed.loss_config == {"clip_low_threshold": 0.7}
    assert [d.tokens for d in parsed.data] == [[5, 6, 7], [5, 6, 7]]
    assert parsed.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert parsed.data[0].inputs["weights"].dtype == np.float32


@pytest.mark.parametrize(("body", "words"), [
    (request_bytes("ppo", datums=3), "over 2 data"),
    (request_bytes("ppo", tokens=tuple(range(20))), "over 16 tokens"),
    (b"\x1a\xff\xff\xff\xff\x0f", "past the end"),
    (b"\x0b", "wire type 3"),
    (field(3, field(1, field(2, b""))), "image chunks are not supported"),
    (b"\x80" * 11, "longer than 10 bytes"),
])
def test_a_hostile_body_is_refused_naming_why(body: bytes, words: str) -> None:
    with pytest.raises(wire.WireError, match=words):
        wire.decode_forward_backward(body, max_datums=2, max_tokens=16)


def sdk_or_skip() -> None:
    pytest.importorskip("tinker", reason="the official tinker SDK is not installed (the test extra installs it)")


def test_the_sdks_own_request_and_decoders_agree_with_the_codec() -> None:
    sdk_or_skip()
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    data = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]),
                                        "weights": np.array([0.0, 1.0, 1.0], dtype=np.float32)})]
    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id="m", seq_id=3)
    parsed = wire.decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString(),
                                          max_datums=8, max_tokens=8)
    assert (parsed.model_id, parsed.seq_id, parsed.data[0].tokens) == ("m", 3, [1, 2, 3])
    assert parsed.data[0].inputs["weights"].tolist() == [0.0, 1.0, 1.0]

    output = deserialize_forward_backward_output(wire.encode_forward_backward_output(
        {"logprobs": [[-1.0, -2.0], [-3.0]]}, {"loss:sum": 6.0}))
    assert output.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    sample = deserialize_sample_response(wire.encode_sample_response(
        [wire.SampledSequence([5, 6], [-0.5, -0.25], "length")], [None, -1.5]))
    assert sample.sequences[0].tokens == [5, 6] and sample.sequences[0].stop_reason == "length"
    assert sample.prompt_logprobs == [None, -1.5]


def test_the_batch_checks_name_the_datum_and_the_input() -> None:
    parsed = wire.decode_forward_backward(request_bytes("cross_entropy"), max_datums=4, max_tokens=16)
    parsed.loss_config = {}
    assert req.training_data(parsed, vocab_size=10)[0].weights == [1.0, 1.0, 1.0]
    with pytest.raises(HttpReply, match="outside the vocabulary"):
        req.training_data(parsed, vocab_size=8)
    parsed.loss_fn = "importance_sampling"
    with pytest.raises(HttpReply, match=r"data\[0\]: 'importance_sampling' needs loss_fn_inputs\['logprobs'\]"):
        req.training_data(parsed, vocab_size=10)
    for loss, words in (("cispo", "'cispo' is not served"), ("bogus", "unknown loss_fn 'bogus'")):
        with pytest.raises(HttpReply, match=words):
            req.refuse_loss(loss)


def one(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_the_losses_are_tinkers_sums() -> None:
    logp = one([math.log(0.5), math.log(0.25)])
    datum = protocol.TinkerDatum([1, 2], [2, 3], weights=[1.0, 2.0], logprobs=[math.log(0.25)] * 2,
                                 advantages=[1.0, -1.0])
    assert datum_loss(logp, datum, "cross_entropy", {}).tolist() == pytest.approx([math.log(2), 2 * math.log(4)])
    # ratios 2 and 1: importance sampling takes them whole; ppo clips the first (A > 0) at 1.2
    assert datum_loss(logp, datum, "importance_sampling", {}).tolist() == pytest.approx([-2.0, 1.0])
    assert datum_loss(logp, datum, "ppo", {}).tolist() == pytest.approx([-1.2, 1.0])
    assert datum_loss(logp, datum, "ppo", {"clip_high_threshold": 1.5}).tolist() == pytest.approx([-1.5, 1.0])
    with pytest.raises(ValueError, match="needs loss_fn_inputs"):
        datum_loss(logp, protocol.TinkerDatum([1, 2], [2, 3]), "ppo", {})


@pytest.mark.parametrize(("flags", "words"), [
    (["--base-model", "tiny=/nonexistent"], "not a Hugging Face model directory"),
    (["--base-model", "x=/", "--api-key", "secret"], "does not start with tml-"),
    (["--base-model", "x=/", "--host", "0.0.0.0"], "without a key"),
    (["--base-model", "x=/", "--session-timeout", "5"], "--session-timeout must be >= 15"),
    (["--base-model", "x=/", "--sampler-url", "y=http://127.0.0.1:30000"], "NAME must be one of the --base-model"),
    (["--base-model", "x=/", "--sampler-url", "x=127.0.0.1:30000"], "URL must be http(s)://HOST:PORT"),
])
def test_bad_flags_exit_2_before_anything_starts(flags: list[str], words: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert tinker_main(flags) == 2
    assert words in capsys.readouterr().err
