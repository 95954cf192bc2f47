"""Transparent huge pages for the pre-packed weights ONNX Runtime allocates (Linux; a no-op elsewhere).

A CPU decode step streams every weight once. ONNX Runtime's pre-packed copies live in ordinary anonymous
memory, which Linux maps in 4 KB pages unless asked otherwise (THP mode "madvise", the common default), so a
step of the fp32 SmolLM2 walks about 135,000 pages. `collapse_new` asks for huge pages (2 MB on x86-64) on the
memory a session open added (MADV_HUGEPAGE, then MADV_COLLAPSE to remap what is already there; Linux 6.1+, else
khugepaged does it over time). Measured on a 2-core AMD EPYC (tools/hugepages_ab.py; README, stop 40): the
target-only step 1.03-1.04x faster on the fp32 SmolLM2 and 1.04-1.05x on the Q4_1 one, a k = 4 verify 1.02-1.05x,
the int8 draft pass 1.00x, the int4 engine's step 1.01x.

What is advised: address ranges that no mapping covered before the open and that are now anonymous read-write
memory; memory that existed before (the heap below its old end, a mapping a new one merged into) is left as it
was, so a collapse never fills another component's sparse memory. Left on small pages, on purpose:
- the KV caches (`no_huge`, remembered here while their memory lives): in 2 MB pages the 4-bit engine's
  step ran 0.88-0.92x (measured), and a cache must stay resident only as far as its positions are written;
- thread stacks (a mapping right above a PROT_NONE guard) and mappings marked MADV_NOHUGEPAGE by anyone.
Another thread's allocations made during the open are advised too (a hint only: the contents never change).
MADV_COLLAPSE compacts memory synchronously: a sampling graph's session, opened at the first sampled request,
pauses that request for it. Any failure (no /proc, an old kernel) leaves the pages as they were.

SPECEXPORT_HUGEPAGES=0 turns it off.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
import threading
import weakref

MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_COLLAPSE = 14, 15, 25
THP = "/sys/kernel/mm/transparent_hugepage"

_LOCK = threading.RLock()  # re-entrant: a freed cache's finalizer can run (GC) while it is held
_SMALL: list[tuple[int, int]] = []  # ranges kept on small pages (the KV caches)
_LIBC = None

Maps = list[tuple[int, int]]


def enabled() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("SPECEXPORT_HUGEPAGES", "1") == "0":
        return False
    try:
        with open(f"{THP}/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _huge_size() -> int:
    try:
        with open(f"{THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def _madvise(start: int, length: int, advice: int) -> bool:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC.madvise(start, length, advice) == 0


def mappings() -> Maps:
    """The address ranges of this process's mappings (/proc/self/maps); [] where it cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            return [tuple(int(x, 16) for x in line.split(None, 1)[0].split("-")) for line in f]
    except (OSError, ValueError):
        return []


def _candidates() -> list[tuple[int, int]]:
    with open("/proc/self/smaps") as f:
        return parse_smaps(f)


def parse_smaps(lines) -> list[tuple[int, int]]:
    """Of /proc/self/smaps' lines: the anonymous read-write mappings that nobody marked MADV_NOHUGEPAGE and that
    are not thread stacks (right above a PROT_NONE guard)."""
    out, cur, guard_ends = [], None, set()
    for line in lines:
        head = line.split(None, 6)
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            perms, inode = head[1], head[4]
            name = head[5].strip() if len(head) > 5 else ""
            if perms.startswith("---"):
                guard_ends.add(hi)
            anon = inode == "0" and name in ("", "[heap]")
            cur = (lo, hi) if anon and perms.startswith("rw") and lo not in guard_ends else None
        elif cur is not None and head[0] == "VmFlags:":
            if "nh" not in line.split()[1:]:
                out.append(cur)
            cur = None
    return out


def no_huge(start: int, length: int, owner: object = None) -> None:
    """Keep [start, start + length) on small pages, whatever the system's THP mode (the KV caches). With an
    owner (the memory map under the range), the range is forgotten when the owner is freed: a later mapping may
    reuse the addresses, and it must not be kept small for a cache that is gone."""
    page = mmap.PAGESIZE
    lo, hi = start // page * page, -(-(start + length) // page) * page
    with _LOCK:
        _SMALL.append((lo, hi))
    if owner is not None:
        weakref.finalize(owner, _forget, (lo, hi))
    if enabled():
        _madvise(lo, hi - lo, MADV_NOHUGEPAGE)


def _forget(span: tuple[int, int]) -> None:
    with _LOCK:
        if span in _SMALL:
            _SMALL.remove(span)


def collapse_new(before: Maps) -> int:
    """Huge pages for the anonymous read-write memory added since `before` (a `mappings()` snapshot), less the
    ranges kept small. Returns the bytes advised (collapsed now where the kernel can, else by khugepaged)."""
    if not before:
        return 0
    huge = _huge_size()
    total = 0
    with _LOCK:
        try:
            before = sorted(before)
            starts = [a for a, _ in before]
            for lo, hi in _candidates():
                i = max(bisect.bisect_right(starts, lo) - 1, 0)
                j = bisect.bisect_left(starts, hi)
                cuts = [(a, b) for a, b in before[i:j] + _SMALL if a < hi and b > lo]
                for a, b in _minus((lo, hi), cuts):
                    a, b = -(-a // huge) * huge, b // huge * huge
                    if b - a >= huge and _madvise(a, b - a, MADV_HUGEPAGE):
                        _madvise(a, b - a, MADV_COLLAPSE)
                        total += b - a
        except (OSError, ValueError, IndexError):  # an unreadable or unexpected /proc: leave the rest as it is
            pass
    return total


def _minus(span: tuple[int, int], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """span less every cut, as sorted disjoint ranges."""
    parts = [span]
    for c0, c1 in cuts:
        parts = [p for a, b in parts for p in ((a, min(b, c0)), (max(a, c1), b)) if p[1] > p[0]]
    return parts
