"""2 MB pages for the pre-packed weights (backends/hugepages.py): what is advised, what is left alone."""

import mmap
import sys

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


@linux_thp
def test_new_memory_is_advised_and_kept_out_ranges_are_not():
    before = hugepages.mappings()
    size = 16 << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    a[::4096] = 1  # resident in 4 KB pages
    lo = a.ctypes.data
    keep = (lo + size - (6 << 20), lo + size)  # the last 6 MB: say, a cache
    advised = hugepages.collapse_new(before, [keep])
    assert advised >= 8 << 20  # at least the 2 MB-aligned interior of the first 10 MB
    assert "hg" in _vma(lo + (4 << 20))["VmFlags"].split()
    assert "hg" not in _vma(keep[0] + (1 << 20))["VmFlags"].split()
    assert a[::4096].sum() == size // 4096  # the contents stay
    # memory that was there before the snapshot is not touched
    assert hugepages.collapse_new(hugepages.mappings(), []) == 0
    del a
    m.close()


@linux_thp
@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_engine_caches_stay_on_small_pages(engines):
    from specexport.runtime import SpeculativeDecoder
    dec = SpeculativeDecoder.load(engines["lookup"], max_batch=1, prepack=True)
    kv = dec.target._kv_np[0]
    assert "nh" in _vma(kv.ctypes.data)["VmFlags"].split()
    assert dec.target.huge_bytes >= 0
    ids = dec.generate([5, 6, 7, 8, 9], 12, speculative=False)[0].token_ids
    assert ids == dec.generate([5, 6, 7, 8, 9], 12, k=3)[0].token_ids
