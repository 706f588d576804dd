"""The load: a safetensors checkpoint streamed into a model, and its plan. The one room
that joins the file format (`taktiny.io`), the conversion rules (`taktiny.convert`) and
the state walk (`taktiny.state`); its public names are `taktiny.io`'s
(``taktiny.io.load_safetensors``, ``taktiny.io.plan_load``)."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())
