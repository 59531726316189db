// A node workload for `zmem compare` (or `zmem run`): builds N objects
// ({k, v, s}: two strings each, ~200 bytes of V8 heap), then reads R
// rounds of v and s.length in a scattered order (stride 7919) and prints a
// checksum and N. Only v and s are read: the k strings and what the build
// left behind are cold, so its hot set is well under its peak (~310 MB
// native for N = 1.5M). Node sizes its heap from the limit it sees; give it
// room, or under a limit below its peak it stops with "heap out of memory"
// (under zmem's --show-limit and the kernel's cgroup alike). The end of the
// build and of each round goes to stderr, in ms since the start.
//   zmem compare --limit 200M -- node --max-old-space-size=600 scripts/node-random.js 1500000 2
const t0 = Date.now();
const n = Number(process.argv[2] || 1500000);
const rounds = Number(process.argv[3] || 2);
const a = [];
for (let i = 0; i < n; i++) a.push({ k: 'key' + i, v: i * 7, s: ('x' + i).repeat(4) });
console.error('build', Date.now() - t0);
let h = 0;
for (let r = 0; r < rounds; r++) {
    for (let i = n - 1; i >= 0; i--) {
        const o = a[(i * 7919) % n];
        h = (h * 31 + o.v + o.s.length) >>> 0;
    }
    console.error('round', r, Date.now() - t0);
}
console.log(h, a.length);
