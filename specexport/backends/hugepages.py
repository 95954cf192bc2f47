"""Transparent huge pages for the pre-packed weights ONNX Runtime allocates (Linux; a no-op elsewhere).

A CPU decode step streams every weight once. ONNX Runtime's pre-packed copies live in ordinary anonymous
memory, which Linux maps in 4 KB pages unless asked otherwise (THP mode "madvise", the common default), so a
step of the fp32 SmolLM2 walks about 135,000 pages. `collapse_new` asks for 2 MB pages on the memory a session
open allocated (MADV_HUGEPAGE, then MADV_COLLAPSE to remap what is already there; Linux 6.1+, else khugepaged
does it over time). Measured on a 2-core AMD EPYC (tools/hugepages_ab.py; README, stop 40): the target-only step
1.03x faster on the fp32 SmolLM2 and 1.04x on the Q4_1 one, a k = 4 verify 1.02-1.04x, the int8 draft pass
1.00-1.02x, the int4 engine's step 1.01x.

Left on 4 KB pages, on purpose:
- the KV caches (`no_huge`): in 2 MB pages the 4-bit engine's step ran 0.88-0.92x (measured), and a cache must stay
  resident only as far as its positions are written;
- thread stacks (a mapping right above a PROT_NONE guard) and anything the session open did not create or grow.

SPECEXPORT_HUGEPAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_COLLAPSE = 14, 15, 25
HUGE = 2 << 20

Maps = dict[int, tuple[int, str, bool]]  # start -> (end, perms, anonymous)


def enabled() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("SPECEXPORT_HUGEPAGES", "1") == "0":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


_LIBC = None


def _madvise(start: int, length: int, advice: int) -> bool:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC.madvise(start, length, advice) == 0


def mappings() -> Maps:
    """This process's memory mappings (/proc/self/maps)."""
    out: Maps = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            anon = fields[4] == "0" and (len(fields) == 5 or fields[5] == "[heap]")
            out[lo] = (hi, fields[1], anon)
    return out


def no_huge(start: int, length: int) -> None:
    """Keep [start, start + length) on 4 KB pages, whatever the system's THP mode (the KV caches)."""
    if enabled():
        lo, hi = _aligned(start, start + length, 4096)
        if hi > lo:
            _madvise(lo, hi - lo, MADV_NOHUGEPAGE)


def _aligned(lo: int, hi: int, to: int) -> tuple[int, int]:
    return -(-lo // to) * to, hi // to * to


def collapse_new(before: Maps, keep_out: list[tuple[int, int]]) -> int:
    """2 MB pages for the anonymous read-write memory that appeared or grew since `before` (a `mappings()`
    snapshot), except the ranges in keep_out and thread stacks. Returns the bytes advised."""
    now = mappings()
    ends = {hi: perms for hi, perms, _ in now.values()}
    total = 0
    for lo, (hi, perms, anon) in now.items():
        if not anon or perms[:2] != "rw" or before.get(lo, (None,))[0] == hi:
            continue
        if ends.get(lo, "").startswith("---"):  # right above a guard page: a thread's stack
            continue
        for a, b in _minus((lo, hi), keep_out):
            a, b = _aligned(a, b, HUGE)
            if b - a >= HUGE and _madvise(a, b - a, MADV_HUGEPAGE):
                _madvise(a, b - a, MADV_COLLAPSE)  # (fails before Linux 6.1: then khugepaged, in time)
                total += b - a
    return total


def _minus(span: tuple[int, int], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """span less every cut, as sorted disjoint ranges."""
    parts = [span]
    for c0, c1 in cuts:
        parts = [p for a, b in parts for p in ((a, min(b, c0)), (max(a, c1), b)) if p[1] > p[0]]
    return parts
