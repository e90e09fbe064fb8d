#!/usr/bin/env python3
"""bench/folio-sizes.py FILE... -- the sizes of the page-cache folios holding each file (root).

The page cache sizes a folio by the write that creates it, and the cost of a later small write into
it grows with it (ext4 walks every buffer head of the folio). Maps each file, touches only its pages
that are already cached (mincore: no I/O, no new page), reads each page's frame from
/proc/self/pagemap and its head/tail flags from /proc/kpageflags (bits 15 and 16), and prints the
share of the cached bytes in folios of each size.
"""
import collections
import ctypes
import os
import struct
import sys

PAGE = 4096
KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 15, 16

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def folios(path):
    """(cached pages, not cached pages, Counter of folio size in pages -> count)."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size // PAGE * PAGE
    sizes = collections.Counter()
    if size == 0:
        return 0, 0, sizes
    pages = size // PAGE
    base = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap {path}")
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(base, size, vec) != 0:
        raise OSError(ctypes.get_errno(), f"mincore {path}")
    cached = [i for i in range(pages) if vec[i] & 1]
    for i in cached:  # map the cached pages into this process (a read of a cached page)
        ctypes.c_ubyte.from_address(base + i * PAGE).value
    run = 0  # pages of the folio being counted
    with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as kflags:
        for i in cached:
            pagemap.seek((base // PAGE + i) * 8)
            entry = struct.unpack("<Q", pagemap.read(8))[0]
            if not entry >> 63:
                continue
            kflags.seek((entry & ((1 << 55) - 1)) * 8)
            flags = struct.unpack("<Q", kflags.read(8))[0]
            if flags >> KPF_COMPOUND_TAIL & 1 and run:
                run += 1
                continue
            if run:
                sizes[run] += 1
            run = 1 if flags >> KPF_COMPOUND_HEAD & 1 else 0
            if not run:
                sizes[1] += 1
        if run:
            sizes[run] += 1
    os.close(fd)
    return len(cached), pages - len(cached), sizes


for path in sys.argv[1:]:
    cached, missing, sizes = folios(path)
    total = sum(n * count for n, count in sizes.items()) or 1
    shares = " ".join(f"{n * PAGE // 1024}K:{100 * n * count / total:.0f}%" for n, count in sorted(sizes.items()))
    print(f"{path}: {cached} pages cached, {missing} not; by folio size: {shares}")
