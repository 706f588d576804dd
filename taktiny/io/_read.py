"""Reading the tensors of a safetensors checkpoint into buffers Taktiny owns.

Reads go into page-aligned anonymous memory (``mmap``), filled with ``os.preadv`` and made
read-only: JAX's CPU client adopts such a buffer without copying it (it copies any buffer
not 64-byte aligned, as NumPy's are), and no caller can write through it afterwards.
4-bit tensors that Taktiny stored packed two per byte are presented as what they are (see
`quant/_format.py`): their 4-bit dtype and logical shape, unpacked as they are read.

Every read goes through the file's `Storage` (`_storage`: ranges of a named file). The
tensors of an opened checkpoint read through the files as they were opened (an `OpenFile`
each), not through their paths: a save that replaces or removes a file after
it was opened leaves its readers reading the old bytes (POSIX keeps an open file's bytes
until its last descriptor is closed).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _lazy
from ..arrays import numpy_dtype
from ..quant import packed_shape, unpack
from . import _checksum
from ._dtypes import CODES
from ._errors import SafetensorsError
from ._storage import Storage, open_storage

if TYPE_CHECKING:
    import numpy as np

    from ._object_store import Url
else:
    np = _lazy.module("numpy")  # (a header needs no NumPy: imported when a tensor is read)

MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_CHUNK = 1 << 30  # bytes per preadv call (Linux moves at most ~2 GiB per call)
_PIECE = 4 << 20  # bytes per read when each piece is hashed (or handed on to be) as it is read
_LONG_RUN = 1 << 20  # a block's runs at least this long are read straight into it
BOX_PIECE = 4 << 20  # bytes of rows read at a time when blocks are cut from the rows they span
_TRANSPOSED_ROWS = 12  # rows a transposed read permutes at a time (see read_transposed)


class _Way(NamedTuple):
    """How a set of blocks of a tensor is read (`Tensor._way`), decided from the header
    alone: the reads follow it, and `Tensor.bytes_read` counts what it reads."""

    box: list[tuple[int, int]]  # the smallest block holding them all
    by_rows: bool  # cut from the rows of `box`, a few MiB at a time
    hashed: bool  # read as the whole tensor in the file's order, hashed as it is read
    tiles: list[tuple[int, ...]] | None  # read through the digests of these tiles
    checked_first: bool  # the whole tensor streamed through its checksum first


class Tensor:
    """One tensor of a checkpoint, not yet read: ``name``, ``shape``, ``dtype`` (NumPy),
    ``nbytes``, the ``file`` holding it and its byte ``offset`` there.

    ``np.asarray(tensor)`` reads it (a read-only array of ``shape``); :meth:`read` reads
    the whole tensor or one block of it. A 4-bit tensor that Taktiny stored packed two per
    byte (:func:`~taktiny.io.save_safetensors`) has ``packed`` set: its ``dtype`` and
    ``shape`` are the 4-bit ones, its ``nbytes`` the bytes stored, and reads unpack it.

    ``checksum`` is the XXH3-128 digest of its stored bytes that Taktiny wrote into the
    header when it saved the file (32 hex digits), or None (files written by other
    programs). Reads verify it unless told not to (``verify=False``): damaged bytes raise
    :class:`SafetensorsError` before anything is returned. ``tiles`` is the grid of its
    tiles and their digests, concatenated (``((8, 8), "…")``: see `_checksum`), when Taktiny
    wrote them (tensors of 128 KiB or more); a read of part of the tensor then checks the
    tiles it touches and reads only their bytes, instead of the whole tensor's.

    Made by :func:`~taktiny.io.open_safetensors` from a file's header. Such a tensor holds
    its file open from then on and reads the bytes the file had when it was opened, even
    once a save has renamed another file over its path or removed it (on POSIX systems).

    Args:
        name: the tensor's name in the checkpoint.
        shape: its shape.
        dtype: its dtype: a NumPy dtype, or a safetensors code (``"BF16"``).
        file: the file holding its bytes.
        offset: where its bytes start in `file`.
        checksum: the XXH3-128 digest of its stored bytes, or None.

    Attributes:
        nbytes: the bytes stored in the file.
        tiles: ``(parts per axis, the tiles' digests concatenated)``, or None.
    """

    __slots__ = (
        "_dtype",
        "_held",
        "checksum",
        "file",
        "name",
        "nbytes",
        "offset",
        "shape",
        "tiles",
    )

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: Any,
        file: Path | Url,
        offset: int,
        checksum: str | None = None,
    ):
        if isinstance(dtype, str) and dtype in CODES:  # a header's code: made when asked for
            itemsize = CODES[dtype][1]
        else:
            dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
            itemsize = dtype.itemsize
        self.name, self.shape, self._dtype = name, shape, dtype
        self.file, self.offset, self.checksum = file, offset, checksum
        self.tiles: tuple[tuple[int, ...], str] | None = None
        self._held: Storage | None = None  # the file, opened (else opened at each read)
        self.nbytes = math.prod(shape) * itemsize

    @property
    def storage(self) -> Storage | None:
        """The storage its bytes are read through: its file as it was when the checkpoint
        was opened; None for a tensor made by hand, whose file is opened at each read."""
        return self._held

    @contextlib.contextmanager
    def _opened(self) -> Iterator[Storage]:
        """The storage to read from: the one held, else `file` opened for the read."""
        if self._held is not None:
            yield self._held
            return
        opened = open_storage(self.file)
        try:
            yield opened
        finally:
            opened.close()

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype (bfloat16 and float8 ones are ml_dtypes')."""
        if isinstance(self._dtype, str):
            self._dtype = numpy_dtype(CODES[self._dtype][0])
        return self._dtype

    @property
    def dtype_name(self) -> str:
        """NumPy's name of the dtype (``"bfloat16"``), known without making the dtype:
        listing a header imports nothing that reading a tensor needs."""
        return CODES[self._dtype][0] if isinstance(self._dtype, str) else self._dtype.name

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.shape)

    @property
    def packed(self) -> bool:
        """Whether the file stores this 4-bit tensor packed two per byte (as uint8)."""
        return False

    def read(self, index: Sequence[slice] | None = None, *, verify: bool = True) -> np.ndarray:
        """Reads the tensor, or one block of it, from disk into a fresh read-only aligned
        buffer; only the block's bytes are kept.

        Args:
            index: the block, one ``slice`` per axis with steps of 1; None for the whole
                tensor.
            verify: check the bytes against ``checksum`` (when there is one): for the
                whole tensor, hashed 4 MiB at a time as they are read (each piece still in
                the CPU's cache); for a block, the digests of the ``tiles`` it touches,
                hashed as they are read (only their bytes are read), or without tiles the
                whole tensor's bytes first, streamed through the hash.

        Returns:
            A read-only array of the block's shape (``shape`` for the whole tensor), in
            ``dtype``.

        Raises:
            ValueError: `index` is not one slice per axis with steps of 1.
            SafetensorsError: the bytes are damaged, or the file was truncated.
        """
        bounds = self._bounds(index)
        if all(b == (0, n) for b, n in zip(bounds, self.shape, strict=True)):
            return self._checked(None, verify)
        way = self._way([bounds], verify)  # (one block: read straight into its buffer)
        if way.tiles is not None:
            return self._from_tiles([bounds], way.tiles)[0]
        if way.checked_first:
            self.verify()
        shape = tuple(stop - start for start, stop in bounds)
        out, raw = _buffer(shape, self.dtype)
        return self._into(out, raw, bounds)

    def read_blocks(
        self, blocks: Sequence[Sequence[tuple[int, int]]], *, verify: bool = True
    ) -> list[np.ndarray]:
        """Reads several blocks of the tensor, each into a fresh read-only aligned buffer of
        its own, reading each byte they need once.

        Blocks whose bytes lie in long runs (an outer-axis split) are read straight into
        their buffers. Blocks of short runs (an inner-axis split: a few KiB of each row)
        that together tile the box they span are read as that box, a few MiB of rows at a
        time, into one reused buffer whose rows are copied into the blocks: sequential
        reads of only the bytes the blocks need.

        Args:
            blocks: disjoint blocks, each as ``(start, stop)`` per axis, within ``shape``.
            verify: check the bytes against ``checksum`` (when there is one): hashed as
                they are read when the blocks are read as the whole tensor in the file's
                order; otherwise against the digests of the ``tiles`` the blocks touch,
                reading only those tiles (:meth:`read`), or without tiles the whole
                tensor, streamed through the hash, first.

        Returns:
            One array per block, of the block's shape, in ``dtype``.

        Raises:
            SafetensorsError: the bytes are damaged, or the file was truncated.
        """
        way = self._way(blocks, verify)
        if way.tiles is not None:
            return self._from_tiles(blocks, way.tiles)
        if way.checked_first:
            self.verify()
        stream = _checksum.streaming() if way.hashed else None
        send = None if stream is None else stream.update
        if way.by_rows:
            outs = self._from_rows(blocks, way.box, send)
        elif send is not None:
            outs = self._in_order(blocks, send)
        else:
            outs = [self.read([slice(*x) for x in b], verify=False) for b in blocks]
        self._confirm(stream)
        return outs

    def bytes_read(
        self, blocks: Sequence[Sequence[tuple[int, int]]] | None = None, *, verify: bool = True
    ) -> int:
        """The bytes :meth:`read_blocks` (`blocks`) or a whole read (None) takes from the
        file, worked out from the header alone by the choice those reads follow (one
        function makes it for both): the whole tensor once when it streams through its
        checksum; the tiles the blocks touch; without tiles, the whole tensor through the
        hash first, then the blocks (their box when they are cut from its rows). For
        :func:`taktiny.io.plan_load`.

        Args:
            blocks: disjoint blocks, each as ``(start, stop)`` per axis; None: the whole
                tensor (:meth:`read`, :meth:`read_into`, :meth:`read_transposed`).
            verify: as the read is asked to.

        Returns:
            The bytes read, as ``os.preadv`` counts them.
        """
        if blocks is None or not self.nbytes:
            return self.nbytes
        way = self._way(blocks, verify)
        item = self.dtype.itemsize
        if way.tiles is not None:
            return len(way.tiles) * math.prod(self._tile_shape()) * item
        first = self.nbytes if way.checked_first else 0
        # (streamed through the checksum, the blocks tile the tensor: its bytes, once)
        read = [way.box] if way.by_rows else blocks
        return first + sum(math.prod(stop - start for start, stop in b) for b in read) * item

    def _way(self, blocks: Sequence[Sequence[tuple[int, int]]], verify: bool) -> _Way:
        """How :meth:`read_blocks` reads `blocks` (and :meth:`read` a block): the one choice
        that the reads follow and :meth:`bytes_read` counts. With `verify` and a checksum,
        blocks read as the whole tensor in the file's order are hashed as they are read;
        else, with tiles, read through the tiles they touch; else the whole tensor is
        checked first. Blocks with many short runs that tile their box are cut from its
        rows."""
        box = _box(blocks, self.ndim)
        by_rows = self._by_rows(blocks, box)
        if verify and self.checksum is not None and self._streams(blocks, box, by_rows):
            return _Way(box, by_rows, True, None, False)
        if verify and self.tiles is not None:
            return _Way(box, by_rows, False, self._touched(blocks), False)
        return _Way(box, by_rows, False, None, verify and self.checksum is not None)

    def _tile_shape(self) -> list[int]:
        """The shape of each of the ``tiles``."""
        assert self.tiles is not None
        return [n // p for n, p in zip(self.shape, self.tiles[0], strict=True)]

    def _touched(self, blocks: Sequence[Sequence[tuple[int, int]]]) -> list[tuple[int, ...]]:
        """The index of every tile that a block of `blocks` touches, in the file's order."""
        size = self._tile_shape()
        return sorted(
            {
                index
                for b in blocks
                if all(lo < hi for lo, hi in b)
                for index in itertools.product(
                    *(range(lo // s, -(-hi // s)) for (lo, hi), s in zip(b, size, strict=True))
                )
            }
        )

    def _from_rows(
        self,
        blocks: Sequence[Sequence[tuple[int, int]]],
        box: list[tuple[int, int]],
        send: Callable[[Any], Any] | None,
    ) -> list[np.ndarray]:
        """The blocks cut from their box's rows, read a few MiB at a time (:meth:`_rows`)."""
        outs = [_buffer(tuple(stop - start for start, stop in b), self.dtype)[0] for b in blocks]
        width = box[1:]
        for r0, r1, piece in self._rows(box, send):
            for out, b in zip(outs, blocks, strict=True):
                lo, hi = max(b[0][0], r0), min(b[0][1], r1)
                if lo < hi:
                    cut = [slice(s - w, e - w) for (s, e), (w, _) in zip(b[1:], width, strict=True)]
                    out[lo - b[0][0] : hi - b[0][0]] = piece[(slice(lo - r0, hi - r0), *cut)]
        for out in outs:
            out.flags.writeable = False
        return outs

    def _from_tiles(
        self, blocks: Sequence[Sequence[tuple[int, int]]], touched: list[tuple[int, ...]]
    ) -> list[np.ndarray]:
        """The blocks read through the digests of the tiles `touched` (those they touch,
        in the file's order; or all of them), reading only those tiles' bytes, in the
        file's order: the tiles next to each other along the last axis together, a few MiB
        of their rows at a time, each tile's bytes hashed as they come (from a copy when
        the rows span several tiles), then cut into the blocks. Raises before returning
        when a tile's bytes are not its digest's."""
        assert self.tiles is not None
        digests = self.tiles[1]
        size = self._tile_shape()
        outs = [_buffer(tuple(stop - start for start, stop in b), self.dtype)[0] for b in blocks]
        runs: list[list[tuple[int, ...]]] = []  # tiles side by side on the last axis
        for index in touched:
            if self.ndim > 1 and runs and runs[-1][-1][:-1] == index[:-1]:
                if runs[-1][-1][-1] + 1 == index[-1]:
                    runs[-1].append(index)
                    continue
            runs.append([index])
        boxes = []
        for run in runs:
            box = [(i * s, (i + 1) * s) for i, s in zip(run[0], size, strict=True)]
            box[-1] = (box[-1][0], box[-1][1] + (len(run) - 1) * size[-1])
            boxes.append(box)
        # one buffer for the pieces of every run (mapping fresh pages for each costs more
        # than the reads themselves from the page cache)
        memory = _buffer((max(map(self._piece_bytes, boxes), default=0),), np.dtype(np.uint8))[1]
        with self._opened() as storage:
            for run, box in zip(runs, boxes, strict=True):
                self._through_tiles(storage, run, box, size, digests, blocks, outs, memory)
        for out in outs:
            out.flags.writeable = False
        return outs

    def _piece_bytes(self, box: list[tuple[int, int]]) -> int:
        """The bytes of the pieces :meth:`_through_tiles` reads `box` in."""
        rows, row = self._piece(box)
        return rows * row

    def _piece(self, box: list[tuple[int, int]]) -> tuple[int, int]:
        """How `box` is read a few MiB at a time: the rows (along the first axis) of each
        piece, and the bytes of one row."""
        row = math.prod(stop - start for start, stop in box[1:]) * self.dtype.itemsize
        return max(1, min(box[0][1] - box[0][0], BOX_PIECE // max(row, 1))), row

    def _through_tiles(
        self,
        storage: Storage,
        run: list[tuple[int, ...]],
        box: list[tuple[int, int]],
        size: list[int],
        digests: str,
        blocks: Sequence[Sequence[tuple[int, int]]],
        outs: list[np.ndarray],
        memory: memoryview,
    ) -> None:
        """Reads `box`, the tiles of `run`, a few MiB of rows at a time into `memory`:
        hashes each tile's part of the rows, copies what falls in each block into its out,
        and checks each tile's digest."""
        assert self.tiles is not None
        (first, last), width = box[0], box[1:]
        rows = self._piece(box)[0]
        shape = (rows, *(stop - start for start, stop in width))
        raw = memory[: math.prod(shape) * self.dtype.itemsize]
        chunk = np.frombuffer(raw, self.dtype, math.prod(shape)).reshape(shape)
        hashes = [_checksum.streaming() for _ in run]
        for r0 in range(first, last, rows):
            r1 = min(r0 + rows, last)
            piece = chunk[: r1 - r0]
            self._fill(storage, [(r0, r1), *width], piece.shape, raw)
            if len(run) == 1:
                hashes[0].update(piece)
            else:
                for k, h in enumerate(hashes):
                    h.update(np.ascontiguousarray(piece[..., k * size[-1] : (k + 1) * size[-1]]))
            for out, b in zip(outs, blocks, strict=True):
                cut = [(max(lo, s), min(hi, e)) for (lo, hi), (s, e) in zip(b, box, strict=True)]
                cut[0] = (max(cut[0][0], r0), min(cut[0][1], r1))
                if all(lo < hi for lo, hi in cut):
                    into = tuple(
                        slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(cut, b, strict=True)
                    )
                    at = [(r0, r1), *width]
                    src = tuple(
                        slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(cut, at, strict=True)
                    )
                    out[into] = piece[src]
        for index, h in zip(run, hashes, strict=True):
            k = int(np.ravel_multi_index(index, self.tiles[0]))
            if (got := h.hexdigest()) != digests[32 * k : 32 * k + 32]:
                tile = [(i * s, (i + 1) * s) for i, s in zip(index, size, strict=True)]
                raise self.damaged(got, tile, digests[32 * k : 32 * k + 32])

    def read_transposed(
        self, perm: Sequence[int] | None = None, *, verify: bool = True, out: Any = None
    ) -> np.ndarray:
        """Reads the tensor with its axes permuted, into a fresh read-only aligned buffer: a
        few MiB of rows at a time, each piece permuted into place as it is read, so the
        only memory besides the result is one piece (not a second copy of the tensor).

        Args:
            perm: the new order of the axes, as ``numpy.transpose`` takes it; None reverses
                them.
            verify: check the bytes against ``checksum`` (when there is one), hashed as
                they are read.
            out: a writable C-contiguous array of the permuted shape and ``dtype`` to read
                into (a slice of a larger buffer the caller owns), instead of a fresh one.

        Returns:
            ``numpy.transpose`` of the tensor by `perm`, in ``dtype`` (`out` itself, when
            given, left writable).

        Raises:
            ValueError: `out` is not a writable C-contiguous array of the permuted
                shape and ``dtype``.
            SafetensorsError: the bytes are damaged, or the file was truncated.
        """
        order = (
            tuple(range(self.ndim))[::-1] if perm is None else tuple(p % self.ndim for p in perm)
        )
        given = out
        if given is not None:
            _check_out(given, tuple(self.shape[k] for k in order), self.dtype)
            if self.ndim < 2 or self.packed:
                given[...] = np.transpose(self.read(verify=verify), order)
                return given
        if self.ndim < 2:  # nothing to permute
            return self.read(verify=verify)
        if self.packed:
            out = _copied(np.transpose(self.read(verify=verify), order))
            out.flags.writeable = False
            return out
        stream = _checksum.streaming() if verify and self.checksum is not None else None
        if given is None:
            out = _buffer(tuple(self.shape[k] for k in order), self.dtype)[0]
        into = order.index(0)  # where the rows of the tensor go
        # a dozen rows at a time: whole pieces at once run at 0.6x of a plain copy. Rows
        # a power of two bytes apart share the cache's sets; a dozen fit their ways, where
        # 64 one-byte rows (one cache line written a run) evict each other: a 4096 x 4096
        # float8 tensor took 48 ms in runs of 64 rows and takes 15 ms in runs of 12 (NumPy
        # on this machine; bfloat16 54 ms and 27, by 32 rows and 12)
        step = _TRANSPOSED_ROWS
        at: list[slice] = [slice(None)] * self.ndim
        for r0, r1, piece in self._rows([(0, n) for n in self.shape], stream and stream.update):
            for a in range(0, r1 - r0, step):
                at[into] = slice(r0 + a, min(r0 + a + step, r1))
                out[tuple(at)] = piece[a : a + step].transpose(order)
        self._confirm(stream)
        if given is None:
            out.flags.writeable = False
        return out

    def _rows(
        self, box: list[tuple[int, int]], send: Callable[[Any], Any] | None
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """The rows (along the first axis) of the block `box`, read a few MiB at a time
        into one buffer: ``(first row, stop row, the piece)`` for each, the buffer read into
        again once the caller asks for the next. When the box is the whole tensor, each
        piece's bytes are handed to `send` as they are read."""
        (first, last), width = box[0], box[1:]
        rows, row = self._piece(box)
        chunk, raw = _buffer((rows, *(stop - start for start, stop in width)), self.dtype)
        whole = box == [(0, n) for n in self.shape]
        with self._opened() as storage:
            for r0 in range(first, last, rows):
                r1 = min(r0 + rows, last)
                piece = chunk[: r1 - r0]
                if whole:  # the rows are one run of the file
                    _pread(storage, raw[: (r1 - r0) * row], self.offset + r0 * row, self, send)
                else:
                    self._fill(storage, [(r0, r1), *width], piece.shape, raw)
                yield r0, r1, piece

    def _streams(
        self, blocks: Sequence[Sequence[tuple[int, int]]], box: list[tuple[int, int]], by_rows: bool
    ) -> bool:
        """Whether :meth:`read_blocks` reads these blocks as the whole tensor in the file's
        order, so that it can hash the bytes as it reads them: blocks that tile the tensor,
        cut from its rows (`by_rows`) or each one run of its bytes (an outer-axis split)."""
        if box != [(0, n) for n in self.shape]:
            return False
        sizes = [math.prod(stop - start for start, stop in b) for b in blocks]
        item = self.dtype.itemsize
        runs = all(self._run(b) == n * item for b, n in zip(blocks, sizes, strict=True))
        return by_rows or (runs and sum(sizes) == math.prod(self.shape))

    def _in_order(
        self, blocks: Sequence[Sequence[tuple[int, int]]], send: Callable[[Any], Any]
    ) -> list[np.ndarray]:
        """Blocks that are each one run of the tensor's bytes and together all of them, read
        in the file's order, their bytes handed to `send` as they are read."""
        strides = [math.prod(self.shape[i + 1 :]) * self.dtype.itemsize for i in range(self.ndim)]
        starts = [sum(b[i][0] * strides[i] for i in range(self.ndim)) for b in blocks]
        outs: list[np.ndarray] = [np.empty(0)] * len(blocks)
        with self._opened() as storage:
            for k in sorted(range(len(blocks)), key=starts.__getitem__):
                out, raw = _buffer(tuple(stop - start for start, stop in blocks[k]), self.dtype)
                _pread(storage, raw, self.offset + starts[k], self, send)
                out.flags.writeable = False
                outs[k] = out
        return outs

    def _by_rows(
        self, blocks: Sequence[Sequence[tuple[int, int]]], box: list[tuple[int, int]]
    ) -> bool:
        """Whether blocks are cut from their box's rows: some are many short runs of the
        file, and together they tile the box (so no byte outside them is read)."""
        sizes = [math.prod(stop - start for start, stop in b) for b in blocks]
        item = self.dtype.itemsize
        short = [_LONG_RUN > self._run(b) < n * item for b, n in zip(blocks, sizes, strict=True)]
        if self.ndim < 2 or not any(short):
            return False
        return sum(sizes) == math.prod(stop - start for start, stop in box)

    def _run(self, bounds: Sequence[tuple[int, int]]) -> int:
        """The bytes of each contiguous run of a block: its extent from its last partial
        axis on (the whole block when only the first axis is partial)."""
        partial = max(
            (i for i, (b, n) in enumerate(zip(bounds, self.shape, strict=True)) if b != (0, n)),
            default=0,
        )
        return math.prod(stop - start for start, stop in bounds[partial:]) * self.dtype.itemsize

    def read_into(self, memory: Any, *, verify: bool = True) -> np.ndarray:
        """Reads the whole tensor into the start of `memory`.

        The caller owns `memory`, and must not reuse it while anything still uses the
        array (JAX on CPU may adopt it).

        Args:
            memory: a writable buffer of at least ``nbytes``.
            verify: check the bytes against ``checksum`` (when there is one).

        Returns:
            A read-only array of ``shape`` and ``dtype`` viewing `memory`.

        Raises:
            SafetensorsError: the bytes are damaged, or the file was truncated.
        """
        return self._checked(memory, verify)

    def read_rows(
        self, rows: int, into: Callable[[int], Any], *, verify: bool = True
    ) -> Iterator[np.ndarray]:
        """Reads the whole tensor `rows` rows (along its first axis) at a time, each piece
        into the memory `into(nbytes)` gives it (the caller's, reused once the caller is
        done with the piece), and yields the pieces in order, each a read-only array of
        its rows viewing that memory (a 0-d tensor: one piece, itself). With `verify`, the
        bytes are hashed in order as they are read and checked after the last piece: a
        damaged tensor raises before the iteration ends, so a caller keeps nothing of
        the pieces until it has ended.

        Args:
            rows: the rows of each piece (the last one may have fewer), at least 1.
            into: gives the writable memory for a piece of `nbytes` bytes.
            verify: check the bytes against ``checksum`` (when there is one).

        Returns:
            An iterator of the pieces, in order: each a read-only array of `rows` rows
            (the last of the rest) and the tensor's other axes, in the memory `into` gave.

        Raises:
            ValueError: a packed tensor (read it with :meth:`read`), or `rows` below 1.
            SafetensorsError: the bytes are damaged, or the file was truncated.
        """
        if self.packed or rows < 1:
            raise ValueError(
                f"Tensor.read_rows of {self.name!r}: reads a tensor stored as it is (not a "
                f"packed 4-bit one), at least one row at a time; got rows={rows}"
            )
        stream = _checksum.streaming() if verify and self.checksum is not None else None
        count = self.shape[0] if self.ndim else 1
        row = self.nbytes // count if count else 0
        with self._opened() as storage:
            for r0 in range(0, count, rows):
                r1 = min(r0 + rows, count)
                raw = memoryview(into((r1 - r0) * row)).cast("B")[: (r1 - r0) * row]
                if len(raw):
                    _pread(storage, raw, self.offset + r0 * row, self, stream and stream.update)
                shape = (r1 - r0, *self.shape[1:]) if self.ndim else ()
                piece = np.frombuffer(raw, self.dtype, math.prod(shape)).reshape(shape)
                piece.flags.writeable = False
                yield piece
        self._confirm(stream)

    def mapped(self) -> np.ndarray | None:
        """The tensor's stored bytes, not read but mapped: a read-only array of ``shape``
        and ``dtype`` over the file's own pages (those the page cache holds, or faulted
        in as they are touched), with no copy made and no memory of the process's own
        taken. Not verified: check it with :meth:`check`. A mapped file must not be cut
        short in place while the array lives (reading a page past its new end stops the
        process, as it does every reader of a mapping); Taktiny's saves replace a file
        whole, which leaves the mapping reading the old one.

        Returns:
            The array, or None where there is nothing to map: a tensor in object
            storage, one stored packed (4-bit), one of no bytes.

        Raises:
            SafetensorsError: the file ends before the tensor does.
        """
        if self.packed or not self.nbytes:
            return None
        with self._opened() as storage:
            try:
                raw = storage.mapped(self.offset, self.nbytes)
            except ValueError:  # (beyond the file's end)
                raise _truncated(self) from None
        if raw is None:
            return None
        return np.frombuffer(raw, self.dtype, math.prod(self.shape)).reshape(self.shape)

    def _checked(self, memory: Any, verify: bool) -> np.ndarray:
        """The whole tensor read (into `memory`, or a fresh buffer), with `verify` hashed
        piece by piece as it is read and checked."""
        if not verify or self.checksum is None:
            return self._piecewise(None, memory)
        stream = _checksum.streaming()
        out = self._piecewise(stream.update, memory)
        self._confirm(stream)
        return out

    def _confirm(self, stream: Any) -> None:
        """Raises when the bytes hashed into `stream` are not ``checksum``'s (None: none were
        hashed, nothing to check)."""
        if stream is not None and (got := stream.hexdigest()) != self.checksum:
            raise self.damaged(got)

    def check(self, raw: Any) -> None:
        """Checks bytes read against ``checksum``; does nothing without one.

        Args:
            raw: this tensor's stored bytes, as read.

        Raises:
            SafetensorsError: `raw` does not match ``checksum``.
        """
        if self.checksum is not None:
            got = _checksum.digest(raw)
            if got != self.checksum:
                raise self.damaged(got)

    def verify(self) -> None:
        """Reads this tensor's stored bytes through the hash, 4 MiB at a time, and checks
        them against ``checksum``, then against the digests of its ``tiles``; does nothing
        without them.

        Raises:
            SafetensorsError: the bytes do not match ``checksum`` or a tile's digest, or
                the file was truncated.
        """
        if self.checksum is not None:
            self._whole_checked()
        if self.tiles is not None:  # a second pass, from the page cache: what a host
            every = list(itertools.product(*map(range, self.tiles[0])))  # reading part of
            self._from_tiles([], every)  # the tensor will check

    def _whole_checked(self) -> None:
        """Reads the stored bytes through the hash and checks them against ``checksum``."""
        stream = _checksum.streaming()
        piece = memoryview(bytearray(min(self.nbytes, _PIECE)))
        with self._opened() as storage:
            for at in range(0, self.nbytes, _PIECE):
                part = piece[: min(_PIECE, self.nbytes - at)]
                _pread(storage, part, self.offset + at, self)
                stream.update(part)
        got = stream.hexdigest()
        if got != self.checksum:
            raise self.damaged(got)

    def damaged(
        self, got: str, tile: Sequence[tuple[int, int]] | None = None, expected: str | None = None
    ) -> SafetensorsError:
        """The error for bytes whose checksum is not the one the header records.

        Args:
            got: the checksum of the bytes read (32 hex digits).
            tile: the tile whose bytes were hashed, as (start, stop) per axis; None for
                the whole tensor.
            expected: the tile's digest (with `tile`; else ``checksum``).

        Returns:
            The error, naming the file, the tensor (and tile) and both checksums.
        """
        which = "their checksum"
        if tile is not None:
            which = f"the checksum of its tile [{', '.join(f'{a}:{b}' for a, b in tile)}]"
        return SafetensorsError(
            f"{self.file}: the bytes of {self.name!r} are damaged: {which} is {got}, and the "
            f"header records {expected or self.checksum} ({_checksum.ALGORITHM}). The file "
            f"changed after it was written (a bad disk, an interrupted copy); copy it again "
            f"or write it again."
        )

    def _bounds(self, index: Sequence[slice] | None) -> list[tuple[int, int]]:
        """`index` as (start, stop) per axis, checked: one slice per axis, steps of 1."""
        if index is None:
            return [(0, n) for n in self.shape]
        index = tuple(index)
        if len(index) != self.ndim or not all(isinstance(s, slice) for s in index):
            raise ValueError(
                f"Tensor.read of {self.name!r} (shape {list(self.shape)}): the index must be "
                f"one slice per axis ({self.ndim}), got {index!r}"
            )
        bounds = []
        for s, n in zip(index, self.shape, strict=True):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(
                    f"Tensor.read of {self.name!r} (shape {list(self.shape)}): reads take "
                    f"contiguous blocks, slices with a step of 1, got {s!r}; read the block "
                    f"and slice the array it returns (array[::{step}])"
                )
            bounds.append((start, max(start, stop)))
        return bounds

    def _piecewise(self, send: Callable[[Any], Any] | None, memory: Any = None) -> np.ndarray:
        """The whole tensor read, into `memory` (as :meth:`read_into`) or a fresh buffer;
        with `send`, 4 MiB at a time, each piece of its stored bytes handed to `send` as
        soon as it is read, in order, still in the CPU's cache. Nothing is verified here."""
        if memory is None:
            out, raw = _buffer(self.shape, self.dtype)
        else:
            out = np.frombuffer(memory, self.dtype, math.prod(self.shape)).reshape(self.shape)
            raw = memoryview(memory).cast("B")[: self.nbytes]
        if self.nbytes:
            with self._opened() as storage:
                _pread(storage, raw, self.offset, self, send)
        out.flags.writeable = False
        return out

    def _into(self, out: np.ndarray, raw: Any, bounds: list[tuple[int, int]]) -> np.ndarray:
        if out.size:
            with self._opened() as storage:
                self._fill(storage, bounds, out.shape, raw)
        out.flags.writeable = False
        return out

    def _fill(
        self, storage: Storage, bounds: list[tuple[int, int]], shape: tuple[int, ...], to: Any
    ) -> None:
        # row-major: the axes after the last partial one are whole, so each run of the
        # block covers those axes and the partial one; runs repeat over the axes before it
        partial = max(
            (i for i, (b, n) in enumerate(zip(bounds, self.shape, strict=True)) if b != (0, n)),
            default=0,
        )
        item = self.dtype.itemsize
        strides = [math.prod(self.shape[i + 1 :]) * item for i in range(self.ndim)] or [item]
        run = math.prod(shape[partial:]) * item
        first = self.offset + sum(b[0] * s for b, s in zip(bounds, strides, strict=False))
        offsets = [first]
        if partial:
            steps = np.indices(shape[:partial], np.int64).reshape(partial, -1).T
            offsets = (first + steps @ np.array(strides[:partial], np.int64)).tolist()
        for k, at in enumerate(offsets):
            _pread(storage, to[k * run : (k + 1) * run], at, self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        packed = ", packed" if self.packed else ""
        return (
            f"Tensor({self.name!r}, {self.dtype_name}{list(self.shape)}{packed}, {self.file.name})"
        )


class Packed(Tensor):
    """A 4-bit tensor stored packed two per byte along its last axis (see `quant/_format.py`)."""

    __slots__ = ("stored",)

    def __init__(
        self, name: str, shape: tuple[int, ...], dtype: Any, file: Path | Url, offset: int
    ):
        super().__init__(name, shape, dtype, file, offset)
        self.stored = Tensor(name, packed_shape(shape), np.uint8, file, offset)  # the bytes
        self.nbytes = self.stored.nbytes

    @property
    def packed(self) -> bool:
        return True

    def check(self, raw: Any) -> None:
        self.stored.check(raw)

    def verify(self) -> None:
        self.stored.verify()

    def read(self, index: Sequence[slice] | None = None, *, verify: bool = True) -> np.ndarray:
        bounds = self._bounds(index)
        if not bounds:  # 0-d: one byte
            return unpack(self.stored.read(verify=verify), self.dtype, 0, 1).reshape(())
        stored, skip = self._stored_block(bounds)
        raw = self.stored.read([slice(*b) for b in stored], verify=verify)
        return unpack(raw, self.dtype, skip, skip + bounds[-1][1] - bounds[-1][0])

    def _stored_block(self, bounds: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
        """The block of the stored bytes holding the block `bounds` (its rows, and the
        bytes holding its columns, a half byte at each end included), and the elements
        to skip at the start of each row once they are unpacked."""
        start, stop = bounds[-1]
        first = start - start % 2
        return [*bounds[:-1], (first // 2, (stop + 1) // 2)], start - first

    def _checked_first(self, verify: bool) -> bool:
        """Whether :meth:`read_blocks` checks the stored bytes whole before reading the
        blocks (with `verify`, when they have no tiles to check the blocks' bytes by)."""
        return verify and self.stored.tiles is None

    def read_into(self, memory: Any, *, verify: bool = True) -> np.ndarray:
        return self._unpacked(self.stored.read_into(memory, verify=verify))

    def _piecewise(self, send: Callable[[Any], Any] | None, memory: Any = None) -> np.ndarray:
        return self._unpacked(self.stored._piecewise(send, memory))

    def read_blocks(
        self, blocks: Sequence[Sequence[tuple[int, int]]], *, verify: bool = True
    ) -> list[np.ndarray]:
        if self._checked_first(verify):
            self.verify()  # then each block read (and unpacked) on its own
            verify = False
        return [self.read([slice(*x) for x in b], verify=verify) for b in blocks]

    def bytes_read(
        self, blocks: Sequence[Sequence[tuple[int, int]]] | None = None, *, verify: bool = True
    ) -> int:
        if blocks is None or not self.nbytes:
            return self.nbytes
        total = 0
        if self._checked_first(verify):
            total, verify = (self.nbytes if self.stored.checksum is not None else 0), False
        for b in blocks:  # as read() reads each: its block of the stored bytes
            stored = [self._stored_block(b)[0]] if b else None
            total += self.stored.bytes_read(stored, verify=verify)
        return total

    def _unpacked(self, raw: np.ndarray) -> np.ndarray:
        if not self.shape:
            return unpack(raw, self.dtype, 0, 1).reshape(())
        return unpack(raw, self.dtype, 0, self.shape[-1])


def read_together(tensors: Sequence[Tensor], *, verify: bool = True) -> list[np.ndarray]:
    """Reads small tensors into one fresh read-only aligned buffer, each at a multiple of
    64 bytes: the tensors that lie next to each other in one file are read by one read
    (into a staging buffer, from which each is copied into place). For tensors of a few
    KiB, whose reads one by one would each cost a mapping and several calls for a few
    bytes.

    Args:
        tensors: unpacked tensors, best in the order of their bytes.
        verify: check each tensor's bytes against its ``checksum`` (when it has one).

    Returns:
        One read-only array per tensor, of its shape and dtype.

    Raises:
        SafetensorsError: a tensor's bytes are damaged, or the file was truncated (naming
            the tensor).
    """
    slots = [-(-t.nbytes // 64) * 64 for t in tensors]
    memory = _buffer((sum(slots),), np.dtype(np.uint8))[1]
    runs: list[list[Tensor]] = []  # tensors each starting where the one before ends
    for t in tensors:
        last = runs[-1][-1] if runs else None
        if last is not None and (last.file, last._held, last.offset + last.nbytes) == (
            t.file,
            t._held,
            t.offset,
        ):
            runs[-1].append(t)
        else:
            runs.append([t])
    longest = max((r[-1].offset + r[-1].nbytes - r[0].offset for r in runs), default=0)
    staging = memoryview(bytearray(longest))
    outs, at, sizes = [], 0, iter(slots)
    for run in runs:
        start = run[0].offset
        raw = staging[: run[-1].offset + run[-1].nbytes - start]
        try:
            with run[0]._opened() as storage:
                _pread(storage, raw, start, run[0])
        except SafetensorsError:  # truncated: the tensor it ends inside, named
            for t in run:
                t.read(verify=False)
            raise
        for t in run:
            bytes_ = raw[t.offset - start : t.offset - start + t.nbytes]
            if verify:
                t.check(bytes_)
            memory[at : at + t.nbytes] = bytes_
            out = np.frombuffer(memory, t.dtype, math.prod(t.shape), at).reshape(t.shape)
            out.flags.writeable = False
            outs.append(out)
            at += next(sizes)
    return outs


def _buffer(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, memoryview]:
    """A zeroed array in fresh page-aligned anonymous memory, and its bytes. The pages are
    mapped up front (``MAP_POPULATE``: one call instead of a page fault per 4 KiB)."""
    size = math.prod(shape) * dtype.itemsize
    memory = mmap.mmap(-1, size, flags=MAP_FLAGS) if size else bytearray()
    return np.frombuffer(memory, dtype, math.prod(shape)).reshape(shape), memoryview(memory)


def aligned_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable zeroed array in fresh page-aligned anonymous memory (which JAX adopts on
    CPU without a copy), its pages mapped up front."""
    return _buffer(shape, dtype)[0]


def _check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if not (
        isinstance(out, np.ndarray)
        and out.shape == shape
        and out.dtype == dtype
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        got = f"{getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', ()))}"
        raise ValueError(
            f"out must be a writable C-contiguous {dtype.name}{list(shape)} NumPy array; got {got}."
        )


def _copied(array: np.ndarray) -> np.ndarray:
    """`array` copied into a fresh aligned buffer of its own (see `_buffer`)."""
    out = _buffer(array.shape, array.dtype)[0]
    out[...] = array
    return out


def _box(blocks: Sequence[Sequence[tuple[int, int]]], ndim: int) -> list[tuple[int, int]]:
    """The smallest block holding all of `blocks`, as (start, stop) per axis."""
    return [(min(b[i][0] for b in blocks), max(b[i][1] for b in blocks)) for i in range(ndim)]


def _pread(
    storage: Storage,
    into: memoryview,
    offset: int,
    tensor: Tensor,
    send: Callable[[Any], Any] | None = None,
) -> None:
    """Fills `into` from `storage` at `offset`; with `send`, 4 MiB at a time, each piece
    handed to `send` once it is read."""
    piece = _CHUNK if send is None else _PIECE
    if storage.large_reads and send is not None:  # one request for it all (in parts), then
        _pread(storage, into, offset, tensor)  # each piece hashed in turn
        for start in range(0, len(into), piece):
            send(into[start : start + piece])
        return
    for start in range(0, len(into), piece):
        end, done = min(start + piece, len(into)), start
        while done < end:
            got = storage.read_into(offset + done, into[done:end])
            if got == 0:
                raise _truncated(tensor)
            done += got
        if send is not None:
            send(into[start:end])


def _truncated(tensor: Tensor) -> SafetensorsError:
    """The error of a file that ends inside `tensor`'s bytes."""
    return SafetensorsError(
        f"{tensor.file}: the file ends inside the bytes of {tensor.name!r}; it was truncated "
        f"after it was opened. Write it again."
    )
