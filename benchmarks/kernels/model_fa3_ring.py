"""A Python model of the FA3-structured kernel's ring protocol (gluon_window_attention_fa3.py).

One program's producer and NC consumers run as coroutines over modelled mbarriers (arrival counts,
phases, transaction bytes, parity waits) and TMA copies that land in random order, interleaved at
random. It checks that no wait deadlocks, that no mbarrier gets more arrivals than its count in a
phase, and that every block a consumer reads is the one in its slot. It mirrors the kernel's index
arithmetic by hand (block ranges per tile, parities, releases): change both together. With the
block ranges restarting at the program's first block on every tile, as Gluon on Triton 3.7.1
compiled the loop-carried version (kernel log, run 14), it fails as the kernel did on the device:
"over-arrival" from the producer's ranges, a deadlock from the consumers'.

With ``overlap`` ("pairs" or "tiles", the kernel's OVERLAP modes: a consumer issues its next
tile's Q · Kᵀ before this tile's softmax) a consumer waits for its next tile's blocks and queries
while it still holds this tile's band, and releases this tile's blocks only after its P · V; the
model checks that the producer can always load that next band (the ring holds both consumers'
current bands and the next one), and that every block and query buffer a consumer reads, the next
tile's while its wgmmas are in flight too, is still the one it waited for. ``pingpong`` adds the
softmax turns (one mbarrier per consumer, passed round).

    python3 benchmarks/kernels/model_fa3_ring.py     # one "ok" line per case
"""

from __future__ import annotations

import random

BLOCK = 16


def band_start(t, T, window_q, band_offset):
    return (t * T - window_q + band_offset) // BLOCK - band_offset // BLOCK


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.phase, self.tx = count, count, 0, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "over-arrival"
        self._complete()

    def expect(self, nbytes):  # arrive + expect_tx
        self.tx += nbytes
        self.arrive()

    def land(self, nbytes):  # a TMA copy's complete_tx
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity):  # mbarrier.wait(bar, parity) returns
        return (self.phase & 1) != parity


def run(seq_len, t_begin, t_end, NC=2, T=16, window_q=64, NB=9, NS=16, seed=0, overlap=False,
        pingpong=False):
    off = BLOCK * -(-window_q // BLOCK)
    nblocks = (seq_len + BLOCK - 1) // BLOCK
    first_kb = max(band_start(t_begin, T, window_q, off), 0)
    kv_ready = [Barrier(1) for _ in range(NS)]
    kv_free = [Barrier(NC) for _ in range(NS)]
    q_ready = [Barrier(1) for _ in range(2 * NC)]
    q_free = [Barrier(1) for _ in range(2 * NC)]
    turn = [Barrier(1) for _ in range(NC)]
    slot_block, q_tile, in_flight = [None] * NS, [None] * (2 * NC), []

    def producer():
        for t in range(t_begin, t_end):
            hi = min(band_start(t, T, window_q, off) + NB, nblocks)
            lo = first_kb
            if t > t_begin:
                lo = max(first_kb, min(band_start(t - 1, T, window_q, off) + NB, nblocks))
            for kb in range(lo, hi):
                s = kb % NS
                while not kv_free[s].passes((((kb - first_kb) // NS) & 1) ^ 1):
                    yield
                kv_ready[s].expect(4096)
                in_flight.append(("kv", s, kb))
            it = t - t_begin
            i = it // NC
            qi = (it % NC) * 2 + i % 2
            while not q_free[qi].passes(((i // 2) & 1) ^ 1):
                yield
            q_ready[qi].expect(8192)
            in_flight.append(("q", qi, t))

    def band(t):
        b0 = band_start(t, T, window_q, off)
        return b0, min(b0 + NB, nblocks)

    def check(C, t, why, queries=True):  # what a wgmma of tile t reads is in place
        qi = C * 2 + ((t - t_begin - C) // NC) % 2
        assert not queries or q_tile[qi] == t, ("stale queries", why, C, t, q_tile[qi])
        b0, hi = band(t)
        for kb in range(max(b0, first_kb), hi):
            assert slot_block[kb % NS] == kb, ("stale slot", why, C, t, kb, slot_block[kb % NS])

    def wait_blocks(lo, hi):
        for kb in range(lo, hi):
            while not kv_ready[kb % NS].passes(((kb - first_kb) // NS) & 1):
                yield

    def softmax_turn(C, i, t, *in_flight_tiles):
        """Tile i's mask / max / P · V (under the ping-pong turn), its blocks read throughout
        (and those of the tiles whose Q · Kᵀ is in flight), then the release."""
        if pingpong:
            if C == 0:
                while i > 0 and not turn[0].passes((i - 1) & 1):
                    yield
            else:
                while not turn[C].passes(i & 1):
                    yield
        # The Q · Kᵀ in flight (queries from shared memory, the dropped one over this tile's own
        # freed buffer too) reads until P · V's wait; P · V reads the blocks only.
        for x in in_flight_tiles:
            check(C, x, "Q·K in flight")
        yield
        check(C, t, "P·V", queries=False)
        for x in in_flight_tiles:
            check(C, x, "Q·K in flight")
        if pingpong:
            turn[(C + 1) % NC].arrive()
        b0 = band_start(t, T, window_q, off)
        rel_lo = first_kb if i == 0 else max(first_kb, min(b0, nblocks))
        rel_hi = min(band_start(t + NC, T, window_q, off), nblocks)
        for kb in range(rel_lo, rel_hi):
            kv_free[kb % NS].arrive()

    def plain_tile(C, i):
        t = t_begin + C + i * NC
        qi = C * 2 + i % 2
        b0, hi = band(t)
        lo = first_kb
        if i > 0:
            lo = max(first_kb, min(band_start(t - NC, T, window_q, off) + NB, nblocks))
        yield from wait_blocks(lo, hi)
        while not q_ready[qi].passes((i // 2) & 1):
            yield
        check(C, t, "Q·K")
        yield
        q_free[qi].arrive()
        yield
        yield from softmax_turn(C, i, t)

    def consumer(C):
        n_tiles = max(0, -(-(t_end - t_begin - C) // NC))
        for i in range(n_tiles):
            yield from plain_tile(C, i)

    def consumer_overlap(C):
        """The OVERLAP kernel's order: tile 0's Q · Kᵀ before the loop; tile i waits for tile
        i + 1's blocks and queries and issues its Q · Kᵀ (the last overlapped tile issues its own
        band again: nothing new to wait for), then tile i's queries are free, then its softmax.
        "pairs": an odd count's last tile runs in the plain order; "tiles": every tile overlaps."""
        n_tiles = max(0, -(-(t_end - t_begin - C) // NC))
        paired = 2 * (n_tiles // 2) if overlap == "pairs" else n_tiles
        if paired:
            t = t_begin + C
            yield from wait_blocks(first_kb, band(t)[1])
            while not q_ready[C * 2].passes(0):
                yield
            check(C, t, "Q·K")
        for i in range(paired):
            t = t_begin + C + i * NC
            qi = C * 2 + i % 2
            nxt = t + NC if i + 1 < paired else t
            if i + 1 < paired:
                yield from wait_blocks(max(first_kb, band(t)[1]), band(nxt)[1])
                while not q_ready[C * 2 + (i + 1) % 2].passes(((i + 1) // 2) & 1):
                    yield
            check(C, nxt, "Q·K")
            yield
            q_free[qi].arrive()
            yield
            yield from softmax_turn(C, i, t, nxt)
        if paired < n_tiles:
            yield from plain_tile(C, paired)

    rng = random.Random(seed)
    procs = [producer()] + [(consumer_overlap if overlap else consumer)(c) for c in range(NC)]
    alive = set(range(len(procs)))
    for _ in range(10**6):
        if not alive:
            return
        if in_flight and rng.random() < 0.5:
            kind, s, x = in_flight.pop(rng.randrange(len(in_flight)))
            if kind == "kv":
                slot_block[s] = x
                kv_ready[s].land(4096)
            else:
                q_tile[s] = x
                q_ready[s].land(8192)
            continue
        p = rng.choice(sorted(alive))
        try:
            next(procs[p])
        except StopIteration:
            alive.discard(p)
    raise RuntimeError("deadlock")


CASES = [(64, 0, 4), (256, 0, 16), (4096, 0, 256), (700, 3, 30), (16384, 100, 356), (2048, 5, 6),
         (2048, 5, 7), (129, 0, 9), (17, 0, 2)]


def main():
    for window_q in (64, 127):  # MiMo's band, GPT-OSS's causal one (both 9 blocks)
        for overlap in (False, "pairs", "tiles"):
            for pingpong in (False, True):
                for seq_len, t_begin, t_end in CASES:
                    for NC in (2, 3):
                        for seed in range(3):
                            try:
                                run(seq_len, t_begin, t_end, NC=NC, window_q=window_q, seed=seed,
                                    overlap=overlap, pingpong=pingpong)
                            except (AssertionError, RuntimeError) as e:
                                print("FAIL", window_q, seq_len, t_begin, t_end, NC, seed,
                                      f"overlap={overlap} pingpong={pingpong}", e)
                                break
                        else:
                            print("ok", window_q, seq_len, t_begin, t_end, NC,
                                  f"overlap={overlap} pingpong={pingpong}")


if __name__ == "__main__":
    main()
