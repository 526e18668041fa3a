#!/usr/bin/env python3
"""A model of the local buckets of 2,000 instances sharing 2,000/s through an
outage (docs/accuracy.md, "2,000 Limiters through an outage"): each bucket
refills 0.97 tokens a second (the weights added up to 0.96-0.98), is offered
a decision every half second (evenly spaced, or Poisson), and starts when
Redis goes away: empty (today) or at a random fraction of a token, holding
one token at most (today) or two. Prints the admitted per second of four.

    python3 scripts/fleetmodel.py
"""
import random

def run(cap, dither, poisson, n=2000, rate=0.97, gap=0.5, secs=4, seed=1):
    rnd = random.Random(seed)
    per = [0] * (secs + 1)
    for _ in range(n):
        tokens, last = (rnd.random() if dither else 0.0), 0.0
        t = rnd.expovariate(1 / gap) if poisson else rnd.random() * gap
        while t < secs:
            tokens, last = min(cap, tokens + rate * (t - last)), t
            if tokens >= 1 - 1e-12:
                tokens -= 1
                per[int(t)] += 1
            t += rnd.expovariate(1 / gap) if poisson else gap
    return per[:secs]

for cap, dither in ((1, False), (2, False), (1, True), (2, True)):
    for poisson in (False, True):
        per = run(cap, dither, poisson)
        print(f"cap {cap}, start {'random' if dither else 'empty '}, {'Poisson' if poisson else 'even   '}: "
              f"{per}, {sum(per) / (4 * 2000):.0%} of 8,000")
