"""Checkpoint files that notebook 12's loader must refuse, or read as safetensors reads them.

Each malformed file is built by hand (8 bytes of header length, little-endian, the JSON header,
the data), and each test asserts both that safetensors refuses it and that ``checkpoint_layout``
and ``CheckpointLoader`` refuse it too, with a one-line ValueError that names the file and,
where there is one, the tensor. CPU only: no GPU, no pinned memory.
"""

import json

import pytest
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import helpers

CHUNK = 64 * 2**10


@pytest.fixture(scope="module")
def loader():
    loader = helpers.CheckpointLoader("cpu", chunk_bytes=CHUNK, threads=2, pin=False)
    yield loader
    loader.close()


def _write(path, header: dict, data: bytes = b"", length: int | None = None):
    """A safetensors file: the header's length (``length`` in its place, where given), the
    header as JSON, then ``data``."""
    text = json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text
                     + data)
    return path


def _u8(begin: int, end: int, dtype: str = "U8", shape: list | None = None) -> dict:
    """A header entry: ``end - begin`` bytes of ``dtype`` (one a byte, unless ``shape``)."""
    return {"dtype": dtype, "shape": [end - begin] if shape is None else shape,
            "data_offsets": [begin, end]}


def _refused(path, loader, *words: str):
    """Assert that our index and our loader refuse ``path`` with one line that names it and
    holds each of ``words``."""
    for index in (helpers.checkpoint_layout, loader.load):
        with pytest.raises(ValueError) as raised:
            index(path)
        message = str(raised.value)
        assert "\n" not in message and str(path) in message, message
        for word in words:
            assert word in message, message


# name: (header, data, header length (None: the header's own), words our refusal holds)
MALFORMED = {
    "overlapping offsets": ({"a": _u8(0, 16), "b": _u8(8, 24)}, bytes(24), None,
                            ("'b'", "overlap")),
    "gap between tensors": ({"a": _u8(0, 16), "b": _u8(20, 36)}, bytes(36), None,
                            ("'b'", "gap of 4 bytes")),
    "first not at 0": ({"a": _u8(4, 20)}, bytes(20), None, ("'a'", "must begin at 0")),
    "end before begin": ({"a": _u8(0, 16), "b": _u8(16, 8, shape=[0])}, bytes(16), None,
                         ("'b'", "ends before it begins")),
    "trailing bytes": ({"a": _u8(0, 16)}, bytes(20), None, ("'a'", "4 bytes after")),
    "truncated data": ({"a": _u8(0, 16), "b": _u8(16, 32)}, bytes(20), None,
                       ("is truncated", "'b'")),
    "header longer than the file": ({"a": _u8(0, 16)}, bytes(16), 500, ("is truncated",)),
    "header over 100 MB": ({"a": _u8(0, 16)}, bytes(16), 100_000_001, ("too large",)),
    "unknown dtype": ({"a": _u8(0, 4, "F7")}, bytes(4), None,
                      ("'a'", "'F7'", "safetensors does not know")),
    "F4 with an odd last dimension": ({"a": _u8(0, 3, "F4", [2, 3])}, bytes(3), None,
                                      ("'a'", "F4", "multiple of 2")),
    "shape not a count": ({"a": _u8(0, 16, shape=[16.0])}, bytes(16), None, ("'a'", "shape")),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_file_safetensors_refuses_is_refused_in_one_line(tmp_path, loader, case):
    header, data, length, words = MALFORMED[case]
    path = _write(tmp_path / "m.safetensors", header, data, length)
    with pytest.raises(safetensors.SafetensorError):
        load_file(str(path))
    _refused(path, loader, *words)


def test_a_file_shorter_than_a_header_length_is_refused(tmp_path, loader):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\x01\x00\x00")
    with pytest.raises(safetensors.SafetensorError, match="header too small"):
        safe_open(str(path), "pt")
    _refused(path, loader, "is truncated: 3 bytes")


@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_a_six_bit_dtype_is_refused_torch_has_none(tmp_path, loader, code):
    path = _write(tmp_path / "m.safetensors", {"a": _u8(0, 3, code, [4])}, bytes(3))
    with safe_open(str(path), "pt") as f:  # the format knows it: its header is read
        assert list(f.keys()) == ["a"] and f.get_slice("a").get_dtype() == code
    with pytest.raises(safetensors.SafetensorError):  # torch's side has no dtype for it
        load_file(str(path))
    _refused(path, loader, "'a'", f"torch has no dtype for {code}")


# safetensors' name, torch's, a header shape and bytes for it (F4: two values a byte)
NEW_DTYPES = [("F8_E8M0", "float8_e8m0fnu", [3, 5], 15),
              ("F8_E4M3FNUZ", "float8_e4m3fnuz", [7], 7),
              ("F8_E5M2FNUZ", "float8_e5m2fnuz", [2, 2, 3], 12),
              ("F4", "float4_e2m1fn_x2", [3, 4], 6),
              ("F4", "float4_e2m1fn_x2", [4], 2)]


@pytest.mark.parametrize("code, torch_name, shape, nbytes", NEW_DTYPES)
def test_a_newer_dtype_loads_as_safetensors_loads_it(tmp_path, loader, code, torch_name, shape,
                                                      nbytes):
    dtype = getattr(torch, torch_name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {torch_name}")
    data = bytes(range(7, 7 + nbytes)) + bytes(range(200, 210))
    header = {"x": _u8(0, nbytes, code, shape), "after": _u8(nbytes, nbytes + 10)}
    path = _write(tmp_path / "m.safetensors", header, data)
    reference = load_file(str(path))
    assert helpers.SAFETENSORS_DTYPES[code] == dtype
    placed = helpers.checkpoint_layout(path).structure["x"]
    assert placed.dtype == dtype and placed.shape == tuple(reference["x"].shape)
    loaded = loader.load(path)
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8))


def test_f4_keeps_the_shape_safetensors_torch_gives():
    # safetensors' shape counts 4-bit values; torch's last dimension counts bytes
    assert helpers._torch_shape("m", "x", "F4", (3, 4)) == (3, 2)
    assert helpers._torch_shape("m", "x", "F8_E8M0", (3, 4)) == (3, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        helpers._torch_shape("m", "x", "F4", ())  # one 4-bit value: no whole byte


# ---------------------------------------------------------------------------- sharded


def _shards(directory, torch_files: bool):
    """Two shards (safetensors, or torch.save state dicts) and their index; returns the index's
    path, its weight_map, and every tensor."""
    suffix = "bin" if torch_files else "safetensors"
    shards = {f"model-00001-of-00002.{suffix}": {"a": torch.arange(6.0), "b": torch.ones(3, 2)},
              f"model-00002-of-00002.{suffix}": {"c": torch.arange(4, dtype=torch.int64)}}
    weight_map = {}
    for name, tensors in shards.items():
        if torch_files:
            torch.save(tensors, directory / name)
        else:
            save_file(tensors, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
    union = {name: t for tensors in shards.values() for name, t in tensors.items()}
    return directory / f"model.{suffix}.index.json", weight_map, union


def _index(path, weight_map):
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("torch_files", [False, True], ids=["safetensors", "torch"])
def test_a_valid_sharded_checkpoint_still_loads(tmp_path, loader, torch_files):
    index, weight_map, union = _shards(tmp_path, torch_files)
    loaded = loader.load(_index(index, weight_map))
    assert sorted(loaded) == sorted(union)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in union.items())


def _ghost(weight_map):  # a name no shard holds, put in a shard that is there
    return {**weight_map, "ghost": weight_map["c"]}


def _moved(weight_map):  # "a" put in the shard that does not hold it
    return {**weight_map, "a": weight_map["c"]}


def _unnamed(weight_map):  # "b" left out of the index, its shard still holding it
    return {name: file for name, file in weight_map.items() if name != "b"}


# how the index is spoilt, and what our refusal says besides the index's path
SPOILT = {"a name no shard holds": (_ghost, ("'ghost'", "no shard holds", "model-00001")),
          "a name in the wrong shard": (_moved, ("'a'", "model-00002", "model-00001")),
          "a tensor the index leaves out": (_unnamed, ("'b'", "does not name", "model-00001"))}


@pytest.mark.parametrize("torch_files", [False, True], ids=["safetensors", "torch"])
@pytest.mark.parametrize("case", SPOILT)
def test_an_index_that_disagrees_with_its_shards_is_refused(tmp_path, loader, case,
                                                            torch_files):
    index, weight_map, _ = _shards(tmp_path, torch_files)
    spoil, words = SPOILT[case]
    _refused(_index(index, spoil(weight_map)), loader, *words)


@pytest.mark.parametrize("torch_files", [False, True], ids=["safetensors", "torch"])
def test_an_index_that_names_a_shard_two_ways_reads_it_once(tmp_path, loader, torch_files):
    index, weight_map, union = _shards(tmp_path, torch_files)
    first = weight_map["a"]
    loaded = loader.load(_index(index, {**weight_map, "b": f"./{first}"}))  # "x" and "./x"
    assert sorted(loaded) == sorted(union)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in union.items())


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    first, second = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    save_file({"a": torch.ones(2)}, str(first))
    save_file({"a": torch.zeros(2)}, str(second))
    with pytest.raises(ValueError, match="'a' is in two shards") as refused:
        helpers.checkpoint_layout([first, second])
    assert str(first) in str(refused.value) and str(second) in str(refused.value)


def test_the_mmap_loader_copies_with_at_most_its_cap_of_threads_and_gives_them_back(
        tmp_path, monkeypatch):
    # notebook 12's mmap loader took 2,134 ms warm with 64 intra-op threads faulting the file's
    # pages in at once, 178 ms with 16: it copies with at most MAX_THREADS of them
    path = tmp_path / "state.pt"
    state = {f"w{i}": torch.arange(3 * CHUNK // 4, dtype=torch.float32) + i for i in range(3)}
    torch.save(state, path)
    loader = helpers.CheckpointLoader("cpu", read="mmap", chunk_bytes=CHUNK, pin=False)
    seen, fill = [], loader._fill
    monkeypatch.setattr(loader, "_fill", lambda *a: (seen.append(torch.get_num_threads()),
                                                     fill(*a))[1])
    previous = torch.get_num_threads()
    torch.set_num_threads(helpers.CheckpointLoader.MAX_THREADS + 4)
    try:
        loaded = loader.load(path)
        assert seen and max(seen) == helpers.CheckpointLoader.MAX_THREADS
        assert torch.get_num_threads() == helpers.CheckpointLoader.MAX_THREADS + 4
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
