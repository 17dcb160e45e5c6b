"""Pure-Python-int reference of the n-gram hash, shared by the tests (no numpy, no package code)."""


def to_signed(u: int) -> int:
    u &= (1 << 64) - 1
    return u - (1 << 64) if u >= (1 << 63) else u


def py_rows(ids, lookup, pad, mult, primes_by_order, dead_id=None):
    """Head-local rows with Python ints only: list[B][T][H].

    dead_id (deepseek-v4.1): ids equal to it, negative ids and positions before the start
    are DEAD; reading back from t, the first DEAD one and everything older read pad."""
    mult = [to_signed(int(m)) for m in mult]
    n_max = len(mult)

    def comp(i):
        return i if (i < 0 or lookup is None) else int(lookup[i])

    out = []
    for row in ids:
        c = [comp(int(i)) for i in row]
        r_out = []
        for t in range(len(c)):
            if dead_id is None:
                w = [c[t - k] if t - k >= 0 else pad for k in range(n_max)]
            else:
                w, blocked = [], False
                for k in range(n_max):
                    blocked = blocked or t - k < 0 or int(row[t - k]) < 0 or int(row[t - k]) == dead_id
                    w.append(pad if blocked else c[t - k])
            heads = []
            for n in range(2, n_max + 1):
                mix = 0
                for k in range(n):
                    mix ^= to_signed(w[k] * mult[k])        # two's complement bits, signed view
                mix = to_signed(mix)
                heads += [mix % p for p in primes_by_order[n - 2]]   # Python % is floored
            r_out.append(heads)
        out.append(r_out)
    return out
