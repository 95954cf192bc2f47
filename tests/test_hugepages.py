"""2 MB pages for the pre-packed weights (backends/hugepages.py): what is advised, what is left alone."""

import mmap
import os

import numpy as np
import pytest

from specexport.backends import hugepages

linux_thp = pytest.mark.skipif(not hugepages.enabled(), reason="needs Linux with transparent huge pages")


def _vma(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding addr."""
    fields, hit = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if hit:
                break
            hit = lo <= addr < hi
        elif hit:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_minus_cuts_ranges():
    assert hugepages._minus((0, 100), []) == [(0, 100)]
    assert hugepages._minus((0, 100), [(20, 30), (60, 200)]) == [(0, 20), (30, 60)]
    assert hugepages._minus((0, 100), [(0, 100)]) == []
    assert hugepages._minus((10, 20), [(30, 40)]) == [(10, 20)]


def test_off_switch(monkeypatch):
    monkeypatch.setenv("SPECEXPORT_HUGEPAGES", "0")
    assert not hugepages.enabled()


def test_only_memory_added_since_the_snapshot_is_advised(monkeypatch):
    M = 1 << 20
    advised = []
    monkeypatch.setattr(hugepages, "_huge_size", lambda: 2 * M)
    monkeypatch.setattr(hugepages, "_madvise", lambda a, n, how: advised.append((a // M, (a + n) // M, how)) or True)
    monkeypatch.setattr(hugepages, "_SMALL", [(40 * M, 44 * M)])  # a cache
    # a mapping that grew from [0, 16 MB) to [0, 64 MB) (the heap), and one that is new: [100, 107 MB)
    monkeypatch.setattr(hugepages, "_candidates", lambda: [(0, 64 * M), (100 * M, 107 * M)])
    assert hugepages.collapse_new([(0, 16 * M), (70 * M, 80 * M)]) == (24 + 20 + 6) * M
    huge = [(a, b) for a, b, how in advised if how == hugepages.MADV_HUGEPAGE]
    assert huge == [(16, 40), (44, 64), (100, 106)]
    assert hugepages.collapse_new([]) == 0  # no snapshot (no /proc): nothing


def test_smaps_candidates_skip_stacks_files_and_no_huge_mappings():
    smaps = """\
00400000-00500000 r-xp 00000000 08:01 123 /usr/bin/python3
00600000-00800000 rw-p 00000000 00:00 0 [heap]
VmFlags: rd wr mr mw me ac
7f0000000000-7f0000001000 ---p 00000000 00:00 0
VmFlags: mr mw me ac
7f0000001000-7f0000801000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac
7f0001000000-7f0002000000 rw-p 00000000 00:00 0
Rss: 4 kB
VmFlags: rd wr mr mw me nh ac
7f0003000000-7f0004000000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac
7f0005000000-7f0006000000 rw-s 00000000 00:05 77 /dev/shm/x
VmFlags: rd wr sh mr mw me ms
""".splitlines(True)
    assert hugepages.parse_smaps(smaps) == [(0x600000, 0x800000), (0x7F0003000000, 0x7F0004000000)]


@linux_thp
def test_new_memory_is_collapsed_and_old_memory_and_caches_are_not():
    size = 16 << 20
    old = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(old, np.uint8)[:1] = 1  # one resident page: collapsing it would make 2 MB resident
    before = hugepages.mappings()
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    a[::4096] = 1  # resident in 4 KB pages
    lo = a.ctypes.data
    hugepages.no_huge(lo + size - (6 << 20), 6 << 20, m)  # the last 6 MB: a cache (forgotten when m goes)
    assert hugepages.collapse_new(before) >= 8 << 20  # at least the 2 MB-aligned interior of the first 10 MB
    assert "hg" in _vma(lo + (4 << 20))["VmFlags"].split()
    assert "nh" in _vma(lo + size - (1 << 20))["VmFlags"].split()
    assert "hg" not in _vma(np.frombuffer(old, np.uint8).ctypes.data)["VmFlags"].split()
    if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) >= (6, 1):  # MADV_COLLAPSE
        assert int(_vma(lo + (4 << 20))["AnonHugePages"].split()[0]) > 0
    assert a[::4096].sum() == size // 4096  # the contents stay
    del a
    m.close()
    old.close()


@linux_thp
def test_engine_caches_stay_on_small_pages(engines):
    from specexport.runtime import SpeculativeDecoder
    dec = SpeculativeDecoder.load(engines["lookup"], max_batch=1, prepack=True)
    kv = dec.target._kv_np[0]
    assert "nh" in _vma(kv.ctypes.data)["VmFlags"].split()
    ids = dec.generate([5, 6, 7, 8, 9], 12, speculative=False)[0].token_ids
    assert ids == dec.generate([5, 6, 7, 8, 9], 12, k=3)[0].token_ids


def test_a_freed_cache_is_no_longer_kept_small():
    # a cache's range is kept small while its memory lives; once the last array over it goes, a new mapping may
    # take the same addresses, and it must be free to take 2 MB pages (stop 43: one full-suite run advised 0 bytes)
    from specexport.backends.ort_memory import zeroed_host
    k, v = zeroed_host([(2, 64, 8), (2, 64, 8)], np.float32)
    lo, hi = hugepages._SMALL[-1]
    assert lo <= k.ctypes.data and v.ctypes.data + v.nbytes <= hi
    del k
    assert (lo, hi) in hugepages._SMALL  # v still holds the map
    del v
    assert (lo, hi) not in hugepages._SMALL
