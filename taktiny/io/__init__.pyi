"""Safetensors files: write a model's state to one file or to indexed shards, open a
checkpoint by its headers, and stream one into a model tensor by tensor.

Every name is imported when it is first used (the stub beside this file lists each
once): opening a header imports no JAX. The load's names are `taktiny.loading`'s, kept
here, where users import them; `taktiny.loading` imports this package, never the reverse
(these four are imported only when first used)."""

from ..loading import LoadPlan as LoadPlan
from ..loading import PlannedStep as PlannedStep
from ..loading import load_safetensors as load_safetensors
from ..loading import plan_load as plan_load
from ._background import BackgroundSave as BackgroundSave
from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import open_safetensors as open_safetensors
from ._errors import SafetensorsError as SafetensorsError
from ._read import Tensor as Tensor
from ._save import save_safetensors as save_safetensors
from ._torch import read_torch as read_torch

"For Taktiny's own packages (importable, not public):"

from ._checkpoint import RETRIES as RETRIES
from ._checkpoint import schema_part as schema_part
from ._header import SCHEMA_KEY as SCHEMA_KEY
from ._object_commit import put_object as put_object
from ._object_store import MissingExtra as MissingExtra
from ._object_store import Replaced as Replaced
from ._object_store import Url as Url
from ._object_store import locate as locate
from ._orbax import OrbaxCheckpoint as OrbaxCheckpoint
from ._orbax import OrbaxError as OrbaxError
from ._orbax import is_orbax as is_orbax
from ._orbax import orbax_arrays as orbax_arrays
from ._orbax import orbax_items as orbax_items
from ._orbax import orbax_steps as orbax_steps
from ._read import BOX_PIECE as BOX_PIECE
from ._read import MAP_FLAGS as MAP_FLAGS
from ._read import aligned_buffer as aligned_buffer
from ._read import read_together as read_together
from ._save import byte_size as byte_size
from ._storage import OpenFile as OpenFile
from ._storage import Storage as Storage
from ._storage import open_storage as open_storage
from ._storage import read_range as read_range
from ._storage import stop_reads as stop_reads
from ._verify import verify as verify
from ._waits import result_of as result_of
