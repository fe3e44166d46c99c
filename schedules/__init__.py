"""Schedule rules, one kernel family per file: `rule.apply(op_or_spec, target, knobs) -> Kernel | None`.

Importing this package does not import TVM; a rule imports it when it builds a kernel.
"""

from .argmax import ArgmaxRule
from .attention import AttentionRule
from .attention_mma import AttentionMmaRule
from .attention_wgmma import AttentionWgmmaRule
from .base import FamilyRule, Kernel, KernelSpec, OpInstance, Param, Rule, ScheduleError, apply_rules
from .dflash2 import DFlash2Rule
from .dspark import DSparkRule
from .elementwise import ElementwiseRule
from .embed import EmbedRule
from .head_norm_rope import HeadNormRopeRule
from .head_prep import HeadPrepRule
from .kv_write import KVWriteRule
from .linear_rules import LinearArgmaxRule, LinearGemvRule, LinearMmaRule, LinearSiluRule
from .rmsnorm import RMSNormRule, RMSNormSpec, rmsnorm_func, rmsnorm_kernel

# Tried in order by `apply_rules`. Families do not overlap except the linears and the attention: the
# tensor-core rules take the shapes they can tile (warpgroup MMAs first, where the target has them), and
# the SIMT kernel (correct for any shape) takes the rest.
RULES: tuple[Rule, ...] = (
    RMSNormRule(),
    LinearMmaRule(),
    LinearArgmaxRule(),
    LinearSiluRule(),
    LinearGemvRule(),
    AttentionWgmmaRule(),
    AttentionMmaRule(),
    AttentionRule(),
    KVWriteRule(),
    HeadNormRopeRule(),
    HeadPrepRule(),
    ElementwiseRule(),
    EmbedRule(),
    ArgmaxRule(),
    DFlash2Rule(),
    DSparkRule(),
)

__all__ = [
    "RULES",
    "ArgmaxRule",
    "AttentionMmaRule",
    "AttentionRule",
    "AttentionWgmmaRule",
    "DFlash2Rule",
    "DSparkRule",
    "ElementwiseRule",
    "EmbedRule",
    "FamilyRule",
    "HeadNormRopeRule",
    "HeadPrepRule",
    "KVWriteRule",
    "Kernel",
    "KernelSpec",
    "LinearArgmaxRule",
    "LinearGemvRule",
    "LinearMmaRule",
    "LinearSiluRule",
    "OpInstance",
    "Param",
    "RMSNormRule",
    "RMSNormSpec",
    "Rule",
    "ScheduleError",
    "apply_rules",
    "rmsnorm_func",
    "rmsnorm_kernel",
]
