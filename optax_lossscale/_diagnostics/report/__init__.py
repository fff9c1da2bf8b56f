"""The skip report, by its jobs: reading the recorded facts (`facts`), the
diagnosis's predicates (`diagnosis`) and `raise_if_stuck`'s (`stuck`), the
text's layout (`text`), and the public calls (`api`)."""

from optax_lossscale._diagnostics.report.api import SkipReport as SkipReport
from optax_lossscale._diagnostics.report.api import (
  raise_if_stuck as raise_if_stuck,
)
from optax_lossscale._diagnostics.report.api import skip_report as skip_report
