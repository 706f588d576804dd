"""Naming, reading and loading the leaves of any tree: flat names, name patterns, the two
views of a tree, resolution of names to leaves, value checks, other representations, the
load itself and its problems with `StateDictError`, and a selection's with
`SelectionError`. The design note is `_state.md` beside this file. Other packages import
through this face; the public names are re-exported by ``taktiny``. Each name is imported
when first used, so that a process reading only safetensors headers never imports JAX."""

from .._problems import StateProblem as StateProblem
from . import _problems as problems  # noqa: F401  # pyright: ignore[reportUnusedImport] (a namespace: the problem records)
from ._layers import Layers as Layers
from ._layers import layer_sharded as layer_sharded
from ._layers import layer_sharding as layer_sharding
from ._layers import layer_slice as layer_slice
from ._layers import other_forms as other_forms
from ._names import Spec as Spec
from ._names import Stacked as Stacked
from ._names import customs as customs
from ._names import fields as fields
from ._names import flatten as flatten
from ._names import is_flat as is_flat
from ._names import is_stack as is_stack
from ._names import key_name as key_name
from ._names import params as params
from ._patterns import Match as Match
from ._patterns import Rules as Rules
from ._patterns import compile_pattern as compile_pattern
from ._patterns import match as match
from ._patterns import part_regex as part_regex
from ._patterns import rule_list as rule_list
from ._patterns import select as select
from ._problems import StateDictError as StateDictError
from ._schema import FORMAT as FORMAT
from ._schema import KEY as KEY
from ._schema import KINDS as KINDS
from ._schema import Schema as Schema
from ._schema import declared_versions as declared_versions
from ._schema import leaf_entry as leaf_entry
from ._schema import recorded_versions as recorded_versions
from ._schema import schema as schema
from ._schema import schema_of as schema_of
from ._selection import SelectionError as SelectionError
from ._selection import rule_problems as rule_problems
from ._selection import unmatched as unmatched
from ._selection import unreached as unreached
from ._selection import unused_hint as unused_hint
from ._stacker import Stacker as Stacker
from ._stacker import on_host as on_host
from ._stacker import zeros_on as zeros_on
from ._state import load_resolved as load_resolved
from ._state import resolve_sources as resolve_sources
from ._state import unfilled as unfilled
from ._tree import by_name as by_name
from ._tree import flat_state_dict as flat_state_dict
from ._tree import load_flat_state_dict as load_flat_state_dict
from ._tree import load_state_dict as load_state_dict
from ._tree import state_dict as state_dict
from ._values import checked_value as checked_value
from ._values import dtype_of as dtype_of
from ._values import host_array as host_array
from ._values import kind as kind
from ._values import placeable as placeable
from ._views import Flat as Flat
from ._views import Walk as Walk
