"""What a step costs, as the planner (`speculation.planner`) prices it: verification by
its rows and drafting by its levels, fitted from measured steps (`CostModel`), or the
verification alone for trees nobody drafts (`VerifyCosts`)."""
from __future__ import annotations


class WeightedLine:
    """y ≈ intercept + slope · x by least squares over exponentially weighted samples (each
    new one weight 1, the older ones multiplied by `decay` at every sample)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.sums = [0.0] * 5            # [w, wx, wy, wxx, wxy]

    def add(self, x: float, y: float) -> None:
        self.sums = [v * self.decay for v in self.sums]
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self.sums[i] += v

    def variance(self) -> float:
        """The weighted variance of the x seen (call with weight > 0)."""
        w, wx, _, wxx, _ = self.sums
        return (wxx * w - wx * wx) / (w * w)

    def slope(self, var: float) -> float:
        w, wx, wy, _, wxy = self.sums
        return (wxy * w - wx * wy) / (var * w * w)

    def intercept(self, slope: float) -> float:
        w, wx, wy, _, _ = self.sums
        return (wy - slope * wx) / w


class CostModel:
    """verify(rows) ≈ a + b · rows and draft(levels) ≈ d0 + d · levels, fitted by
    exponentially-weighted least squares; a prior until the first measurement,
    and b = slope_ratio · a while only one batch shape has been seen. A row count
    measured `measured` times (decayed) is priced at its own recent mean instead
    (`verify_time`): a verification's cost is not linear in its rows (the CPU's
    panel kernel takes up to 6 rows in one pass over the weights, 7 to 12 in two:
    1, 4 and 8 rows cost 8.8, 10.4 and 17.4 ms, whose line priced 2-4 rows ~15 % too
    dear, and the planner kept trees shallow after wide trees had run).

    The first `one_off` measurements of each batch shape (rows verified, levels
    drafted) are left out: those forwards pay one-off work — on a GPU Triton
    compiling for the shape, then a CUDA graph's capture (`models.cuda_graphs`: a
    key's first forward runs eagerly, its second captures; on an H200 a first 2-row
    verification took 413 ms against ~14 ms for one row): 2 there; on a CPU
    first-use weight packing: 1 — and with the fit's slow decay one such sample would
    misprice every plan for dozens of steps."""

    def __init__(self, a: float = 0.02, b: float = 0.002, d: float = 0.004,
                 decay: float = 0.98, slope_ratio: float = 0.1, overlap: bool = True,
                 one_off: int = 2) -> None:
        self.one_off = one_off           # first measurements of a shape left out
        self.decay = decay
        self.overlap = overlap           # drafting runs beside verification (async) or before it (sync)
        self.prior = (a, b)              # used until the first measurement
        self.slope_ratio = slope_ratio   # b / a assumed while the data cannot tell the slope
        self._verify = WeightedLine(decay)   # verify seconds = a + b · rows
        # the draft's cost per level, the prior until measured; its setter starts `_draft`,
        # the fit of draft seconds = d0 + d · levels
        self.d = d
        # seconds a speculating step waits for its trees beyond the forward, on average (overlap
        # only: trees late after a contradicted outcome or a switch from decoding alone, the
        # exchange's latency); a cost per step, not per row
        self.wait = 0.0
        self._seen_rows: dict[int, int] = {}     # batch shape -> its one-off costs skipped so far
        self._by_rows: dict[int, list[float]] = {}   # rows -> [decayed count, decayed seconds]
        self.measured = 3.0                      # decayed count from which a row count's mean holds
        self._seen_levels: dict[int, int] = {}

    def observe_verify(self, rows: int, seconds: float) -> None:
        if self._seen_rows.get(rows, 0) < self.one_off:
            self._seen_rows[rows] = self._seen_rows.get(rows, 0) + 1
            return
        self._verify.add(float(rows), seconds)
        n, total = self._by_rows.get(rows, (0.0, 0.0))
        self._by_rows[rows] = [n * self.decay + 1.0, total * self.decay + seconds]

    def verify_time(self, rows: float) -> float:
        """Seconds a verification of `rows` costs: each neighbouring whole row count's own mean
        where measured, else the fitted line, interpolated for averaged (fractional) rows."""
        a, b = self.coefficients

        def at(r: int) -> float:
            n, total = self._by_rows.get(r, (0.0, 0.0))
            return total / n if n >= self.measured else a + b * r

        lo = int(rows)
        if rows == lo:
            return at(lo)
        f = rows - lo
        return (1.0 - f) * at(lo) + f * at(lo + 1)

    @property
    def observed(self) -> bool:
        """Whether any verification has been measured (else `coefficients` is the prior)."""
        return self._verify.sums[0] > 0

    def observe_draft(self, levels: int, seconds: float) -> None:
        if levels > 0 and self._seen_levels.get(levels, 0) < self.one_off:
            self._seen_levels[levels] = self._seen_levels.get(levels, 0) + 1
            return
        if levels > 0:
            self._draft.add(levels, seconds)

    @property
    def d(self) -> float:
        return self.draft_coefficients[1]

    @d.setter
    def d(self, value: float) -> None:
        """A new prior per level; what was measured is forgotten."""
        self._d_prior, self._draft = value, WeightedLine(0.8)

    @property
    def draft_coefficients(self) -> tuple[float, float]:
        """(d0, d): a tree's draft costs d0 + d · levels, fitted by least squares with recent
        trees weighted most; d0 = 0 until two depths have been seen (all of it per level). In
        lockstep the wait for a tree has a fixed part (the exchange both ways, ~2-5 ms on this
        project's CPU): priced per level it made shallow trees look dear per level, and the
        planner kept trees shallow."""
        line = self._draft
        w, wx, wy, _, _ = line.sums
        if w <= 0:
            return 0.0, self._d_prior
        var = line.variance()
        if var < 0.25:
            return 0.0, max(wy / wx, 1e-6)
        d = max(line.slope(var), 1e-6)
        return max(line.intercept(d), 0.0), d

    def observe_wait(self, seconds: float) -> None:
        """A speculating step (a tree, a bridge or a fallback while a budget was planned) waited
        `seconds` for trees before it."""
        self.wait = 0.8 * self.wait + 0.2 * seconds

    @property
    def coefficients(self) -> tuple[float, float]:
        line = self._verify
        w, wx, wy, _, _ = line.sums
        if w <= 0:
            return self.prior
        var = line.variance()                          # of the row counts
        if var < 0.25:   # one batch shape seen so far: keep the level, assume the slope ratio
            r = self.slope_ratio
            a = max(wy / w / (1.0 + r * wx / w), 1e-6)
            return a, r * a
        b = max(line.slope(var), 0.0)
        a = max(line.intercept(b), 1e-6)
        return a, b

    def step_time(self, rows: float, max_levels: int) -> float:
        verify = self.verify_time(rows)
        d0, d = self.draft_coefficients
        draft = d0 + d * max_levels if max_levels > 0 else 0.0
        if self.overlap:
            return max(verify, draft) + (self.wait if max_levels > 0 else 0.0)
        return verify + draft


def one_off_costs(model) -> int:
    """How many first costs of a batch shape to leave out on `model`'s device: 2 on a GPU
    (compile, then graph capture), 1 on a CPU (weight packing)."""
    return 2 if model.embed_tokens.weight.device.type == "cuda" else 1


class VerifyCosts:
    """The verify half of a CostModel alone: what a step of trees nobody had to draft
    costs (the verifier's own prompt-lookup chains), for an `overlap=False` planner."""

    overlap = False

    def __init__(self, model: CostModel) -> None:
        self.model = model

    def step_time(self, rows: float, max_levels: int) -> float:
        return self.model.verify_time(rows)
