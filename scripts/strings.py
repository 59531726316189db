#!/usr/bin/env python3
"""A Python workload for `zmem compare` (or `zmem run`): builds N strings
(~130 bytes of heap each, with their list) and hashes them all twice, in
order, then prints the digest. Its peak is ~135 MB per million strings.
    zmem compare --limit 150M -- python3 scripts/strings.py 3000000
"""
import hashlib
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 3_000_000
xs = [("k%d-" % i) * 8 for i in range(n)]
h = hashlib.sha256()
for _ in range(2):
    for s in xs:
        h.update(s.encode())
print(h.hexdigest())
