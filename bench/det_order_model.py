#!/usr/bin/env python3
"""Model of the deterministic sm90 backward's dQ order: how long the semaphore waits make a
launch, against the same launch without them.

Every CTA (one column block of one head) runs its walk over the row blocks one step per time
unit on one of `sms` slots, launched in grid order as slots free up. Deterministic runs add each
row block's dQ in a fixed order of column blocks (MainloopBwdSm90::dq_rank): a CTA reaches its
atomics `atomics_at` into a step, waits there until its predecessor on that row block has
released it, and releases the row block itself at the end of the step. The ratio of the two
makespans is the model's deterministic / non-deterministic speed.

    python3 bench/det_order_model.py                 # hdim256 tile, the benchmark's shapes
    python3 bench/det_order_model.py --orders current,one_head,ascending

Orders, non-causal:
  current    the launcher's: rotated starts (column block n at row block n * M / N) when the
             column blocks of two heads fit on the GPU at once (2 N <= sms), else ascending
  one_head   rotated whenever one head's column blocks fit (N <= sms), the rule before
  ascending  every column block from row block 0, adding in column order
Orders, causal (the non-deterministic makespan is the launcher's heads-inner launch, longest
column block first across a batch's heads, whichever order the deterministic run takes):
  current        the kernel's: a head's column blocks launched from the last down (shortest walk
                 first), walking upwards from the diagonal, a row block's contributors adding
                 from the rightmost
  longest_first  the mirror image: launched from the first up, heads inner, walking downwards,
                 contributors adding from the leftmost. The model favours it by 5-7%; measured on
                 the H200 it ran 3-4% slower at hdim128 and 7-12% at hdim256 (bench/NOTES.md,
                 "Deterministic causal / local backward, longest first"): each column block
                 follows its left neighbour one step behind, so the release-to-poll latency that
                 the model leaves out lands on every step of the chain.
"""

import argparse
import heapq

TOKENS = 16384
HIDDEN = 2048


def walks_and_ranks(m_blocks, n_blocks, causal, order, sms, block_m, block_n):
    """Per column block: (walk, rank) where walk lists its row blocks in visiting order and
    rank[m] is its place among row block m's adders. Also the grid's launch order of the
    column blocks of a head."""
    walks, ranks = [], []
    if causal:
        columns = order != "longest_first"
        for n in range(n_blocks):
            first = (n * block_n) // block_m
            walk = list(range(first, m_blocks))
            if columns:
                # The column block that starts on the row block adds first, then those to its left.
                rank = {m: min(n_blocks - 1, ((m + 1) * block_m - 1) // block_n) - n for m in walk}
            else:
                # Downwards; column block 0 adds first, then those to its right.
                walk.reverse()
                rank = {m: n for m in walk}
            walks.append(walk)
            ranks.append(rank)
        return walks, ranks, list(range(n_blocks - 1, -1, -1)) if columns else list(range(n_blocks))
    heads_at_once = {"current": 2, "one_head": 1}.get(order)
    rotate = heads_at_once is not None and heads_at_once * n_blocks <= sms and n_blocks <= m_blocks
    for n in range(n_blocks):
        start = n * m_blocks // n_blocks if rotate else 0
        walk = [(start + i) % m_blocks for i in range(m_blocks)]
        if rotate:
            rank = {}
            for m in walk:
                first = min(n_blocks - 1, ((m + 1) * n_blocks + m_blocks - 1) // m_blocks - 1)
                rank[m] = first - n if n <= first else first + n_blocks - n
        else:
            rank = {m: n for m in walk}
        walks.append(walk)
        ranks.append(rank)
    return walks, ranks, list(range(n_blocks))


def makespan(seqlen, causal, deterministic, order="current", sms=132, block_m=64, block_n=80, heads=None,
             batch=None, atomics_at=0.4):
    """Time units until the last CTA ends; heads / batch default to the benchmark's hdim256
    shapes (2048 / 256 heads, 16k tokens)."""
    heads = heads if heads is not None else HIDDEN // 256
    batch = batch if batch is not None else TOKENS // seqlen
    m_blocks = (seqlen + block_m - 1) // block_m
    n_blocks = (seqlen + block_n - 1) // block_n
    walks, ranks, column_order = walks_and_ranks(m_blocks, n_blocks, causal, order, sms, block_m, block_n)
    if causal and (not deterministic or order == "longest_first"):
        # Heads inner: the longest column block of each of a batch's heads, then the next.
        ctas = [(b * heads + h, n) for b in range(batch) for n in range(n_blocks) for h in range(heads)]
    else:
        ctas = [(h, n) for h in range(batch * heads) for n in column_order]
    released = {}  # (head, row block) -> adds released so far
    waiting = {}   # (head, row block, rank) -> CTA index waiting to add
    step = [0] * len(ctas)
    events = []    # (time, seq, kind, cta)
    seq = 0
    next_cta = 0
    end = 0.0

    def push(time, kind, cta):
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, cta))
        seq += 1

    def start_step(time, c):
        if step[c] == len(walks[ctas[c][1]]):
            launch(time)
        else:
            push(time + atomics_at, "atomics", c)

    def launch(time):
        nonlocal next_cta
        if next_cta < len(ctas):
            c = next_cta
            next_cta += 1
            start_step(time, c)

    for _ in range(min(sms, len(ctas))):
        launch(0.0)
    while events:
        time, _, kind, c = heapq.heappop(events)
        end = max(end, time)
        head, n = ctas[c]
        m = walks[n][step[c]]
        if kind == "atomics":
            if not deterministic or released.get((head, m), 0) == ranks[n][m]:
                push(time + 1.0 - atomics_at, "release", c)
            else:
                waiting[(head, m, ranks[n][m])] = c
        else:  # release
            count = released.get((head, m), 0) + 1
            released[(head, m)] = count
            waiter = waiting.pop((head, m, count), None)
            if waiter is not None:
                push(time + 1.0 - atomics_at, "release", waiter)
            step[c] += 1
            start_step(time, c)
    return end


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--orders", default="current")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=80)
    parser.add_argument("--heads", type=int, default=HIDDEN // 256)
    args = parser.parse_args()
    print(f"{'causal':>6} {'seqlen':>6} {'order':>10} {'det/non-det':>11}")
    for causal in (False, True):
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            for order in args.orders.split(","):
                kw = dict(order=order, sms=args.sms, block_m=args.block_m, block_n=args.block_n, heads=args.heads)
                ratio = makespan(seqlen, causal, False, **kw) / makespan(seqlen, causal, True, **kw)
                print(f"{int(causal):>6} {seqlen:>6} {order:>10} {ratio:11.3f}")


if __name__ == "__main__":
    main()
