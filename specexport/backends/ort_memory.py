"""Host memory for the onnxruntime backend: the weights file memory-mapped (nothing read until used), zeroed
caches over one anonymous map (resident as positions are written), and the one pre-packed weights container
that every live C API session shares."""

from __future__ import annotations

import json
import struct
import threading
import weakref
from pathlib import Path

import numpy as np

from . import hugepages, ort_capi


def mmap_safetensors(path: Path) -> dict[str, np.ndarray]:
    """name -> read-only array view into one memory map of the file (nothing is read until used)."""
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "F64": np.float64,
              "U8": np.uint8}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, m in header.items():
        if name == "__metadata__":
            continue
        a, b = m["data_offsets"]
        out[name] = mm[8 + n + a:8 + n + b].view(dtypes[m["dtype"]]).reshape(m["shape"])
    return out


def zeroed_host(shapes: list[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
    """Zeroed arrays over one anonymous memory map (page-aligned each): a page is resident only once written, so
    a cache costs the positions used, not max_seq_len (np.zeros can take heap memory it must clear: all of it
    resident), and the whole map goes back to the system when the last array over it goes (OrtEngine.share_kv)."""
    import mmap
    if not hasattr(mmap, "MAP_PRIVATE"):  # (Windows)
        return [np.zeros(shape, dtype) for shape in shapes]
    page = mmap.PAGESIZE
    sizes = [-(-int(np.prod(shape)) * np.dtype(dtype).itemsize // page) * page for shape in shapes]
    mm = mmap.mmap(-1, max(sum(sizes), page), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    hugepages.no_huge(np.frombuffer(mm, np.uint8).ctypes.data, len(mm), mm)  # small pages while it lives (hugepages.py)
    out, offset = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(np.frombuffer(mm, dtype, int(np.prod(shape)), offset).reshape(shape))
        offset += size
    return out


_CONTAINER = None  # a weak reference: the sessions own the container (ort_capi.Session keeps it)
_CONTAINER_LOCK = threading.Lock()


def container():
    """The pre-packed weights container that every live C API session shares: engines alive at once share one
    packed copy of each weight. It lives as long as a session made with it (each session holds it), so freeing
    the last engine frees the packed copies. Before stop 44 it lived as long as the process: after an fp32
    SmolLM2 decoder was freed, 0.8 GB stayed resident (and grew with each other engine loaded)."""
    global _CONTAINER
    with _CONTAINER_LOCK:
        c = _CONTAINER() if _CONTAINER is not None else None
        if c is None or c._h is None:  # (one being released in another thread: its weak reference still answers)
            c = ort_capi.PrepackedWeightsContainer()
            _CONTAINER = weakref.ref(c)
        return c
