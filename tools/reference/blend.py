"""composer's token-file sampling, written from docs/configuration.md (Packed documents, Blended
sources) without composer's code: which file and window each global sample index reads, and where each
token's document begins.

    blend_source(seed, g, weights): the file of sample g
    token_window(seed, g, positions): the window start of sample g in a file with `positions` starts
    doc_start_eos(window, eos_id) / doc_start_index(ends, start, length): a window's doc_start row
"""
import bisect

MASK64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_window(seed, g, positions):
    """Where sample g starts: splitmix64(splitmix64(seed ^ "tokens") ^ g) modulo positions."""
    return splitmix64(splitmix64(seed ^ 0x746F6B656E73) ^ g) % positions


def blend_source(seed, g, weights):
    """The first source i with u < (w0 + .. + wi) / (w0 + .. + wn-1), u = the top 53 bits of
    splitmix64(splitmix64(seed ^ "blend") ^ g) times 2^-53 (running sums in float64, in list order)."""
    u = (splitmix64(splitmix64(seed ^ 0x626C656E64) ^ g) >> 11) * 2.0 ** -53
    cumulative, total = [], 0.0
    for w in weights:
        total += float(w)
        cumulative.append(total)
    for i, c in enumerate(cumulative):
        if u < c / total:
            return i
    return len(weights) - 1


def doc_start_eos(window, eos_id):
    """Each token's document start in the window: 0 for the first, k after an eos_id at k-1."""
    out = []
    for k in range(len(window)):
        out.append(0 if k == 0 else (k if window[k - 1] == eos_id else out[-1]))
    return out


def doc_start_index(ends, start, length):
    """The same by a document index (each document's exclusive end offset in the file): the start of
    the document each of the `length` tokens from `start` is in, counted from `start`, at least 0."""
    out = []
    for k in range(length):
        d = bisect.bisect_right(ends, start + k)  # documents that ended at or before this token
        out.append(max((ends[d - 1] if d else 0) - start, 0))
    return out
