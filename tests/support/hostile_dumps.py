"""Hostile inputs for the dump reader and the `.pt` importer: valid checksums around hostile structure.

Owns the builders the hostile-input tests share: `framed_dump` puts arbitrary payload bytes into frames with
correct CRCs and a correct trailer chain (so only the structure can be refused), `nested_tuple_dump` is the
extension type nested N deep that used to overflow the C stack, and the `.pt` bombs (shared references,
a deflated storage far larger than its zip, self-reference, deep nesting), and `torch_zip` with the pickles
that build an allowed global badly (`BAD_BUILDS`: a set of a list, an OrderedDict of an int). `peak_rss_growth` runs a
statement in a fresh interpreter and reports how far its peak memory rose while it ran.
"""

from __future__ import annotations

import json
import pickle  # noqa: TID251 - writes hostile test inputs; never used to read anything in rayless
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path
from typing import Any

import msgpack

from replay import bounds
from replay import format as fmt
from replay.sample import Sample, SampleStatus


def good_sample() -> Sample:
    return Sample(group_index=0, sample_index=0, prompt="p", tokens=[5, 6, 7], response_length=2,
                  loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.25], reward=1.0, status=SampleStatus.COMPLETED,
                  weight_versions=["0"], label="7", response="r", advantage=0.5, metadata={"k": [1, 2]})


def good_header(sample_count: int = 1) -> dict[str, Any]:
    return {"format_version": fmt.FORMAT_VERSION, "rollout_id": 1, "kind": "rollout", "created_at": 1.0, "created_at_iso": "x",
            "writer": "test", "sample_count": sample_count, "sample_fields": list(fmt.SAMPLE_FIELDS),
            "config": {"n_samples_per_prompt": 1}}


def framed_dump(path: Path, header: bytes, samples: list[bytes], trailer: bytes | None = None,
                sample_count: int | None = None) -> Path:
    """A dump whose frames hold exactly these payload bytes, every CRC and the trailer chain correct."""
    out = bytearray(fmt.MAGIC + struct.pack("<H", fmt.FORMAT_VERSION))
    out += fmt.encode_frame(b"H", header)[0]
    chain = 0
    for payload in samples:
        frame, crc = fmt.encode_frame(b"S", payload)
        out += frame
        chain = zlib.crc32(struct.pack("<I", crc), chain)
    if trailer is None:
        count = len(samples) if sample_count is None else sample_count
        trailer = fmt.packb({"sample_count": count, "chain": chain})
    out += fmt.encode_frame(b"T", trailer)[0]
    path.write_bytes(bytes(out))
    return path


def nested_tuple(depth: int) -> bytes:
    """msgpack bytes of `(((),),)` nested `depth` deep as the format writes tuples (`depth` >= 1)."""
    inner = msgpack.packb(msgpack.ExtType(bounds.EXT_TUPLE, b"\x90"))  # ()
    for _ in range(depth - 1):
        inner = msgpack.packb(msgpack.ExtType(bounds.EXT_TUPLE, b"\x91" + inner))  # (inner,)
    return inner


def sample_payload(metadata_x: bytes) -> bytes:
    """A good sample record whose metadata is {"x": <these msgpack bytes>}, written by hand (msgpack's
    packer would refuse to write some of what the tests need)."""
    record = msgpack.unpackb(fmt.encode_sample(good_sample()), raw=False, ext_hook=msgpack.ExtType)
    payload = msgpack.packb({k: v for k, v in record.items() if k != "metadata"})
    assert 0x80 <= payload[0] < 0x8F  # a fixmap: one more field fits in its head byte
    return bytes([payload[0] + 1]) + payload[1:] + msgpack.packb("metadata") + b"\x81" + msgpack.packb("x") + metadata_x


def nested_tuple_dump(path: Path, depth: int) -> Path:
    """A valid sample whose metadata holds a tuple extension nested `depth` deep (200: ~1.3 KB)."""
    return framed_dump(path, fmt.packb(good_header()), [sample_payload(nested_tuple(depth))])


# ------------------------------------------------------------------------------------------ .pt bombs


def slime_sample(index: int = 0) -> dict[str, Any]:
    return {"index": index, "group_index": 0, "prompt": "p", "tokens": [1, 2, 3], "response_length": 2,
            "loss_mask": [1, 1], "rollout_log_probs": [-0.5, -0.5], "reward": 1.0, "status": "completed"}


def shared_reference_bomb(path: Path, levels: int = 8, width: int = 16) -> Path:
    """A pickle under 1 KB whose plain expansion is width**levels lists (16**8: 4 billion): each level
    lists the one below `width` times, shallow enough to pass any nesting bound."""
    node: Any = [1000] * 8
    for _ in range(levels):
        node = [node] * width
    sample = slime_sample()
    sample["metadata"] = {"bomb": node}
    path.write_bytes(pickle.dumps({"rollout_id": 0, "samples": [sample]}, protocol=4))
    return path


def self_reference(path: Path) -> Path:
    loop: list[Any] = []
    loop.append(loop)
    sample = slime_sample()
    sample["metadata"] = {"loop": loop}
    path.write_bytes(pickle.dumps({"rollout_id": 0, "samples": [sample]}, protocol=4))
    return path


def deep_nesting(path: Path, depth: int = 100_000) -> Path:
    """A pickle of lists nested `depth` deep, written opcode by opcode (pickle.dumps itself would recurse)."""
    body = b"\x80\x04" + b"}q\x00"  # PROTO 4, EMPTY_DICT
    # {"rollout_id": 0, "samples": [ {...sample..., "metadata": {"deep": [[[...]]]}} ]}
    sample = pickle.dumps(slime_sample(), protocol=4)[2:-1]  # the sample dict's opcodes, without PROTO/STOP
    deep = b"]" * depth + b"a" * (depth - 1)  # EMPTY_LIST x depth, then APPEND each into the one below
    body = (b"\x80\x04" + b"}" + b"(" + pickle.dumps("rollout_id", protocol=4)[2:-1] + b"K\x00"
            + pickle.dumps("samples", protocol=4)[2:-1] + b"]" + sample
            + b"(" + pickle.dumps("metadata", protocol=4)[2:-1] + b"}" + pickle.dumps("deep", protocol=4)[2:-1]
            + deep + b"s" + b"u" + b"a" + b"u.")
    path.write_bytes(body)
    return path


class _Storage:
    """Stands for a tensor storage in `deflated_storage_zip`'s pickle (written as torch's persistent id)."""


class _Tensor:
    def __init__(self, storage: _Storage, numel: int) -> None:
        self.storage, self.numel = storage, numel

    def __reduce__(self) -> Any:
        import collections

        from torch._utils import _rebuild_tensor_v2

        return _rebuild_tensor_v2, (self.storage, 0, (self.numel,), (1,), False, collections.OrderedDict())


def deflated_storage_zip(path: Path, storage_bytes: int = 1 << 30) -> Path:
    """A torch.save zip whose one int64 tensor has a storage of `storage_bytes` zeros, deflated: ~1 MB of
    file for 1 GiB of storage. Written record by record, so making it never holds the storage in memory."""
    import io

    import torch

    numel = storage_bytes // 8
    storage = _Storage()

    class TorchPickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.LongStorage, "0", "cpu", numel) if obj is storage else None

    buffer = io.BytesIO()
    sample = dict(slime_sample(), tokens=_Tensor(storage, numel))
    TorchPickler(buffer, protocol=2).dump({"rollout_id": 0, "samples": [sample]})
    with zipfile.ZipFile(path, "w") as out:
        out.writestr("archive/data.pkl", buffer.getvalue())
        out.writestr("archive/byteorder", "little")
        entry = zipfile.ZipInfo("archive/data/0")
        entry.compress_type = zipfile.ZIP_DEFLATED
        with out.open(entry, "w", force_zip64=True) as stream:
            chunk = bytes(1 << 20)
            for _ in range(storage_bytes >> 20):
                stream.write(chunk)
        out.writestr("archive/version", "3\n")
    return path


# ----------------------------------------------------------------------------------------- measuring


def peak_rss_growth(setup: str, statement: str, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run `setup` then `statement` in a fresh interpreter; returns {"growth_mib", "error", "seconds"}.

    The growth is the process's peak RSS while the statement ran (VmHWM, reset just before it through
    /proc/self/clear_refs) minus its RSS just before it. `error` is the exception's type and message, or None when it returned."""
    code = textwrap.dedent(
        """
        import json, time, gc
        {setup}
        gc.collect()
        def status(key):
            line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
            return int(line.split()[1]) / 1024
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets the peak RSS (VmHWM) to the current RSS
        before = status("VmRSS")
        started = time.monotonic()
        error = None
        try:
        {statement}
        except BaseException as exc:
            error = type(exc).__name__ + ": " + str(exc)[:300]
        seconds = time.monotonic() - started
        peak = status("VmHWM")
        print(json.dumps({{"growth_mib": peak - before, "error": error, "seconds": seconds}}))
        """
    ).format(setup=textwrap.dedent(setup), statement=textwrap.indent(textwrap.dedent(statement), "    "))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"the child exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_zip(path: Path, data_pkl: bytes) -> Path:
    """A zip laid out as torch.save writes it, holding these pickle bytes as its data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/byteorder", "little")
    return path


#: pickles that build an allowed global (set, frozenset, OrderedDict) in a way it cannot be built
BAD_BUILDS = {
    "set of a list": b"\x80\x02cbuiltins\nset\n]]K\x01aa\x85R.",
    "set of three arguments": b"\x80\x02cbuiltins\nset\nK\x01K\x02K\x03\x87R.",
    "OrderedDict of an int": b"\x80\x02ccollections\nOrderedDict\nK\x05\x85R.",
    "OrderedDict with a list key": b"\x80\x02ccollections\nOrderedDict\n)R(]K\x01u.",
    "set given state": b"\x80\x02cbuiltins\nset\n)R}X\x01\x00\x00\x00aK\x01sb.",
    "set appended to": b"\x80\x02cbuiltins\nset\n)R(K\x01e.",
    "set item assigned": b"\x80\x02cbuiltins\nset\n)RK\x01K\x02s.",
    "frozenset of an int": b"\x80\x02cbuiltins\nfrozenset\nK\x01\x85\x81.",
    "a memo never stored": b"\x80\x02h\x05.",
    "protocol 4 set of a list": b"\x80\x04\x8f(]\x90.",
}
