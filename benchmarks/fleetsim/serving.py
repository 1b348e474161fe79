"""One 2 s tick of serving on a fleet, as a fluid model vectorised over endpoints.

Per endpoint, requests arrive at rate a/2s; its ready replicas share them equally (least-loaded
routing). A replica's engine, alone on its device, would need
    rho = lam * prefill(P) + (decode steps/s) * step(B)      device-seconds per second,
with B the sequences decoding, from Little's law (B = g * step(B), g = lam * G generated
tokens/s; below one sequence every token is its own step). The engines on a device time-share it
(no MPS): the device's slowdown is max(1, sum of rho), and each endpoint runs at the mean
slowdown of its replicas' devices. A replica serves at most 1 / (slowdown * device-seconds per
request with every slot in use) requests/s; the rest queue at the gateway, first in first out.

Then the accounting of the tick: tokens of the requests served, the token capacity and the
device- and node-seconds of provisioned devices, cold requests and sessions, and TTFT samples
(`metrics` has the definitions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetsim.fleet import Fleet
from fleetsim.metrics import SESSION_GAP_S
from fleetsim.service import DEVICES_PER_NODE
from fleetsim.workload import TICK_S, Workload

WARM_SAMPLES = 32  # warm requests whose TTFT is computed per tick (weighted)
ADMISSION_QUEUE = 256.0  # the platform's default admission_queue_size, per endpoint


@dataclass
class TickState:
    """What the tick computed per unit, for the levers that act after it (`levers`)."""

    u: np.ndarray  # device share each replica's real-time work asks for
    mu: np.ndarray  # requests/s the ready replicas serve
    backlog: np.ndarray  # queued at the start of the tick
    slow: np.ndarray
    step: np.ndarray  # decode step, s
    b: np.ndarray  # real-time sequences decoding per replica


@dataclass
class Extra:
    """Optional inputs of the levers; all None/empty leaves the tick exactly as without them.

    `warm_exclude`: per unit, requests to count as cold rather than warm (adapter loads);
    `pair_load`: per ready (replica, device) pair slot, the device share batch backfill used
    last tick (slows the other engines on that device); `batch_seqs`: per unit, batch
    sequences decoding per replica beside real-time ones (longer steps); `preempt_s`: per unit,
    the time to swap a batch sequence out when a real-time request needs its slot."""

    warm_exclude: np.ndarray | None = None
    pair_load: np.ndarray | None = None
    batch_seqs: np.ndarray | None = None
    preempt_s: np.ndarray | None = None
    admission: np.ndarray | None = None  # per unit, instead of ADMISSION_QUEUE


def _decode(s, lam, S, pf):
    """Sequences decoding per replica (Little's law: B = lam * G * s * step(B), decode running
    only between prefills), at slowdown s and requests/s lam per replica."""
    avail = np.maximum(0.05, 1.0 - lam * pf * s)
    x = lam * S.mean_generated * s / avail
    b1 = x * (S.c0 + S.c1)
    denom = 1.0 - x * S.c1
    bsat = np.where(denom > 0, x * S.c0 / np.maximum(denom, 1e-12), S.slots)
    return np.minimum(np.where(b1 < 1.0, b1, bsat), S.slots)


def serve(
    f: Fleet,
    w: Workload,
    tick: int,
    arrivals: np.ndarray,
    prompt: np.ndarray,
    generated: np.ndarray,
    rng: np.random.Generator,
    extra: Extra | None = None,
) -> TickState:
    S, c = f.s, f.counters
    x = extra or Extra()
    limit = ADMISSION_QUEUE if x.admission is None else x.admission
    now = tick * TICK_S
    a = arrivals.astype(float)
    ready = f.ready.astype(float)
    have = ready > 0
    per = np.maximum(ready, 1.0)
    pf = S.pf0 + S.pf1 * S.mean_prompt

    # Device work of the offered load (backlog included) at the batch it would run at; an
    # engine is slowed by the share of its devices' time the other engines use.
    backlog = f.queue
    want = backlog + a
    lam_o = want / TICK_S / per
    b0 = np.maximum(_decode(f.slow, lam_o, S, pf), 1.0)
    u = np.where(
        have, np.minimum(1.0, lam_o * (pf + S.mean_generated * (S.c0 + S.c1 * b0) / b0)), 0.0
    )
    on = f.pair_on
    pe, pd = f.pair_ep[on], f.pair_dev[on]
    load = np.bincount(pd, weights=u[pe], minlength=len(f.dev_n))
    if x.pair_load is not None:  # batch backfill: other engines' batch work shares the device
        own = x.pair_load[on]
        load += np.bincount(pd, weights=own, minlength=len(f.dev_n))
        s_pair = 1.0 / (1.0 - np.minimum(0.9, load[pd] - u[pe] - own))
    else:
        s_pair = 1.0 / (1.0 - np.minimum(0.9, load[pd] - u[pe]))
    cnt = np.bincount(pe, minlength=len(a))
    slow = np.bincount(pe, weights=s_pair, minlength=len(a)) / np.maximum(cnt, 1)
    slow = np.where(cnt > 0, slow, 1.0)
    f.slow = slow

    mu = np.where(have, ready / (slow * S.dev_s_full), 0.0)  # requests/s
    served = np.minimum(want, mu * TICK_S)
    frac = np.divide(served, want, out=np.zeros_like(want), where=want > 0)
    tokens_all = f.queue_tokens + prompt + generated
    tokens = frac * tokens_all
    queue = want - served
    # The gateway's admission queue is bounded (`admission_queue_size`): the rest get 429.
    over = np.maximum(0.0, queue - limit)
    if over.any():
        c.rejected_requests += float(over.sum())
        keep = np.divide(limit, queue, out=np.ones_like(queue), where=over > 0)
        queue = np.minimum(queue, limit)
        f.queue_tokens = (tokens_all - tokens) * keep
    else:
        f.queue_tokens = tokens_all - tokens
    f.queue = queue
    lam = served / TICK_S / per
    b = _decode(slow, lam, S, pf)
    f.inflight = ready * (b + lam * slow * pf)
    step = slow * (S.c0 + S.c1 * np.maximum(b, 1.0))
    if x.batch_seqs is not None:  # batch sequences decode in the same steps
        step = slow * (S.c0 + S.c1 * np.minimum(np.maximum(b + x.batch_seqs, 1.0), S.slots))
    state = TickState(u, mu, backlog, slow, step, b)

    # Accounting: provisioned devices and nodes and their token capacity, for each release
    # delay (a device stays provisioned that long after its last replica left), and the old
    # engine-busy figure.
    busy = f.dev_n > 0
    k_dev = np.where(busy, f.dev_k / np.maximum(f.dev_n, 1), f.dev_last_k)
    for delay, row in c.by_delay.items():
        prov = busy | (f.dev_empty_since + delay > now)
        ndev = int(prov.sum())
        nodes = int(prov.reshape(-1, DEVICES_PER_NODE).any(axis=1).sum())
        row[0] += ndev * TICK_S
        row[1] += nodes * TICK_S
        row[2] += float(k_dev[prov].sum()) * TICK_S
        row[3] = max(row[3], ndev)
        row[4] = max(row[4], nodes)
    c.tokens += float(tokens.sum())
    # Per endpoint: its share of the devices it occupies (time-sliced: 1/replicas on each).
    pe, pd = f.occ_ep[f.occ_on], f.occ_dev[f.occ_on]
    share = 1.0 / f.dev_n[pd]
    c.ep_device_s += np.bincount(pe, weights=share, minlength=len(a)) * TICK_S
    c.ep_capacity += np.bincount(pe, weights=share * k_dev[pd], minlength=len(a)) * TICK_S
    c.ep_tokens += tokens
    mem_share = f.mem_dev * S.tp / S.device.memory_bytes
    c.engine_busy_device_s += (
        float((ready * np.minimum(1.0, f.inflight / per) * mem_share).sum()) * TICK_S
    )

    # Requests, sessions, cold starts.
    got = arrivals > 0
    c.requests += float(a.sum())
    cold = got & ~have
    c.cold_requests += float(a[cold].sum())
    start = got & (now - f.last_arrival > SESSION_GAP_S)
    c.sessions += int(start.sum())
    c.cold_sessions += int((start & ~have).sum())
    f.last_arrival[got] = now

    # TTFT of warm requests: a weighted sample; arrivals spread evenly over the tick, FIFO.
    warm = np.where(have, a, 0.0)
    if x.warm_exclude is not None:
        warm = np.maximum(0.0, warm - x.warm_exclude)
    total = warm.sum()
    if total > 0:
        e = np.searchsorted(np.cumsum(warm), rng.random(WARM_SAMPLES) * total, side="right")
        e = np.minimum(e, len(a) - 1)
        j = rng.random(WARM_SAMPLES) * a[e]
        ahead = np.maximum(0.0, backlog[e] + j - mu[e] * (j / a[e]) * TICK_S)
        wait = ahead / mu[e]
        p = w.draw_prompts(e, rng)
        ttft = wait + slow[e] * (S.pf0[e] + S.pf1[e] * p) + step[e] / 2
        if x.preempt_s is not None:  # slots full of batch: one is swapped out first
            full = b[e] + x.batch_seqs[e] >= S.slots[e] - 1 if x.batch_seqs is not None else 0
            ttft = ttft + np.where(full, x.preempt_s[e], 0.0)
        # The others were refused (429): no first token.
        kept = ahead <= (limit if x.admission is None else limit[e])
        weight = np.full(WARM_SAMPLES, total / WARM_SAMPLES)
        c.sample(ttft[kept], wait[kept], weight[kept], cold=False)

    # TTFT of every cold request: until its endpoint's first replica is ready, then FIFO.
    for e in np.flatnonzero(cold).tolist():
        ready_at = f.first_ready_at(e)
        if ready_at is None:
            c.failed_requests += a[e]
            continue
        k = int(arrivals[e])
        at = now + f.cold_offsets.pop(e)
        loading = max(1, int(f.current[e]))
        queued = backlog[e] + np.arange(k)
        ahead = queued * S.dev_s_full[e] / loading
        wait = np.maximum(0.0, ready_at - at) + ahead
        p = w.draw_prompts(np.full(k, e), rng)
        ttft = wait + S.pf0[e] + S.pf1[e] * p + S.c0[e] / 2
        kept = queued < (limit if x.admission is None else limit[e])
        c.sample(ttft[kept], wait[kept], np.ones(int(kept.sum())), cold=True)
    return state
