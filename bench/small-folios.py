#!/usr/bin/env python3
"""Put files in the page cache in 4 KiB folios (BENCHMARKS, session 60).

A cold read on Linux 6.x reads ahead in large folios, which a map takes one PMD each; after
memory pressure the cache can hold small ones, which a map takes PTE by PTE. This makes the
small-folio state on demand: evict each file, turn read-ahead off (POSIX_FADV_RANDOM) and read
it back in 4 KiB preads. Check with /proc/self/smaps (FilePmdMapped ~0 for a map of the file).

    python3 bench/small-folios.py ckpt/*.safetensors engine-differs.safetensors
"""
import os
import sys

for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    size, off = os.fstat(fd).st_size, 0
    while off < size:
        os.pread(fd, 4096, off)
        off += 4096
    os.close(fd)
