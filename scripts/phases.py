#!/usr/bin/env python3
"""A workload with phases, for `zmem run --max-slowdown` and `zmem compare
--max-slowdown`: builds MB megabytes of record-like 64 KiB blocks (lz4
about 2:1 a page), works on a hot tenth of them, reads every block once,
then works on another tenth; prints a digest.
    zmem compare --max-slowdown 5% -- python3 scripts/phases.py 600
"""
import hashlib
import random
import sys

mb = int(sys.argv[1]) if len(sys.argv) > 1 else 600
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
n = mb * 16  # 64 KiB blocks
rng = random.Random(42)
recs = [b"id=%08d;user=u%06d;balance=%09d;state=%s;" % (i, i % 99991, i * 7919 % 10**9, b"active" if i % 3 else b"closed")
        for i in range(4096)]
blocks = []
for i in range(n):
    # 64 KiB of records, each block from another place in the set, with a
    # salt of its own so that no two blocks are alike.
    start = rng.randrange(4096 - 1400)
    body = b"".join(recs[start:start + 1400])[:65536 - 16]
    blocks.append(bytearray(b"%016x" % rng.getrandbits(64) + body))


def work(ids):
    """Reads and updates the blocks `ids` names, `rounds` times, at random."""
    h = hashlib.blake2b()
    for _ in range(rounds):
        for i in rng.sample(ids, len(ids)):
            b = blocks[i]
            b[rng.randrange(16, 65536 - 16)] ^= 1
            h.update(b[:4096])
            h.update(b[-4096:])
    return h.digest()


hot = list(range(0, n, 10))
d = work(hot)
h = hashlib.blake2b(d)
for b in blocks:
    h.update(b)
d = work(list(range(5, n, 10)))
print(h.hexdigest()[:16], d.hex()[:16])
