"""The simulator's inner loop: an event-driven list scheduler compiled with numba.

Written by hand (rather than with a discrete-event library such as SimPy) because scoring
thousands of plans a second needs ~1 µs per op, which only compiled code gets: SimPy's
generator-per-process model costs tens of µs per event. numba keeps it in Python syntax
with no build step.

Model (after FlexFlow's task-graph simulator, Jia et al., SysML 2019, §5, and Placeto's
event-driven simulator, Addanki et al., NeurIPS 2019):

* every device runs one op at a time; among ops whose inputs have all arrived it starts
  the one with the smallest priority (topological rank, i.e. execution order) as soon as it
  is idle, so a device never idles while it has ready work;
* when an op finishes, its output is sent once to every *other* device that consumes it
  (the largest tensor any consumer there reads); a transfer reserves every link on its
  route, starting when the last of them is free (first come, first served), and takes the
  sum of the links' latencies plus bytes over the bottleneck bandwidth; transfers overlap
  with compute;
* memory per device: resident bytes (parameters, optimizer state, inputs) plus live
  tensors; an op's output is allocated when it starts and freed once its last local
  consumer has finished and every transfer of it has completed; a received copy is
  allocated when its transfer starts and freed after its last consumer there finishes.

Two options model hosts whose workers are CPU processes (both off by default, which is the
model above, bit for bit):

* **host-staged messages** (``msg_cpu``, per device: send seconds, send seconds per byte,
  receive seconds, receive seconds per byte): with no DMA engine between devices, a
  transfer also occupies the sending device's compute (added to the producing op) and the
  receiving device's (added to the first op there that reads it, in priority order);
* **in-order execution** (``in_order``): a device runs its ops strictly in priority order,
  waiting for the next one's inputs even when a later op is ready, as an interpreter that
  walks the graph in one global order does (``meshplace.runtime``).

A third models links whose latency is time in flight, not time on the wire
(``link_overlaps``, per link; the cluster's ``latency_overlaps: true`` on a link: a TCP
connection between two processes, where a message's latency is both ends' software and
the next message leaves while it is in flight, as in LogP's latency against its gap,
Culler et al., PPoPP 1993): a transfer holds such a link for its bytes over the
bandwidth only and still arrives after the latency as well, so a burst of small
messages pays the latency once rather than once per message. Off by default (a link is
held for the latency too, the model above).

A fourth is a property of the hardware (``occupy``, per device; the cluster's
``transfers: occupy``): a device with no engine that moves data for it (CPUs, FPGAs, many
accelerators — PipeDream's and the host/FPGA literature's model) spends a transfer's whole
duration (route latency plus bytes over the bottleneck bandwidth) on it, at both ends:

* the **sender** drives the wire itself: after the producing op it sends each of the op's
  transfers in turn (one per consuming device, the largest tensor read there — fan-out
  costs one send per device, as a processor without broadcast hardware pays it), each
  starting when the device and every link of the route are free, and starts its next op
  only when the last send has ended;
* the **receiver** copies the tensor in: the same duration joins the first op there that
  reads it (in priority order), as host-staged messages do.

So a device's busy time is its compute plus the time of every transfer it sends or
receives, and the pipelined (throughput) objective is exactly the max over devices of
(compute + incoming + outgoing transfer time) where the links are not the bottleneck.

Complexity: O((V + E) log V) per simulation, no Python objects in the loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit

OP_DONE = 0
TRANSFER_DONE = 1
DEVICE_FREE = 2  # an occupying device has finished sending


@njit(cache=True, inline="always")
def _ev_less(t_a, s_a, t_b, s_b):
    return t_a < t_b or (t_a == t_b and s_a < s_b)


@njit(cache=True)
def _ev_push(ev_t, ev_s, ev_k, ev_i, size, t, s, k, i):
    pos = size
    ev_t[pos] = t
    ev_s[pos] = s
    ev_k[pos] = k
    ev_i[pos] = i
    while pos > 0:
        parent = (pos - 1) >> 1
        if _ev_less(ev_t[pos], ev_s[pos], ev_t[parent], ev_s[parent]):
            ev_t[pos], ev_t[parent] = ev_t[parent], ev_t[pos]
            ev_s[pos], ev_s[parent] = ev_s[parent], ev_s[pos]
            ev_k[pos], ev_k[parent] = ev_k[parent], ev_k[pos]
            ev_i[pos], ev_i[parent] = ev_i[parent], ev_i[pos]
            pos = parent
        else:
            break
    return size + 1


@njit(cache=True)
def _ev_pop(ev_t, ev_s, ev_k, ev_i, size):
    """Remove the smallest event; the caller has read it from index 0 first."""
    size -= 1
    ev_t[0] = ev_t[size]
    ev_s[0] = ev_s[size]
    ev_k[0] = ev_k[size]
    ev_i[0] = ev_i[size]
    pos = 0
    while True:
        left = 2 * pos + 1
        if left >= size:
            break
        best = left
        right = left + 1
        if right < size and _ev_less(ev_t[right], ev_s[right], ev_t[left], ev_s[left]):
            best = right
        if _ev_less(ev_t[best], ev_s[best], ev_t[pos], ev_s[pos]):
            ev_t[pos], ev_t[best] = ev_t[best], ev_t[pos]
            ev_s[pos], ev_s[best] = ev_s[best], ev_s[pos]
            ev_k[pos], ev_k[best] = ev_k[best], ev_k[pos]
            ev_i[pos], ev_i[best] = ev_i[best], ev_i[pos]
            pos = best
        else:
            break
    return size


@njit(cache=True)
def _ready_push(heap, base, size, priority, op):
    """Min-heap of op ids keyed by ``priority`` inside ``heap[base:base + size]``."""
    pos = size
    heap[base + pos] = op
    while pos > 0:
        parent = (pos - 1) >> 1
        a = heap[base + pos]
        b = heap[base + parent]
        if priority[a] < priority[b]:
            heap[base + pos] = b
            heap[base + parent] = a
            pos = parent
        else:
            break
    return size + 1


@njit(cache=True)
def _ready_pop(heap, base, size, priority):
    top = heap[base]
    size -= 1
    heap[base] = heap[base + size]
    pos = 0
    while True:
        left = 2 * pos + 1
        if left >= size:
            break
        best = left
        right = left + 1
        if right < size and priority[heap[base + right]] < priority[heap[base + left]]:
            best = right
        if priority[heap[base + best]] < priority[heap[base + pos]]:
            tmp = heap[base + pos]
            heap[base + pos] = heap[base + best]
            heap[base + best] = tmp
            pos = best
        else:
            break
    return top, size


@njit(cache=True, inline="always")
def _start_next(
    d,
    now,
    heap,
    base,
    hsize,
    priority,
    op_time,
    time_scale,
    nxt,
    op_start,
    op_end,
    busy,
    busy_time,
    live,
    peak,
    out_bytes,
    ev_t,
    ev_s,
    ev_k,
    ev_i,
    n_ev,
    seq,
):
    """Device ``d`` starts its highest-priority ready op at ``now``: allocate its output,
    mark the device busy and schedule the op's completion. Returns (events, next seq)."""
    u, hsize[d] = _ready_pop(heap, base[d], hsize[d], priority)
    nxt[d] += 1
    dur = op_time[u] * time_scale
    op_start[u] = now
    op_end[u] = now + dur
    busy[d] = True
    busy_time[d] += dur
    live[d] += out_bytes[u]
    if live[d] > peak[d]:
        peak[d] = live[d]
    n_ev = _ev_push(ev_t, ev_s, ev_k, ev_i, n_ev, now + dur, seq, OP_DONE, u)
    return n_ev, seq + 1


@njit(cache=True)
def simulate_kernel(
    n_dev,
    placement,
    op_time,
    priority,
    succ_ptr,
    succ_idx,
    succ_edge,
    pred_ptr,
    pred_idx,
    pred_edge,
    edge_bytes,
    out_bytes,
    resident,
    route_ptr,
    route_links,
    pair_keys,
    link_bw,
    link_lat,
    time_scale,
    msg_cpu,
    in_order,
    occupy,
    link_overlaps,
):
    """Simulate one step. Returns per-op start/end, the transfers, per-device busy time and
    peak memory, and per-link busy time and bytes. ``time_scale`` multiplies every
    duration (op and transfer), which the scaling property tests use. ``msg_cpu``
    (``[n_dev, 4]``, zeros: off), ``in_order``, ``occupy`` (``[n_dev]`` booleans: the
    device spends each transfer's time at both ends) and ``link_overlaps`` (``[n_links]``
    booleans) are the options in the module doc.

    Routes are CSR (``route_links[route_ptr[r] : route_ptr[r + 1]]``). With ``pair_keys``
    empty, ``r`` is ``src_device * n_dev + dst_device`` (a table of all pairs); otherwise
    ``pair_keys`` lists, sorted, the keys ``src_device * n_dev + dst_device`` of the pairs
    the table holds (those this placement sends data between) and ``r`` is a key's
    position, found once per transfer before the event loop."""
    n = placement.shape[0]
    n_edges = edge_bytes.shape[0]
    n_links = link_bw.shape[0]

    # ---- transfers: one per (producer, consuming device) ---------------------------
    local_cons = np.zeros(n, np.int64)
    edge_xfer = np.full(n_edges, -1, np.int64)
    x_src = np.empty(n_edges, np.int64)
    x_dev = np.empty(n_edges, np.int64)
    x_bytes = np.empty(n_edges, np.float64)
    x_cons = np.zeros(n_edges, np.int64)
    x_first = np.empty(n_edges, np.int64)
    x_route = np.empty(n_edges, np.int64)
    x_ptr = np.zeros(n + 1, np.int64)
    mark = np.full(n_dev, -1, np.int64)
    slot = np.zeros(n_dev, np.int64)
    n_x = 0
    for u in range(n):
        du = placement[u]
        x_ptr[u] = n_x
        for k in range(succ_ptr[u], succ_ptr[u + 1]):
            v = succ_idx[k]
            e = succ_edge[k]
            dv = placement[v]
            if dv == du:
                local_cons[u] += 1
            else:
                if mark[dv] != u:
                    mark[dv] = u
                    slot[dv] = n_x
                    x_src[n_x] = u
                    x_dev[n_x] = dv
                    x_bytes[n_x] = edge_bytes[e]
                    x_first[n_x] = v
                    x_route[n_x] = du * n_dev + dv
                    n_x += 1
                t = slot[dv]
                if priority[v] < priority[x_first[t]]:
                    x_first[t] = v
                if edge_bytes[e] > x_bytes[t]:
                    x_bytes[t] = edge_bytes[e]
                x_cons[t] += 1
                edge_xfer[e] = t
    x_ptr[n] = n_x
    if pair_keys.shape[0] > 0:
        for x in range(n_x):
            x_route[x] = np.searchsorted(pair_keys, x_route[x])

    # host-staged messages: each end's CPU time joins an op's duration; an occupying
    # receiver spends the transfer's time on its first consumer
    op_dur = op_time.copy()
    for x in range(n_x):
        du = placement[x_src[x]]
        dv = x_dev[x]
        op_dur[x_src[x]] += msg_cpu[du, 0] + msg_cpu[du, 1] * x_bytes[x]
        op_dur[x_first[x]] += msg_cpu[dv, 2] + msg_cpu[dv, 3] * x_bytes[x]
        if occupy[dv]:
            pair = x_route[x]
            bw = np.inf
            lat = 0.0
            for r in range(route_ptr[pair], route_ptr[pair + 1]):
                link = route_links[r]
                if link_bw[link] < bw:
                    bw = link_bw[link]
                lat += link_lat[link]
            op_dur[x_first[x]] += lat + x_bytes[x] / bw

    rem_local = np.empty(n, np.int64)
    for u in range(n):
        rem_local[u] = local_cons[u] + (x_ptr[u + 1] - x_ptr[u])
    rem_x = x_cons[:n_x].copy()
    deps = np.empty(n, np.int64)
    for v in range(n):
        deps[v] = pred_ptr[v + 1] - pred_ptr[v]

    # ---- per-device ready heaps, each in its own slice of one array -----------------
    per_dev = np.zeros(n_dev, np.int64)
    for u in range(n):
        per_dev[placement[u]] += 1
    base = np.zeros(n_dev, np.int64)
    acc = 0
    for d in range(n_dev):
        base[d] = acc
        acc += per_dev[d]
    heap = np.empty(n, np.int64)
    hsize = np.zeros(n_dev, np.int64)
    # each device's ops in priority order (in-order execution starts only the next one)
    dev_seq = np.empty(n, np.int64)
    fill = np.zeros(n_dev, np.int64)
    by_priority = np.empty(n, np.int64)
    for u in range(n):
        by_priority[priority[u]] = u
    for k in range(n):
        u = by_priority[k]
        d = placement[u]
        dev_seq[base[d] + fill[d]] = u
        fill[d] += 1
    nxt = np.zeros(n_dev, np.int64)

    cap = 2 * n + n_x + 1  # op ends, transfer ends, occupying devices' send ends
    ev_t = np.empty(cap, np.float64)
    ev_s = np.empty(cap, np.int64)
    ev_k = np.empty(cap, np.int8)
    ev_i = np.empty(cap, np.int64)
    n_ev = 0
    seq = 0

    op_start = np.zeros(n, np.float64)
    op_end = np.zeros(n, np.float64)
    x_start = np.zeros(n_x, np.float64)
    x_end = np.zeros(n_x, np.float64)
    busy = np.zeros(n_dev, np.bool_)
    busy_time = np.zeros(n_dev, np.float64)
    live = resident.copy()
    peak = resident.copy()
    link_free = np.zeros(n_links, np.float64)
    link_busy = np.zeros(n_links, np.float64)
    link_bytes = np.zeros(n_links, np.float64)

    for u in range(n):
        if deps[u] == 0:
            d = placement[u]
            hsize[d] = _ready_push(heap, base[d], hsize[d], priority, u)

    now = 0.0
    for d in range(n_dev):
        if hsize[d] > 0 and (not in_order or heap[base[d]] == dev_seq[base[d] + nxt[d]]):
            n_ev, seq = _start_next(
                d,
                now,
                heap,
                base,
                hsize,
                priority,
                op_dur,
                time_scale,
                nxt,
                op_start,
                op_end,
                busy,
                busy_time,
                live,
                peak,
                out_bytes,
                ev_t,
                ev_s,
                ev_k,
                ev_i,
                n_ev,
                seq,
            )

    makespan = 0.0
    while n_ev > 0:
        now = ev_t[0]
        kind = ev_k[0]
        ident = ev_i[0]
        n_ev = _ev_pop(ev_t, ev_s, ev_k, ev_i, n_ev)
        if now > makespan:
            makespan = now
        if kind == OP_DONE:
            u = ident
            d = placement[u]
            busy[d] = False
            # inputs of u that are no longer needed here
            for k in range(pred_ptr[u], pred_ptr[u + 1]):
                p = pred_idx[k]
                if placement[p] == d:
                    rem_local[p] -= 1
                    if rem_local[p] == 0:
                        live[d] -= out_bytes[p]
                else:
                    x = edge_xfer[pred_edge[k]]
                    rem_x[x] -= 1
                    if rem_x[x] == 0:
                        live[d] -= x_bytes[x]
            if rem_local[u] == 0:
                live[d] -= out_bytes[u]
            for k in range(succ_ptr[u], succ_ptr[u + 1]):
                v = succ_idx[k]
                if placement[v] == d:
                    deps[v] -= 1
                    if deps[v] == 0:
                        hsize[d] = _ready_push(heap, base[d], hsize[d], priority, v)
            sender_free = now  # an occupying sender sends one transfer after another
            for x in range(x_ptr[u], x_ptr[u + 1]):
                dv = x_dev[x]
                pair = x_route[x]
                start = sender_free
                bw = np.inf
                lat = 0.0
                for r in range(route_ptr[pair], route_ptr[pair + 1]):
                    link = route_links[r]
                    if link_free[link] > start:
                        start = link_free[link]
                    if link_bw[link] < bw:
                        bw = link_bw[link]
                    lat += link_lat[link]
                dur = (lat + x_bytes[x] / bw) * time_scale
                end = start + dur
                # a link is held for the whole transfer, or with an overlapping latency for
                # the bytes only (the next message leaves while this one is in flight)
                wire = x_bytes[x] / bw * time_scale
                for r in range(route_ptr[pair], route_ptr[pair + 1]):
                    link = route_links[r]
                    held = wire if link_overlaps[link] else dur
                    link_free[link] = start + held
                    link_busy[link] += held
                    link_bytes[link] += x_bytes[x]
                x_start[x] = start
                x_end[x] = end
                if occupy[d]:
                    sender_free = end
                    busy_time[d] += dur
                live[dv] += x_bytes[x]
                if live[dv] > peak[dv]:
                    peak[dv] = live[dv]
                n_ev = _ev_push(ev_t, ev_s, ev_k, ev_i, n_ev, end, seq, TRANSFER_DONE, x)
                seq += 1
            if sender_free > now:  # busy sending until then
                busy[d] = True
                n_ev = _ev_push(ev_t, ev_s, ev_k, ev_i, n_ev, sender_free, seq, DEVICE_FREE, d)
                seq += 1
        elif kind == DEVICE_FREE:
            d = ident
            busy[d] = False
        else:
            x = ident
            u = x_src[x]
            d = placement[u]
            rem_local[u] -= 1
            if rem_local[u] == 0:
                live[d] -= out_bytes[u]
            d = x_dev[x]
            for k in range(succ_ptr[u], succ_ptr[u + 1]):
                v = succ_idx[k]
                if placement[v] == d:
                    deps[v] -= 1
                    if deps[v] == 0:
                        hsize[d] = _ready_push(heap, base[d], hsize[d], priority, v)
        # the device that just freed up, or received data, starts its next ready op
        if (
            not busy[d]
            and hsize[d] > 0
            and (not in_order or heap[base[d]] == dev_seq[base[d] + nxt[d]])
        ):
            n_ev, seq = _start_next(
                d,
                now,
                heap,
                base,
                hsize,
                priority,
                op_dur,
                time_scale,
                nxt,
                op_start,
                op_end,
                busy,
                busy_time,
                live,
                peak,
                out_bytes,
                ev_t,
                ev_s,
                ev_k,
                ev_i,
                n_ev,
                seq,
            )

    return (
        makespan,
        op_start,
        op_end,
        x_src[:n_x].copy(),
        x_dev[:n_x].copy(),
        x_bytes[:n_x].copy(),
        x_start,
        x_end,
        busy_time,
        peak,
        link_busy,
        link_bytes,
    )
