"""The strategies the benchmarks name in their comparisons, read from the classes (so a renamed
strategy is followed, and no name is spelled twice)."""

from torchacco.parallel.acco import ACCO as _ACCO
from torchacco.parallel.ddp import DDP as _DDP
from torchacco.parallel.dpu import DPU as _DPU
from torchacco.parallel.fsdp import FSDP as _FSDP
from torchacco.parallel.hsdp import HSDP as _HSDP
from torchacco.parallel.wp import WP as _WP
from torchacco.parallel.zero1 import ZeRO1 as _ZeRO1

DDP, ZERO1, FSDP, HSDP, ACCO, DPU, WP = (cls.name for cls in (_DDP, _ZeRO1, _FSDP, _HSDP, _ACCO, _DPU, _WP))
