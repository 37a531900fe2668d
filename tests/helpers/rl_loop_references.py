"""Plain Python-loop references of the RL algorithms and losses, and the masks and inputs the
reference tests share (tests/rl/test_rl_algorithms.py, tests/rl/test_rl_losses.py).

Every reference loops over batch and time on Python floats (no vectorization), so a broadcasting
or masking mistake in the torch code cannot be mirrored by the reference.
"""

import math

import torch


TOL = dict(rtol=1e-6, atol=1e-6)
B, T = 7, 11


def make_mask(seed=0, batch=B, length=T, empty_row=True):
    """Mask with different lengths per row, holes inside rows, and one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        n = int(torch.randint(1, length + 1, (1,), generator=g))
        mask[b, :n] = 1.0
        # Punch holes strictly inside the valid span so they are real holes.
        for t in range(1, n - 1):
            if torch.rand((), generator=g) < 0.3:
                mask[b, t] = 0.0
    # Row 0 always runs to the end with a two-token hole in the middle.
    mask[0] = 1.0
    mask[0, 3:5] = 0.0
    if empty_row:
        mask[batch // 2] = 0.0
    # Make sure the fixture really has holes (guards the tests' own premise).
    assert any(
        mask[b, t] == 0 and mask[b, t + 1:].sum() > 0 and mask[b, :t].sum() > 0
        for b in range(batch)
        for t in range(length)
    )
    return mask


def randn(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def rows(t):
    return t.tolist()


# ---------------------------------------------------------------------------
# Loop references
# ---------------------------------------------------------------------------


def ref_masked_mean_all(x, mask):
    s, n = 0.0, 0
    for xr, mr in zip(rows(x), rows(mask)):
        for xv, mv in zip(xr, mr):
            if mv:
                s += xv
                n += 1
    return s / n if n else 0.0


def ref_masked_var_all(x, mask, unbiased=True):
    vals = [xv for xr, mr in zip(rows(x), rows(mask)) for xv, mv in zip(xr, mr) if mv]
    n = len(vals)
    if n == 0 or (unbiased and n == 1):
        return 0.0
    mean = sum(vals) / n
    ss = sum((v - mean) ** 2 for v in vals)
    return ss / (n - 1) if unbiased else ss / n


def ref_whiten(x, mask, shift_mean=True):
    mean = ref_masked_mean_all(x, mask)
    var = ref_masked_var_all(x, mask, unbiased=True)
    out = []
    for xr, mr in zip(rows(x), rows(mask)):
        row = []
        for xv, mv in zip(xr, mr):
            if mv:
                w = (xv - mean) / math.sqrt(var + 1e-8)
                if not shift_mean:
                    w += mean
                row.append(w)
            else:
                row.append(0.0)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def ref_gae(rewards, values, mask, gamma, lam):
    """verl-style recursion with the (1 - mask) pass-through, written per element."""
    R, V, M = rows(rewards), rows(values), rows(mask)
    adv = [[0.0] * len(R[0]) for _ in R]
    for b in range(len(R)):
        nextvalue, lastgaelam = 0.0, 0.0
        for t in reversed(range(len(R[b]))):
            delta = R[b][t] + gamma * nextvalue - V[b][t]
            cand = delta + gamma * lam * lastgaelam
            m = M[b][t]
            nextvalue = V[b][t] * m + (1 - m) * nextvalue
            lastgaelam = cand * m + (1 - m) * lastgaelam
            adv[b][t] = lastgaelam
    ret = [[(adv[b][t] + V[b][t]) if M[b][t] else 0.0 for t in range(len(R[b]))] for b in range(len(R))]
    adv_t = torch.tensor(adv, dtype=torch.float64)
    return ref_whiten(adv_t, mask), torch.tensor(ret, dtype=torch.float64)


def ref_returns(rewards, mask, gamma):
    R, M = rows(rewards), rows(mask)
    out = [[0.0] * len(R[0]) for _ in R]
    for b in range(len(R)):
        running = 0.0
        for t in reversed(range(len(R[b]))):
            if M[b][t]:
                running = R[b][t] + gamma * running
                out[b][t] = running
    return torch.tensor(out, dtype=torch.float64)


def ref_group_adv(scores, groups, mask, kind, norm_by_std=True, eps=1e-6):
    S = scores.tolist()
    G = [int(g) for g in groups]
    adv = []
    for i, s in enumerate(S):
        members = [S[j] for j in range(len(S)) if G[j] == G[i]]
        n = len(members)
        if n == 1:
            a = 0.0
        elif kind == "grpo":
            mean = sum(members) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            a = (s - mean) / (std + eps) if norm_by_std else s - mean
        else:  # rloo
            a = s - (sum(members) - s) / (n - 1)
        adv.append(a)
    M = rows(mask)
    out = [[adv[b] if M[b][t] else 0.0 for t in range(len(M[b]))] for b in range(len(M))]
    return torch.tensor(out, dtype=torch.float64)


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    x = ref - lp
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


def ref_agg(loss, mask, mode):
    L, M = rows(loss), rows(mask)
    if mode == "token-mean":
        return ref_masked_mean_all(loss, mask)
    seq = []
    for lr, mr in zip(L, M):
        valid = [lv for lv, mv in zip(lr, mr) if mv]
        if not valid:
            continue
        seq.append(sum(valid) if mode == "seq-mean-token-sum" else sum(valid) / len(valid))
    return sum(seq) / len(seq) if seq else 0.0


def ref_policy_loss(old, new, adv, mask, lo, hi, c, mode):
    O, N, A, M = rows(old), rows(new), rows(adv), rows(mask)
    losses, n, nclip, nlower, kl = [], 0, 0, 0, 0.0
    for b in range(len(O)):
        row = []
        for t in range(len(O[b])):
            if not M[b][t]:
                row.append(0.0)
                continue
            r = math.exp(N[b][t] - O[b][t])
            a = A[b][t]
            l1 = -a * r
            l2 = -a * min(max(r, 1 - lo), 1 + hi)
            l = max(l1, l2)
            nclip += l2 > l1
            if c is not None and a < 0:
                l3 = -a * c
                nlower += l > l3
                l = min(l, l3)
            row.append(l)
            n += 1
            kl += O[b][t] - N[b][t]
        losses.append(row)
    loss = ref_agg(torch.tensor(losses, dtype=torch.float64), mask, mode)
    return loss, nclip / max(n, 1), nlower / max(n, 1), kl / max(n, 1)
