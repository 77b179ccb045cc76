"""TensorFlow's checkpoint bundle (`PREFIX.index` + `PREFIX.data-SSSSS-of-NNNNN`) read without
TensorFlow, which takes seconds to import and is not needed to read a few hundred arrays.

The index is a LevelDB sorted string table: data blocks of prefix-compressed keys with restart
points, an index block of handles to them, and a 48-byte footer ending in a magic number. Each block
is followed by a compression byte (none or snappy) and a masked CRC32C. The values are protocol
buffers: under the key "" a BundleHeaderProto (number of shards, endianness, format version),
under each tensor's name a BundleEntryProto (dtype, shape, shard, offset, size, masked CRC32C of
the tensor's bytes). Block and tensor checksums are verified.

Local paths are read with `open`; a URL (gs://...) goes through `tf.io.gfile`, imported then only
(bertjax/files.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct

import numpy as np

from bertjax import files
from bertjax.errors import Refusal

_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_NO_COMPRESSION, _SNAPPY = 0, 1
# The bundle format versions this reader knows (TensorFlow writes producer 1, min consumer 0).
_KNOWN_VERSION = 1

# TensorFlow's DataType enum -> numpy, little-endian as the header must say.
_DTYPES = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 8: "<c8", 9: "<i8",
           10: "?", 17: "<u2", 18: "<c16", 19: "<f2", 22: "<u4", 23: "<u8"}
_DT_STRING, _DT_BFLOAT16 = 7, 14


class BundleError(Refusal):
  """The files are not a TensorFlow checkpoint this reader can read (said how and why)."""


# Files -----------------------------------------------------------------------------------------

def resolve_prefix(prefix_or_dir: str) -> str:
  """The checkpoint prefix (`DIR/bert_model.ckpt`) of a prefix, its .index or data file, or a folder.

  A folder with several checkpoints takes the one its `checkpoint` file names (as TensorFlow's
  tf.train.latest_checkpoint does); without that file it is an error listing them.
  """
  path = prefix_or_dir.rstrip("/")
  if path.endswith(".index"):
    path = path[:-len(".index")]
  elif ".data-" in os.path.basename(path):
    path = path[:path.rindex(".data-")]
  if files.exists(path + ".index"):
    return path
  if not files.exists(path):
    raise FileNotFoundError(f"{prefix_or_dir} does not exist (give the folder of a TensorFlow "
                            "checkpoint or its prefix, e.g. DIR/bert_model.ckpt)")
  prefixes = sorted(name[:-len(".index")] for name in files.listdir(path) if name.endswith(".index"))
  if len(prefixes) == 1:
    return os.path.join(path, prefixes[0])
  if not prefixes:
    raise FileNotFoundError(f"{path} holds no TensorFlow checkpoint (no *.index file; a released "
                            "BERT folder holds bert_model.ckpt.index and bert_model.ckpt.data-*)")
  named = _latest_named(path)
  if named in prefixes:
    return os.path.join(path, named)
  # By step (model.ckpt-1000 after model.ckpt-200), not by name; and a fix every reader of a
  # folder takes (a weights folder is given as a folder, not a prefix, to init_from and others).
  newest = max(prefixes, key=lambda p: (int(p.rpartition("-")[2]) if p.rpartition("-")[2]
                                        .isdigit() else -1, p))
  raise FileNotFoundError(
      f"{path} holds {len(prefixes)} checkpoints ({', '.join(prefixes)}) and no `checkpoint` file "
      f"naming one: write {os.path.join(path, 'checkpoint')} holding the line "
      f"model_checkpoint_path: \"{newest}\" (the newest; or name another), or move the others "
      "away")


def _latest_named(folder: str) -> str | None:
  path = os.path.join(folder, "checkpoint")
  if not files.exists(path):
    return None
  with files.open_file(path, "r") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key.strip() == "model_checkpoint_path":
        return os.path.basename(value.strip().strip('"'))
  return None


# CRC32C (Castagnoli), as TensorFlow and LevelDB store it: masked -------------------------------

_POLY = 0x82F63B78  # reflected


@functools.cache
def _crc_table() -> np.ndarray:
  t = np.arange(256, dtype=np.uint32)
  for _ in range(8):
    t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
  return t


@functools.cache
def _shift_tables(length: int) -> tuple[list[int], ...]:
  """Four byte-indexed tables of the linear map 'run `length` zero bytes through the register'."""
  table = _crc_table()
  regs = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None])
  regs = regs.ravel()
  for _ in range(length):
    regs = table[regs & 0xFF] ^ (regs >> 8)
  return tuple(regs.reshape(4, 256)[k].tolist() for k in range(4))


@functools.cache
def _crc_list() -> list[int]:
  return _crc_table().tolist()


def _crc_bytes(reg: int, data: bytes) -> int:
  table = _crc_list()
  for byte in data:
    reg = table[(reg ^ byte) & 0xFF] ^ (reg >> 8)
  return reg


def crc32c(data) -> int:
  """CRC32C of `data` (bytes-like). Long inputs are cut into equal chunks whose registers advance
  together (one numpy step per byte column), then chained: the register is linear in the data, so
  crc(A + B) = shift_|B|(crc(A)) ^ crc_from_zero(B)."""
  buf = np.frombuffer(memoryview(data).cast("B"), np.uint8)
  n = buf.size
  reg = 0xFFFFFFFF
  if n < 8192:
    return _crc_bytes(reg, buf.tobytes()) ^ 0xFFFFFFFF
  # Chunks of a power-of-two length (their shift tables are cached) near sqrt(n / 4).
  width = 1 << max(8, min(14, int(np.log2(np.sqrt(n / 4)))))
  count = n // width
  table = _crc_table()
  regs = np.zeros(count, np.uint32)
  regs[0] = reg
  chunks = buf[:count * width].reshape(count, width)
  for start in range(0, width, 512):  # column slabs, transposed so each column is contiguous
    slab = np.ascontiguousarray(chunks[:, start:start + 512].T)
    for column in slab:
      regs = table[(regs ^ column) & 0xFF] ^ (regs >> 8)
  t0, t1, t2, t3 = _shift_tables(width)
  values = regs.tolist()
  reg = values[0]
  for value in values[1:]:
    reg = t0[reg & 0xFF] ^ t1[(reg >> 8) & 0xFF] ^ t2[(reg >> 16) & 0xFF] ^ t3[reg >> 24] ^ value
  return _crc_bytes(reg, buf[count * width:].tobytes()) ^ 0xFFFFFFFF


def masked_crc32c(data) -> int:
  crc = crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


# Varints, protocol buffers, snappy ------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
  value, shift = 0, 0
  while True:
    if pos >= len(buf):
      raise BundleError("a varint runs past the end of its buffer")
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, pos
    shift += 7


def _proto_fields(buf: bytes):
  """(field number, value) of a protocol buffer message: ints for varint and fixed fields, bytes
  for length-delimited ones (strings, sub-messages, packed arrays)."""
  pos = 0
  while pos < len(buf):
    key, pos = _varint(buf, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, pos = _varint(buf, pos)
    elif wire == 1:
      value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
    elif wire == 2:
      size, pos = _varint(buf, pos)
      value, pos = bytes(buf[pos:pos + size]), pos + size
    elif wire == 5:
      value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
    else:
      raise BundleError(f"protocol buffer wire type {wire} (groups are not used by checkpoints)")
    yield number, value


def snappy_decompress(buf: bytes) -> bytes:
  """Snappy's raw format: the uncompressed length, then literals and back-references."""
  size, pos = _varint(buf, 0)
  out = bytearray()
  while pos < len(buf):
    tag = buf[pos]
    pos += 1
    kind = tag & 3
    if kind == 0:  # literal; lengths over 60 follow in 1-4 bytes
      length = tag >> 2
      if length >= 60:
        extra = length - 59
        length = int.from_bytes(buf[pos:pos + extra], "little")
        pos += extra
      length += 1
      out += buf[pos:pos + length]
      pos += length
      continue
    if kind == 1:
      length, offset = 4 + ((tag >> 2) & 7), ((tag >> 5) << 8) | buf[pos]
      pos += 1
    else:
      width = 2 if kind == 2 else 4
      length, offset = (tag >> 2) + 1, int.from_bytes(buf[pos:pos + width], "little")
      pos += width
    if not 0 < offset <= len(out):
      raise BundleError(f"snappy back-reference to offset {offset} with {len(out)} bytes out")
    start = len(out) - offset
    if offset >= length:
      out += out[start:start + length]
    else:  # an overlapping copy repeats the last `offset` bytes
      out += (out[start:] * (length // offset + 1))[:length]
  if len(out) != size:
    raise BundleError(f"snappy block decompressed to {len(out)} bytes, its header says {size}")
  return bytes(out)


# The sorted string table ------------------------------------------------------------------------

def _block(table: bytes, offset: int, size: int, where: str) -> bytes:
  if offset + size + 5 > len(table):
    raise BundleError(f"{where}: a block at {offset} (+{size}) runs past the end of the file "
                      f"({len(table)} bytes): the file is cut short")
  contents = table[offset:offset + size]
  kind = table[offset + size]
  stored = struct.unpack_from("<I", table, offset + size + 1)[0]
  if masked_crc32c(table[offset:offset + size + 1]) != stored:
    raise BundleError(f"{where}: the block at byte {offset} fails its checksum: the file is damaged")
  if kind == _SNAPPY:
    return snappy_decompress(contents)
  if kind != _NO_COMPRESSION:
    raise BundleError(f"{where}: block compression {kind} is unknown (0 none, 1 snappy)")
  return contents


def _block_entries(block: bytes, where: str):
  """(key, value) of one block; keys share a prefix with the key before them."""
  if len(block) < 4:
    raise BundleError(f"{where}: a block of {len(block)} bytes")
  restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
  end = len(block) - 4 - 4 * restarts
  if end < 0:
    raise BundleError(f"{where}: a block claims {restarts} restart points in {len(block)} bytes")
  pos, key = 0, b""
  while pos < end:
    shared, pos = _varint(block, pos)
    unshared, pos = _varint(block, pos)
    size, pos = _varint(block, pos)
    key = key[:shared] + block[pos:pos + unshared]
    pos += unshared
    yield key, block[pos:pos + size]
    pos += size


def read_table(table: bytes, where: str = "the index"):
  """Every (key, value) of a LevelDB table held in memory, in key order."""
  if len(table) < _FOOTER_SIZE or struct.unpack_from("<Q", table, len(table) - 8)[0] != _MAGIC:
    raise BundleError(f"{where} is not a TensorFlow checkpoint index (no table magic number at "
                      "its end); it may be cut short, or a TF2 SavedModel or another format")
  footer = table[-_FOOTER_SIZE:]
  _, pos = _varint(footer, 0)  # the metaindex block (filters): unused here
  _, pos = _varint(footer, pos)
  index_offset, pos = _varint(footer, pos)
  index_size, pos = _varint(footer, pos)
  for _, handle in _block_entries(_block(table, index_offset, index_size, where), where):
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    yield from _block_entries(_block(table, offset, size, where), where)


# The bundle ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
  """Where one tensor lies in the data shards."""

  dtype: int  # TensorFlow's DataType number
  shape: tuple[int, ...]
  shard: int
  offset: int
  size: int
  crc: int | None  # masked CRC32C of the bytes


def _shape(buf: bytes) -> tuple[int, ...]:
  dims = []
  for number, value in _proto_fields(buf):
    if number == 2:
      size = dict(_proto_fields(value)).get(1, 0)
      dims.append(size - (1 << 64) if size >= 1 << 63 else size)
    elif number == 3 and value:
      raise BundleError("a tensor of unknown rank")
  return tuple(dims)


def _entry(name: str, buf: bytes) -> Entry:
  fields = {"dtype": 0, "shape": (), "shard": 0, "offset": 0, "size": 0, "crc": None}
  for number, value in _proto_fields(buf):
    if number == 1:
      fields["dtype"] = value
    elif number == 2:
      fields["shape"] = _shape(value)
    elif number in (3, 4, 5):
      fields[{3: "shard", 4: "offset", 5: "size"}[number]] = value
    elif number == 6:
      fields["crc"] = value
    elif number == 7:
      raise BundleError(f"{name} was saved in slices (a partitioned variable); save it whole "
                        "(tf.compat.v1.train.Saver of the unpartitioned variable) to read it here")
  return Entry(**fields)


class CheckpointReader:
  """Names, shapes and values of a TensorFlow checkpoint; values are read when asked for.

  `prefix_or_dir`: see `resolve_prefix`. `verify`: check each tensor's CRC32C as it is read.
  """

  def __init__(self, prefix_or_dir: str, verify: bool = True):
    self.prefix = resolve_prefix(prefix_or_dir)
    self.verify = verify
    index = self.prefix + ".index"
    with files.open_file(index) as f:
      table = f.read()
    header, self.entries = None, {}
    for key, value in read_table(table, index):
      if key == b"":
        header = dict(_proto_fields(value))
      else:
        name = key.decode("utf-8")
        self.entries[name] = _entry(name, value)
    if header is None:
      raise BundleError(f"{index} has no bundle header (the entry under the empty key)")
    if header.get(2, 0) != 0:
      raise BundleError(f"{index} was written big-endian; this reader reads little-endian bundles")
    version = dict(_proto_fields(header.get(3, b"")))
    if version.get(2, 0) > _KNOWN_VERSION:
      raise BundleError(f"{index} needs a reader of bundle version {version[2]} or later (this "
                        f"one knows {_KNOWN_VERSION}); read it with TensorFlow")
    self.num_shards = header.get(1, 1)

  def shapes(self) -> dict[str, tuple[int, ...]]:
    return {name: entry.shape for name, entry in self.entries.items()}

  def keys(self):
    return self.entries.keys()

  def __contains__(self, name: str) -> bool:
    return name in self.entries

  def shard_path(self, shard: int) -> str:
    return f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

  def read(self, name: str) -> np.ndarray:
    """The tensor `name` as a numpy array (strings as an object array of bytes)."""
    entry = self.entries[name]
    path = self.shard_path(entry.shard)
    if not files.exists(path):
      raise FileNotFoundError(f"{path} (shard {entry.shard} of the checkpoint, holding {name}) "
                              "is missing")
    with files.open_file(path) as f:
      f.seek(entry.offset)
      data = f.read(entry.size)
    if len(data) != entry.size:
      raise BundleError(f"{path} ends before {name} ({entry.size} bytes at {entry.offset}): the "
                        "file is cut short")
    if entry.dtype == _DT_STRING:
      return _strings(data, entry, f"{name} in {path}", self.verify)
    if self.verify and entry.crc is not None and masked_crc32c(data) != entry.crc:
      raise BundleError(f"{name} in {path} fails its checksum: the file is damaged")
    if entry.dtype == _DT_BFLOAT16:
      import ml_dtypes  # pylint: disable=import-outside-toplevel
      dtype = np.dtype(ml_dtypes.bfloat16)
    elif entry.dtype in _DTYPES:
      dtype = np.dtype(_DTYPES[entry.dtype])
    else:
      raise BundleError(f"{name} has TensorFlow dtype number {entry.dtype}, which this reader "
                        "does not know")
    count = int(np.prod(entry.shape, dtype=np.int64))
    if count * dtype.itemsize != entry.size:
      raise BundleError(f"{name}: {entry.size} bytes for shape {entry.shape} of {dtype}")
    return np.frombuffer(data, dtype).reshape(entry.shape).astype(dtype.newbyteorder("="))


def _strings(data: bytes, entry: Entry, where: str, verify: bool) -> np.ndarray:
  # Layout: a varint length per element, a masked CRC32C of the lengths (each as 4 bytes), then
  # the bytes. The entry's checksum covers the lengths as 4 bytes each, that CRC and the bytes.
  count = int(np.prod(entry.shape, dtype=np.int64))
  lengths, pos = [], 0
  for _ in range(count):
    length, pos = _varint(data, pos)
    lengths.append(length)
  as_uint32 = np.array(lengths, "<u4").tobytes()
  stored = data[pos:pos + 4]
  pos += 4
  out = np.empty(count, object)
  for i, length in enumerate(lengths):
    out[i] = data[pos:pos + length]
    pos += length
  if pos != len(data):
    raise BundleError(f"{where}: a string tensor of {len(data)} bytes, {pos} accounted for")
  if verify and (struct.pack("<I", masked_crc32c(as_uint32)) != stored or (
      entry.crc is not None and masked_crc32c(as_uint32 + data[-sum(lengths) - 4:]) != entry.crc)):
    raise BundleError(f"{where} fails its checksum: the file is damaged")
  return out.reshape(entry.shape)


def read_checkpoint(prefix_or_dir: str, verify: bool = True) -> dict[str, np.ndarray]:
  """Every tensor of a TensorFlow checkpoint, by name."""
  reader = CheckpointReader(prefix_or_dir, verify)
  return {name: reader.read(name) for name in reader.keys()}
