"""What both reports (`skip_report`'s and `find_overflow`'s) write the same
way: one line width, scales, numbers, counts, and float16's limits."""

import math
import textwrap

# The width of every report's text, for a terminal and a notebook alike; a
# docstring's example output, indented by 4, then keeps to 80 columns.
WIDTH = 76

# float16's limits (IEEE 754 binary16).
FLOAT16_MAX = 65504.0  # the largest finite number
FLOAT16_SMALLEST = 2.0**-24  # the smallest positive (subnormal) number


def wrap(
  text: str,
  indent: str = "",
  hanging: str | None = None,
  width: int = WIDTH,
) -> list[str]:
  """`text` as lines of at most `width` characters, the first indented by
  `indent` and the rest by `hanging` (default `indent`). Words (scope names,
  paths, code) are never broken, not even at hyphens: a word longer than a
  line stands on a line of its own.

  >>> wrap("a b c", indent="- ", hanging="  ", width=5)
  ['- a b', '  c']
  """
  return textwrap.wrap(
    text,
    width,
    initial_indent=indent,
    subsequent_indent=indent if hanging is None else hanging,
    break_long_words=False,
    break_on_hyphens=False,
  ) or [indent.rstrip()]


def exponent_of_two(x: float) -> int | None:
  """`k` where `x == 2**k` exactly, else None.

  >>> exponent_of_two(32768.0), exponent_of_two(0.25), exponent_of_two(3.0)
  (15, -2, None)
  """
  if not (x > 0 and math.isfinite(x)):
    return None
  mantissa, exponent = math.frexp(x)
  return exponent - 1 if mantissa == 0.5 else None


def number(x: float) -> str:
  """`32768`, `0.5`, `3.4e+38`: short, and exact where it is an integer.

  >>> number(32768.0), number(0.5), number(1e39), number(float("nan"))
  ('32768', '0.5', '1e+39', 'nan')
  """
  if math.isfinite(x) and x == int(x) and abs(x) < 1e15:
    return str(int(x))
  return f"{x:.6g}"


def scale(x: float) -> str:
  """A loss scale: `2**15` for a power of two, except the few that read
  best as they are (0.125 to 8); else the number.

  >>> scale(32768.0), scale(2.0**-10), scale(1.0), scale(0.5), scale(1e3)
  ('2**15', '2**-10', '1', '0.5', '1000')
  """
  exponent = exponent_of_two(x)
  if exponent is None or abs(exponent) <= _PLAIN_EXPONENTS:
    return number(x)
  return f"2**{exponent}"


# Powers of two from 2**-3 to 2**3 are written as numbers: `2`, not `2**1`.
_PLAIN_EXPONENTS = 3


def scale_with_value(x: float) -> str:
  """A loss scale with its value beside a power of two: `2**24
  (16777216)`; what `scale` writes as a number, as it is.

  >>> scale_with_value(2.0**24), scale_with_value(1.0), scale_with_value(3.0)
  ('2**24 (16777216)', '1', '3')
  """
  written = scale(x)
  if written.startswith("2**"):
    return f"{written} ({number(x)})"
  return written


def count(n: int, noun: str, plural: str | None = None) -> str:
  """`1 step`, `2 steps`; `plural` where adding an s is not it.

  >>> count(1, "step"), count(0, "step"), count(3, "parameter")
  ('1 step', '0 steps', '3 parameters')
  """
  return f"{n} {noun if n == 1 else plural or noun + 's'}"


def share(part: int, whole: int) -> str:
  """`part` of `whole` as a whole percentage (`0%` of nothing).

  >>> share(1, 3), share(0, 0)
  ('33%', '0%')
  """
  return f"{part / max(whole, 1):.0%}"


def percent(fraction: float) -> str:
  """A small share, to two decimals: `0%`, `<0.01%`, `1.25%`.

  >>> percent(0.0), percent(1e-6), percent(0.0125)
  ('0%', '<0.01%', '1.25%')
  """
  if fraction == 0:
    return "0%"
  if fraction < 0.0001:
    return "<0.01%"
  return f"{100 * fraction:.2f}%"


def names(items: list[str], shown: int) -> str:
  """Back-quoted names joined by commas, at most `shown` of them.

  >>> names(["a", "b", "c"], 2)
  '`a`, `b` and 1 more'
  """
  text = ", ".join(f"`{item}`" for item in items[:shown])
  if len(items) > shown:
    text += f" and {len(items) - shown} more"
  return text
