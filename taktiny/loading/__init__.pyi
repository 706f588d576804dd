"""The load: a safetensors checkpoint streamed into a model, and its plan. The one room
that joins the file format (`taktiny.io`), the conversion rules (`taktiny.convert`) and
the state walk (`taktiny.state`); its public names are `taktiny.io`'s
(``taktiny.io.load_safetensors``, ``taktiny.io.plan_load``)."""

from ._load import load_safetensors as load_safetensors
from ._plan_load import LoadPlan as LoadPlan
from ._plan_load import PlannedStep as PlannedStep
from ._plan_load import plan_load as plan_load

"For Taktiny's own packages (importable, not public):"

from ._plan_load import planned as planned
