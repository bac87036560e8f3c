"""The series of one analysis as one ``.npz`` image (a zip of uncompressed ``.npy`` members), and back.

:func:`pack_series` writes the image in one piece (:func:`stored_zip`); :func:`read_members`
reads every member in place, each checked: stored, not compressed; its CRC-32; a ``.npy``
version 1.0 or 2.0 header without objects; no more data declared than held;
:func:`parse_series` checks a stored image at the boundary (its keys, its members) and
refuses anything else in one :class:`~gradforensics.errors.CorruptStoreError`.
"""

from __future__ import annotations

import io
import math
import struct
import sys
import time
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradforensics.errors import CorruptStoreError

__all__ = ["pack_series", "parse_series", "read_members", "stored_zip"]

NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")

Entry = tuple[str, int, int, int, int]
"""A member: name, local header offset, size, CRC-32, compression."""


def pack_series(series: Mapping[str, Any]) -> np.ndarray:
    """All series of one analysis as one uint8 array (an ``.npz`` image, no pickle).

    One stored array per analysis instead of one per series: a store with
    hundreds of tensors would otherwise get thousands of tiny arrays, and their
    metadata dominated the time of writing the results.  :func:`parse_series`
    reads it back.
    """
    arrays: dict[str, Any] = {f"s{i}": np.asarray(v) for i, v in enumerate(series.values())}
    arrays["__keys__"] = np.asarray(list(series.keys()), dtype=str)
    headers: dict[tuple[str, tuple[int, ...], bool], bytes] = {}
    # what np.savez writes, one header built per distinct shape
    members = [(f"{key}.npy", _npy_bytes(arr, headers)) for key, arr in arrays.items()]
    date_time = time.localtime(time.time())[:6]
    image = stored_zip(members, date_time)
    if image is None:               # past the plain zip format's limits: zipfile's own writer (zip64)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, data in members:
                zf.writestr(zipfile.ZipInfo(name, date_time), data)
        image = buf.getvalue()
    return np.frombuffer(image, dtype=np.uint8)


# the zip records a series image is made of (PKWARE's APPNOTE), every 2-byte field as one H:
# written by stored_zip, read by _plain_directory
_LOCAL = struct.Struct("<4s5H3L2H")              # local file header (30 bytes)
_CENTRAL = struct.Struct("<4s6H3L5H2L")          # central directory file header (46 bytes)
_END = struct.Struct("<4s4H2LH")                 # end of central directory record (22 bytes)
_ZIP_LIMIT = (1 << 31) - 1                      # zipfile.ZIP64_LIMIT
_CREATE_SYSTEM = 0 if sys.platform == "win32" else 3


def stored_zip(members: Sequence[tuple[str, bytes]], date_time: tuple[int, ...]) -> bytes | None:
    """The uncompressed zip of *members* (name, bytes) that ``zipfile`` writes for them, built in one piece.

    The archive ``zipfile.ZipFile(buf, "w", ZIP_STORED).writestr(ZipInfo(name, date_time), data)``
    writes member by member (local headers, CRC-32s, central directory and end record; any zip
    reader, ``numpy.load`` included, reads it), without its per-member file object, seeks and
    header rewrite: a store of 2,000 tensors writes 32,000 members.  None where the plain format does not reach (a name that is
    not ASCII, more than 65,535 members, a member or archive near 2 GiB: zip64): zipfile then.
    """
    if len(members) > 0xFFFF:
        return None
    dos_date = (date_time[0] - 1980) << 9 | date_time[1] << 5 | date_time[2]
    dos_time = date_time[3] << 11 | date_time[4] << 5 | (date_time[5] // 2)
    parts: list[bytes] = []
    central: list[bytes] = []
    offset = 0
    for name, data in members:
        if not name.isascii() or len(data) * 1.05 > _ZIP_LIMIT or offset > _ZIP_LIMIT:
            return None
        raw_name, crc, size = name.encode("ascii"), zlib.crc32(data), len(data)
        parts += [_LOCAL.pack(b"PK\x03\x04", 20, 0, zipfile.ZIP_STORED, dos_time, dos_date, crc, size, size,
                              len(raw_name), 0), raw_name, data]
        central += [_CENTRAL.pack(b"PK\x01\x02", _CREATE_SYSTEM << 8 | 20, 20, 0, zipfile.ZIP_STORED, dos_time,
                                  dos_date, crc, size, size, len(raw_name), 0, 0, 0, 0, 0o600 << 16, offset),
                    raw_name]
        offset += _LOCAL.size + len(raw_name) + size
    directory = b"".join(central)
    if offset > _ZIP_LIMIT or len(directory) > _ZIP_LIMIT:
        return None
    end = _END.pack(b"PK\x05\x06", 0, 0, len(members), len(members), len(directory), offset, 0)
    return b"".join([*parts, directory, end])


def _npy_bytes(arr: np.ndarray, headers: dict[tuple[str, tuple[int, ...], bool], bytes]) -> bytes:
    """The ``.npy`` file of *arr* (as ``np.save`` writes it), its header memoised in *headers*."""
    fortran = bool(arr.flags.f_contiguous and not arr.flags.c_contiguous)
    key = (arr.dtype.str, arr.shape, fortran)
    if key not in headers:
        out = io.BytesIO()
        try:
            if arr.dtype.hasobject or arr.dtype.names is not None:
                raise ValueError("not a plain array")
            np.lib.format.write_array_header_1_0(out, np.lib.format.header_data_from_array_1_0(arr))
        except ValueError:       # anything unusual: NumPy's own writer, whole (and its refusals)
            out = io.BytesIO()
            np.lib.format.write_array(out, arr, allow_pickle=False)
            return out.getvalue()
        headers[key] = out.getvalue()
    return headers[key] + (arr.T.tobytes() if fortran else arr.tobytes())


def parse_series(raw: Any, where: str = "series") -> dict[str, np.ndarray]:
    """The series of one analysis from its stored ``.npz`` image (see :func:`pack_series`).

    The image must be what ``pack_series`` writes: a zip of uncompressed ``.npy``
    members (no pickle), ``__keys__`` a 1-D string array and ``s0``...``s{n-1}``
    one array per key, each holding the bytes its header declares - so neither
    a decompression bomb nor an inflated shape can make the reader allocate
    more than the store holds.
    """
    arr = np.asarray(raw)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise CorruptStoreError(f"{where}: must be a 1-D uint8 array (an .npz image); got {arr.dtype} {arr.shape}.")
    blob = bytearray(arr.tobytes())          # writable: the arrays returned are views into it, as np.load's are copies
    try:
        members = read_members(blob)
        keys = members.get("__keys__")
        if keys is None:
            raise KeyError("__keys__ is not a member of the archive")
        if keys.ndim != 1 or (keys.size and keys.dtype.kind != "U"):
            raise ValueError(f"__keys__ is a {keys.dtype} array of shape {keys.shape}, not a list of names")
        if len(members) != keys.size + 1 or set(members) != {"__keys__", *(f"s{i}" for i in range(keys.size))}:
            raise ValueError(f"members {sorted(members)[:8]} do not match the {keys.size} keys")
        return {k: members[f"s{i}"] for i, k in enumerate(keys.tolist())}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        why = repr(str(exc))            # one line, control characters escaped, shortened
        why = why if len(why) <= 120 else why[:120] + "..."
        raise CorruptStoreError(f"{where}: is not a series image gradforensics wrote ({type(exc).__name__}: "
                                f"{why}).") from exc


def read_members(blob: bytearray) -> dict[str, np.ndarray]:
    """Every member of the zip image *blob* as an array (a view into *blob*), by its name less ``.npy``.

    Raises
    ------
    ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile
        *blob* is not a zip, or a member is not a stored, intact, plain ``.npy`` array.
    """
    if blob[:4] not in NPZ_MAGIC:
        raise ValueError("not a zip archive")
    entries = _plain_directory(blob)
    if entries is None:                  # not the plain layout pack_series writes: zipfile's own reader
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            entries = [(i.filename, i.header_offset, i.file_size, i.CRC, i.compress_type) for i in zf.infolist()]
    parsed: dict[bytes, tuple[tuple[int, ...], bool, np.dtype[Any], int]] = {}
    octets = np.frombuffer(blob, dtype=np.uint8)
    view = memoryview(blob)          # slices of it copy nothing: a store of 2,000 tensors holds 32,000 series
    out: dict[str, np.ndarray] = {}
    for name, header_offset, file_size, crc, compress_type in entries:      # each member stored, present, intact
        if compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"member {name!r} is compressed; gradforensics stores series uncompressed")
        if header_offset < 0 or header_offset + _LOCAL.size > len(view) \
                or view[header_offset:header_offset + 4] != b"PK\x03\x04":
            raise ValueError(f"member {name!r} has no local header")
        n_name, n_extra = _LOCAL.unpack_from(view, header_offset)[-2:]
        start = header_offset + _LOCAL.size + n_name + n_extra
        data = view[start:start + file_size]
        if len(data) != file_size or zlib.crc32(data) != crc:
            raise ValueError(f"member {name!r} is truncated or fails its CRC-32")
        out[name[:-4] if name.endswith(".npy") else name] = _array(view, octets, start, start + file_size, name,
                                                                   parsed)
    return out


def _plain_directory(blob: bytearray) -> list[Entry] | None:
    """``(name, header offset, size, CRC-32, compression)`` of each member, read from the central
    directory of a zip laid out as :func:`pack_series` writes it, else None.

    The plain layout: one disk, no archive comment, no prepended data, no zip64, no extra
    fields or comments, ASCII names.  Anything else goes to :mod:`zipfile` (None here),
    so this is a shorter way through the same archives, not a more lenient one; every
    member is then checked by :func:`read_members` either way.  ``zipfile`` builds an
    object per member: 32,000 series cost a third of a second.
    """
    end = len(blob) - _END.size
    if end < 0 or blob[end:end + 4] != b"PK\x05\x06":
        return None
    _, disk, cd_disk, n_here, n, cd_size, cd_start, comment = _END.unpack_from(blob, end)
    if disk or cd_disk or n_here != n or comment or cd_start + cd_size != end:
        return None
    out, pos = [], cd_start
    for _ in range(n):
        if pos + _CENTRAL.size > end:
            return None
        sig, _, _, flags, method, _, _, crc, csize, size, n_name, n_extra, n_comment, _, _, _, offset = \
            _CENTRAL.unpack_from(blob, pos)
        if sig != b"PK\x01\x02" or n_extra or n_comment or flags & 0x1 or csize != size:
            return None
        raw = bytes(blob[pos + _CENTRAL.size:pos + _CENTRAL.size + n_name])
        if len(raw) != n_name or not raw.isascii():
            return None
        out.append((raw.decode("ascii"), offset, size, crc, method))
        pos += _CENTRAL.size + n_name
    return out if pos == end else None


def _array(view: memoryview, octets: np.ndarray, start: int, end: int, name: str,
           parsed: dict[bytes, tuple[tuple[int, ...], bool, np.dtype[Any], int]]) -> np.ndarray:
    """The ``.npy`` member at ``view[start:end]`` as a view of the image's bytes (its header parsed once per
    distinct header in *parsed*: a store's series share a few shapes)."""
    head = bytes(view[start:start + 12])
    if head[:6] != b"\x93NUMPY" or head[6:8] not in (b"\x01\x00", b"\x02\x00"):
        raise ValueError(f"member {name!r} has .npy version {tuple(head[6:8])}")
    size = 2 if head[6] == 1 else 4
    n_head = 8 + size + int.from_bytes(head[8:8 + size], "little")
    raw = bytes(view[start:start + n_head])
    if raw not in parsed:
        shape, fortran, dtype = _npy_header(raw, name)
        parsed[raw] = (shape, fortran, dtype, math.prod(shape))
    shape, fortran, dtype, count = parsed[raw]
    if count * dtype.itemsize > end - start - n_head or len(raw) != n_head:
        raise ValueError(f"member {name!r} declares shape {shape} of {dtype}, more than its {end - start} bytes")
    at = start + n_head
    if dtype.itemsize:                  # a view of the image's bytes: what frombuffer gives, at half its cost
        flat = octets[at:at + count * dtype.itemsize].view(dtype)
    else:
        flat = np.frombuffer(view, dtype=dtype, count=count, offset=at)
    if fortran:
        return flat.reshape(shape[::-1]).transpose()
    return flat.reshape(shape) if len(shape) != 1 else flat


def _npy_header(raw: bytes, name: str) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """``(shape, fortran_order, dtype)`` of a ``.npy`` header (NumPy's own parser)."""
    fp = io.BytesIO(raw)
    version = np.lib.format.read_magic(fp)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = reader(fp)
    if dtype.hasobject:
        raise ValueError(f"member {name!r} holds Python objects")
    return tuple(int(n) for n in shape), bool(fortran), dtype
