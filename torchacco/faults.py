"""Fault injection, to test recovery the way it happens: `TORCHACCO_FAULT=kill@rank1:step5`.

Comma-separated faults, each `WHAT@rankR:stepS[:periodP]`:
- `kill`: the rank SIGKILLs itself as it starts computing step S (a lost worker);
- `nan`: the rank's loss is NaN for the compute period(s) of step S (period P only, counted from 1
  within the step: ACCO computes each step in two periods, the estimate's and the commit's).
Faults fire on the first launch attempt only, so a restarted run goes on as if nothing happened.
"""

from __future__ import annotations

import os
import re
import signal

from torchacco.errors import UserError

FAULT = re.compile(r"^(kill|nan)@rank(\d+):step(\d+)(?::period(\d+))?$")


class Faults:
    def __init__(self, spec: str, rank: int, attempt: int):
        self.faults = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            m = FAULT.match(item)
            if not m:
                raise UserError(
                    f"TORCHACCO_FAULT: cannot parse {item!r}; expected e.g. kill@rank1:step5 or nan@rank0:step3:period1"
                )
            what, r, step, period = m.groups()
            if int(r) == rank and attempt == 0:
                self.faults.append((what, int(step), int(period) if period else None))
        self._step, self._period = None, 0

    def before_period(self, step: int) -> bool:
        """Called as each compute period starts; True when this period's loss must be NaN."""
        self._period = self._period + 1 if step == self._step else 1
        self._step = step
        poison = False
        for what, at, period in self.faults:
            if at == step and period in (None, self._period):
                if what == "kill":
                    from torchacco import health

                    health.current().flush()  # so the survivors can tell where this rank died
                    os.kill(os.getpid(), signal.SIGKILL)
                poison = True
        return poison


def from_env(rank: int) -> Faults:
    return Faults(os.environ.get("TORCHACCO_FAULT", ""), rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
