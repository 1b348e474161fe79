"""Money in exact integers: a model's prices, a request's cost, and a budget's period.

Prices are micro-dollars (1e-6 USD) per 1M tokens, so `$0.15 / 1M` is 150000; a request's cost
is micro-dollars, rounded up once per request (never a float: sums of costs are exact). A batch
item's cost is cut by the price's batch discount, in basis points (5000 = 50 %). A model with no
price costs 0: budgets neither count nor refuse its requests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum

MICRO = 1_000_000  # micro-dollars per dollar
PER_TOKENS = 1_000_000  # prices are per this many tokens
FULL_BPS = 10_000  # 100 % in basis points
# The largest price and budget accepted (bounded at the edge: counters stay far from 2**63).
MAX_PRICE_MICRO = 1_000 * MICRO  # $1,000 per 1M tokens
MAX_BUDGET_MICRO = 10_000_000 * MICRO  # $10M per period


class BudgetScope(StrEnum):
    """Whose spend a budget bounds: the whole tenant's, one API key's, or one team's."""

    TENANT = "tenant"
    KEY = "key"
    TEAM = "team"


class BudgetPeriod(StrEnum):
    """A budget's window, in UTC: it starts again at midnight or on the 1st."""

    DAY = "day"
    MONTH = "month"


def period_key(period: BudgetPeriod, ts: datetime) -> str:
    """The window `ts` falls in: "2026-12-05" for a day, "2026-12" for a month (UTC)."""
    ts = ts.astimezone(UTC) if ts.tzinfo is not None else ts
    if period is BudgetPeriod.DAY:
        return f"{ts.year:04d}-{ts.month:02d}-{ts.day:02d}"
    return f"{ts.year:04d}-{ts.month:02d}"


def period_start(period: BudgetPeriod, ts: datetime) -> datetime:
    """The first moment (UTC) of the window `ts` falls in."""
    ts = ts.astimezone(UTC) if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    start = ts.replace(hour=0, minute=0, second=0, microsecond=0)
    return start if period is BudgetPeriod.DAY else start.replace(day=1)


@dataclass(frozen=True)
class Price:
    """A model's prices: micro-dollars per 1M tokens; `cached_input_micro` None is the input
    price; `batch_discount_bps` cuts batch items' cost (basis points)."""

    input_micro: int = 0
    output_micro: int = 0
    cached_input_micro: int | None = None
    batch_discount_bps: int = 0

    def _scaled(self, numerator: int, batch: bool) -> int:
        """`numerator` (micro-dollars x tokens / 1M) as micro-dollars, discounted, rounded up."""
        denominator = PER_TOKENS
        if batch and self.batch_discount_bps:
            numerator *= FULL_BPS - self.batch_discount_bps
            denominator *= FULL_BPS
        return -(-numerator // denominator)

    def cost(self, prompt: int, cached: int, completion: int, batch: bool = False) -> int:
        """Micro-dollars a request with these token counts costs (rounded up)."""
        cached = max(0, min(cached, prompt))
        cached_price = (
            self.input_micro if self.cached_input_micro is None else (self.cached_input_micro)
        )
        numerator = (
            (prompt - cached) * self.input_micro
            + cached * cached_price
            + completion * self.output_micro
        )
        return self._scaled(numerator, batch)

    def bound(self, tokens: int, batch: bool = False) -> int:
        """The most a request of at most `tokens` tokens (prompt and completion together) can
        cost: every token at the highest of the prices."""
        top = max(self.input_micro, self.output_micro, self.cached_input_micro or 0)
        return self._scaled(tokens * top, batch)


# A decimal string as a person writes an amount: ASCII digits, at most one point between
# digits. `Decimal` and `int` read more ("5_0" as 50, " 5", "5e1", "+5", other scripts' digits).
_PLAIN_DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?")


def plain_decimal(value: object, param: str, unit: str) -> Decimal:
    """A JSON number or a plain decimal string (`_PLAIN_DECIMAL`) as a `Decimal`; ValueError
    naming `param` otherwise (a boolean is not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{param} must be a number of {unit}")
    if isinstance(value, str) and not _PLAIN_DECIMAL.fullmatch(value):
        raise ValueError(
            f"{param} must be a plain decimal number of {unit} such as 12 or 0.15 (digits and "
            f"at most one point: no sign, exponent, underscore or space), got {value[:40]!r}"
        )
    return Decimal(str(value))


def parse_usd(value: object, param: str, maximum_micro: int) -> int:
    """A dollar amount (a number or a plain decimal string, at most 6 decimals) as
    micro-dollars, within 0..`maximum_micro`; ValueError naming `param` otherwise."""
    amount = plain_decimal(value, param, "dollars")
    try:
        if not amount.is_finite() or amount < 0:
            raise ValueError(f"{param} must be a finite amount of dollars, not negative")
        if amount > Decimal(maximum_micro) / MICRO:
            raise ValueError(f"{param} is above the maximum of {usd(maximum_micro)} dollars")
        micro = amount * MICRO
        fractional = micro != micro.to_integral_value()
    except ArithmeticError as exc:  # InvalidOperation, Overflow: not a usable amount
        raise ValueError(f"{param} must be a number of dollars, got {value!r}") from exc
    if fractional:
        raise ValueError(f"{param} has more than 6 decimals (the unit is a micro-dollar)")
    if micro > maximum_micro:
        raise ValueError(f"{param} is above the maximum of {usd(maximum_micro)} dollars")
    return int(micro)


def parse_percent_bps(value: object, param: str) -> int:
    """A percentage 0-100 with at most 2 decimals (a number or a plain decimal string) in basis
    points; ValueError naming `param` otherwise."""
    bps = plain_decimal(value, param, "percent") * 100
    if not bps.is_finite() or bps != bps.to_integral_value() or not 0 <= bps <= FULL_BPS:
        raise ValueError(f"{param} must be 0-100 with at most 2 decimals")
    return int(bps)


def usd(micro: int) -> str:
    """Micro-dollars as an exact decimal string of dollars: 1500000 -> "1.5"."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), MICRO)
    text = f"{whole}.{frac:06d}".rstrip("0").rstrip(".")
    return sign + text
