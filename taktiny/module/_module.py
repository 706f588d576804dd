"""`Module`: immutable PyTree modules with attribute-style construction.

A subclass either declares its fields with annotations (and gets a generated
``__init__``) or assigns attributes in its own ``__init__``. When ``__init__``
returns, every attribute is sorted into *data* (a PyTree child) or *static*
(part of the tree structure), the instance is checked and frozen, and its class is
set to a node type registered with JAX as a dataclass node, so that ``jax.jit``
flattens it in C++ (see ``_module.md`` beside this file).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Mapping
from typing import Any, ClassVar, dataclass_transform

import equinox as eqx
import jax
import jax.numpy as jnp
import wadler_lindig as wl
from jax.core import Tracer

from ..arrays import ARRAY_TYPES, SCALARS
from ..state import flat_state_dict as tree_flat_state_dict
from ..state import load_flat_state_dict as tree_load_flat_state_dict
from ..state import load_state_dict as tree_load_state_dict
from ..state import state_dict as tree_state_dict
from . import _field_checks
from ._fields import MISSING, Field, declared_fields, field, generated_init
from ._rngs import Rngs

_INITIALISING: set[int] = set()  # ids of instances whose __init__ is running
Layout = tuple[tuple[str, bool], ...]  # (field name, is data) in attribute order
_NODE_TYPES: dict[tuple[type, Layout], type] = {}  # kept outside the classes: see _module.md


def _is_module_or_array(x: Any) -> bool:
    return isinstance(x, (Module, *ARRAY_TYPES))


def _as_arrays(value: Any) -> Any:
    """`value` with its Python numbers made JAX arrays (of JAX's default dtype for them), so
    that the state holds arrays only."""
    leaves = jax.tree_util.tree_leaves(value, is_leaf=_is_module_or_array)
    if not any(type(leaf) in SCALARS for leaf in leaves):
        return value
    convert = lambda x: (
        jnp.asarray(x, jax.dtypes.canonicalize_dtype(type(x))) if type(x) in SCALARS else x
    )
    return jax.tree_util.tree_map(convert, value, is_leaf=_is_module_or_array)


def _classify(
    obj: Module, owner: str, name: str, value: Any, spec: Field | None
) -> tuple[bool, Any]:
    """Whether `value` (field `name` of `obj`) is data (a PyTree child), and the value to
    store; raises on values that can be neither, or that would silently lose parameters."""
    if isinstance(value, Rngs):
        raise TypeError(
            f"{owner}.{name} holds an nn.Rngs. Rngs is a construction-time key stream and must "
            f"not be stored in a module: draw the keys you need in __init__ (key = rngs()) and "
            f"pass randomness at call time with an explicit `key=` argument."
        )
    static = None if spec is None else spec.static
    path_leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_module_or_array)[0]
    holds_data = value is None or any(_is_module_or_array(leaf) for _, leaf in path_leaves)
    if static is True and holds_data and value is not None:
        raise TypeError(
            f"{owner}.{name} is declared static but holds an array or module. Static fields "
            f"are part of the tree structure and must be plain configuration; remove "
            f"`static=True` to make it a parameter, or store a Python value instead."
        )
    if static is False:
        return True, _as_arrays(value)
    if static is True or not holds_data:
        if spec is not None and not spec.trainable:
            raise TypeError(
                f"{owner}.{name} is declared trainable=False but holds {value!r:.60}, which is "
                f"static configuration: only arrays can be kept from training. Store an array, "
                f"or drop trainable=False."
            )
        for _, leaf in path_leaves:
            _field_checks.hidden_module(owner, name, leaf, obj, Module)
        return False, value
    for path, leaf in path_leaves:
        where = f"{owner}.{name}{jax.tree_util.keystr(path)}"
        if not _is_module_or_array(leaf):
            raise TypeError(
                f"{where} is {leaf!r}, beside arrays or modules in the same container. A list, "
                f"tuple or dict that holds arrays or modules becomes part of the state, so every "
                f"value in it must be an array, a module or None. Keep configuration in its own "
                f"field, or wrap a function as a module with nn.Lambda(fn)."
            )
        _field_checks.dict_keys(owner, name, path)
    return True, value


class _Untrained:
    """How a node class reads a data field declared ``trainable=False``: through
    ``jax.lax.stop_gradient`` while it holds traced values, so that no gradient flows into
    it however the module's code uses it; as it is otherwise. A data descriptor, so it
    also serves JAX's flatten (which reads fields with getattr); the node class's
    constructor writes ``__dict__`` directly, so unflattening is unchanged."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name]
        if isinstance(value, Tracer):
            return jax.lax.stop_gradient(value)
        if isinstance(value, ARRAY_TYPES) or value is None:
            return value
        stop = lambda x: jax.lax.stop_gradient(x) if isinstance(x, Tracer) else x
        return jax.tree_util.tree_map(stop, value)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__setattr__(self.name, value)  # Module.__setattr__: frozen


class _NodeTag:
    """The last meta value of every node a node class flattens to: one per node class,
    equal only to itself, shown as ``<ClassName>`` in a PyTreeDef. JAX 0.10 compares
    dataclass nodes without their class; this keeps two classes' structures unequal (see
    ``_module.md``, "A meta value of its own")."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _node_type(base: type[Module], layout: Layout) -> type[Module]:
    """The class that instances of `base` with `layout` take once built: a subclass of the same
    name registered with JAX as a dataclass node, one per layout of the fields.

    JAX rebuilds a node by calling its class with the fields as keywords. For these classes
    that call runs entirely in C (``type.__call__`` and ``SimpleNamespace.__init__``), never
    the user's ``__init__``, which makes unflattening (every load, every jit output) cheap.
    """
    node_type = _NODE_TYPES.get((base, layout))
    if node_type is None:
        namespace = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "__init__": types.SimpleNamespace.__init__,
            "_taktiny_layout": layout,
            "_taktiny_data": tuple(name for name, is_data in layout if is_data),
            "_taktiny_node": _NodeTag(base.__name__),
        }
        fields = base._taktiny_fields
        for name, is_data in layout:
            if is_data and not getattr(fields.get(name), "trainable", True):
                namespace[name] = _Untrained(name)
        node_type: Any = _NodeMeta(base.__name__, (base,), namespace)  # pyright: ignore[reportCallIssue]
        meta = [name for name, is_data in layout if not is_data]
        jax.tree_util.register_dataclass(
            node_type, list(namespace["_taktiny_data"]), [*meta, "_taktiny_node"]
        )
        _NODE_TYPES[(base, layout)] = node_type
    return node_type


def _rebuild(base: type[Module], layout: Layout, values: dict[str, Any]) -> Module:
    """Unpickles a module (see `Module.__reduce__`)."""
    return _node_type(base, layout)(**values)


def _new_items(old: Any, new: Any) -> tuple[list[Any], list[Any]] | None:
    """For a container `new` of the same type and size (or keys) as `old`: the items that are
    not the ones `old` holds at the same place, and those that are; None otherwise."""
    if type(new) is not type(old):
        return None
    if isinstance(new, (list, tuple)) and len(new) == len(old):
        pairs = list(zip(new, old, strict=True))
    elif isinstance(new, dict) and new.keys() == old.keys():
        pairs = [(new[key], old[key]) for key in new]
    else:
        return None
    return [n for n, o in pairs if n is not o], [n for n, o in pairs if n is o]


def finalise(
    obj: Module, changed: Mapping[str, Any] | None = None, previous: Mapping[str, Any] | None = None
) -> Module:
    """Sorts the attributes of a freshly built `obj` into data and static, checks them, and
    sets its class to the node type registered for that layout. For a `replace`, only the
    `changed` fields are sorted again (the others keep their place in the layout, and
    `previous` holds their values before); a list, tuple or dict field that only swaps
    some items for arrays or modules has only those items checked."""
    base = type(obj)._taktiny_base
    values: dict[str, Any] = obj.__dict__  # pyright: ignore[reportAssignmentType]
    fields = base._taktiny_fields
    if changed is None:
        for name, spec in fields.items():
            if name not in values:
                if spec.default_factory is not MISSING:
                    values[name] = spec.default_factory()
                elif spec.default is not MISSING:
                    values[name] = spec.default
                else:
                    raise TypeError(
                        f"{base.__name__}.__init__ did not set the declared field {name!r}; "
                        f"assign it (self.{name} = ...) or give it a default."
                    )
        if clash := sorted(_RESERVED.intersection(values)):
            raise TypeError(
                f"{base.__name__} has a field named {clash[0]!r}, which would hide the Module "
                f"attribute of that name; rename the field."
            )
        old: dict[str, bool] = {}
    else:
        old = dict(type(obj)._taktiny_layout)
    layout = []
    new, kept = [], []  # for a replace: what is new (searched whole), what was there before
    for name, value in values.items():
        if changed is not None and name not in changed:
            layout.append((name, old[name]))
            kept.append(value)
            continue
        spec = fields.get(name)
        items = _new_items(previous[name], value) if previous and old.get(name) else None
        forced = spec is not None and spec.static is False
        if items is not None and not forced and all(map(_is_module_or_array, items[0])):
            # some items of a container swapped for arrays or modules: check those (one
            # swapped for None may leave no data, so the field is sorted again below)
            layout.append((name, True))
            new += items[0]
            kept += items[1]
            continue
        is_data, values[name] = _classify(obj, base.__name__, name, value, spec)
        layout.append((name, is_data))
        new.append(values[name])
    object.__setattr__(obj, "__class__", _node_type(base, tuple(layout)))
    _field_checks.ties(obj, base.__name__, None if changed is None else (new, kept))
    return obj


@dataclass_transform(field_specifiers=(field,))
class _ModuleMeta(type):
    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kw: Any):
        cls: Any = super().__new__(mcs, name, bases, namespace, **kw)
        cls._taktiny_base = cls
        cls._taktiny_fields = declared_fields(cls, namespace)
        inherited = cls.__init__
        if "__init__" not in namespace and (
            getattr(inherited, "_taktiny_generated", False) or inherited is _MODULE_INIT
        ):
            cls.__init__ = generated_init(cls, cls._taktiny_fields)
        elif hasattr(cls, "__post_init__"):
            raise TypeError(
                f"{name} has both its own __init__ and a __post_init__, which would never run: "
                f"__post_init__ only follows the __init__ that Taktiny generates from declared "
                f"fields. Move its body to the end of __init__, or drop the custom __init__."
            )
        return cls

    @property
    def __signature__(cls) -> inspect.Signature:
        """The constructor's parameters, without ``self``: what ``inspect.signature``,
        ``help()``, IDEs and notebooks show for the class (without this they would show
        this metaclass's ``__call__``, ``(*args, **kwargs)``)."""
        init = inspect.signature(cls.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj: Any = types.SimpleNamespace.__new__(cls)
        _INITIALISING.add(id(obj))
        try:
            cls.__init__(obj, *args, **kwargs)
        finally:
            _INITIALISING.discard(id(obj))
        return finalise(obj)


class _NodeMeta(_ModuleMeta):
    """The metaclass of the registered node classes: calling one rebuilds a node (in C)."""

    __call__ = type.__call__  # pyright: ignore[reportAssignmentType]

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kw: Any):
        if "_taktiny_layout" not in namespace:
            raise TypeError(
                f"cannot subclass {bases[0].__name__} as type(module) gives it: subclass the "
                f"class you defined instead (type(module).__mro__[1])."
            )
        cls: Any = type.__new__(mcs, name, bases, namespace, **kw)
        cls._taktiny_base = bases[0]
        return cls


def fields_of(module: Module) -> dict[str, Any]:
    """A built module's fields, in attribute order."""
    values = module.__dict__
    return {name: values[name] for name, _ in type(module)._taktiny_layout}


class Module(types.SimpleNamespace, metaclass=_ModuleMeta):
    """Base class of every Taktiny layer and model: an immutable PyTree.

    Arrays, modules, ``None`` and lists/tuples/dicts holding them are data (the
    PyTree's children, and what the state dict holds); every other attribute
    (ints, floats, strings, dtypes, functions, config objects) is static and is
    kept in the tree structure. Declare fields with annotations, or assign them
    in ``__init__``; ``field(static=..., trainable=...)`` forces either side or keeps
    a field from training. After ``__init__`` the instance is frozen: use
    :meth:`replace` for a changed copy.
    """

    _taktiny_base: ClassVar[type[Module]]
    _taktiny_fields: ClassVar[dict[str, Field]]
    _taktiny_layout: ClassVar[Layout] = ()
    # the data fields' names, in layout order: how the state walk (`state/_names`) knows a
    # module without importing this file
    _taktiny_data: ClassVar[tuple[str, ...]] = ()
    # each node class's own meta value, which keeps its structures apart from other classes'
    _taktiny_node: ClassVar[_NodeTag | None] = None

    def __init__(self) -> None:
        """Subclasses assign their fields here, or declare them with annotations."""

    __eq__ = object.__eq__  # identity, as for any object (SimpleNamespace compares fields)
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # pyright: ignore[reportAssignmentType]

    def __setattr__(self, name: str, value: Any) -> None:
        if id(self) not in _INITIALISING:
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: modules are immutable once built. "
                f"Make a changed copy instead: `module = module.replace({name}=value)`, or for a "
                f"nested value `module = eqx.tree_at(lambda m: m.{name}, module, value)`."
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if id(self) not in _INITIALISING:
            raise dataclasses.FrozenInstanceError(
                f"cannot delete {type(self).__name__}.{name}: modules are immutable once built."
            )
        object.__delattr__(self, name)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (and deep-copies) a module by its class as defined, its layout and its
        fields; unpickling takes the registered node class for that layout."""
        node = type(self)
        return _rebuild, (node._taktiny_base, node._taktiny_layout, fields_of(self))

    def replace(self, **changes: Any) -> Any:
        """Returns a copy of this module with the given fields replaced.

        The new values are checked as in a newly built module (sorted into data and
        static); the other fields are reused as they are. This module is not changed.

        Args:
            **changes: new values by field name (``kernel=new_kernel``).

        Returns:
            A new module of the same class.

        Raises:
            TypeError: a name is not a field of this module, or a value is one a module
                refuses to hold (as when it is built).
        """
        fields = fields_of(self)
        if unknown := sorted(changes.keys() - fields.keys()):
            raise TypeError(
                f"{type(self).__name__}.replace() got unknown field(s) {unknown}; "
                f"its fields are {list(fields)}."
            )
        obj: Any = types.SimpleNamespace.__new__(type(self))
        obj.__dict__.update(fields)
        obj.__dict__.update(changes)
        return finalise(obj, changes, fields)

    def __pdoc__(self, **kwargs: Any) -> wl.AbstractDoc:
        declared = type(self)._taktiny_fields
        shown = []
        for name, value in fields_of(self).items():
            spec = declared.get(name)
            if spec is not None and spec.default is not MISSING and value is spec.default:
                continue
            shown.append((name, value))
        return wl.bracketed(
            begin=wl.TextDoc(f"{type(self).__name__}("),
            docs=wl.named_objs(shown, **kwargs),
            sep=wl.comma,
            end=wl.TextDoc(")"),
            indent=kwargs["indent"],  # wl.pdoc passes all its options on
        )

    def __repr__(self) -> str:
        return eqx.tree_pformat(self, struct_as_array=True)

    def state_dict(self, *, unstacked: bool = False) -> dict[str, Any]:
        """The parameters as nested dicts that mirror the module tree.

        Keys are attribute names, list and tuple positions ("0", "1", ...) and dict
        keys; values are this module's own arrays (no copies). Submodules without
        parameters and ``None`` fields do not appear. A custom PyTree parameter (a
        quantized weight) stays whole.

        Args:
            unstacked: give each stack of layers (:class:`~taktiny.nn.Stack`) per layer
                (``{"layers": {"0": ...}}``), its arrays sliced (copies), instead of its
                block's stacked arrays (``{"layers": {"block": ...}}``).

        Returns:
            Nested dicts, one level per module, list or dict, with arrays as leaves.
        """
        return tree_state_dict(self, unstacked=unstacked)

    def flat_state_dict(self, *, unstacked: bool = False) -> dict[str, Any]:
        """The parameters as one dict from dotted names (``"layers.0.kernel"``) to arrays.

        Names come in the order JAX flattens the module: attributes in the order
        ``__init__`` set them, list positions 0, 1, 2, ..., dict keys sorted. Custom
        PyTree parameters are flattened down to their arrays.

        Args:
            unstacked: give each stack of layers (:class:`~taktiny.nn.Stack`) at
                ``layers`` per layer (``layers.0.attention.query.kernel``, a slice),
                instead of stacked (``layers.block.attention.query.kernel``, ``[count,
                ...]``); see :func:`taktiny.flat_state_dict`.

        Returns:
            ``{dotted name: array}``, the module's own arrays (no copies; with
            `unstacked`, a stack's slices, which are copies).
        """
        return tree_flat_state_dict(self, unstacked=unstacked)

    def load_state_dict(
        self, state: Mapping[str, Any], *, strict: bool = False, match_quantization: bool = False
    ) -> Any:
        """Returns a new module with the parameters in the nested `state` loaded.

        Leaves that `state` does not mention keep their values; with ``strict=True``
        every leaf must be supplied. Values may be JAX or NumPy arrays or array-likes
        (not deleted arrays, tracers leaked out of finished transformations, or NumPy
        masked arrays); each is checked against the leaf it replaces (shape, dtype kind,
        range: a cast must not overflow), cast to its dtype and placed with its sharding.
        A nested state that contains itself is refused too. Any problem raises one
        :class:`~taktiny.StateDictError` listing every offending name, and nothing is
        loaded. This module is never changed. Works inside ``jax.jit``.

        With ``match_quantization=True`` values held in another representation than the
        module's are converted to its own: a float array where the module holds a
        :class:`~taktiny.QArray` is quantized as that QArray is (bits, axis, group size,
        scale dtype, sharding), a QArray (or a ``{"value", "scale"}`` dict of its parts)
        where it holds a float array is dequantized into that array's dtype, and a QArray
        quantized another way is re-quantized. Without it, each is an error.

        Args:
            state: nested dicts of arrays, as :meth:`state_dict` gives, for all or part
                of the parameters.
            strict: whether `state` must supply every leaf.
            match_quantization: convert values held in the other representation, as
                above, instead of refusing them.

        Returns:
            A new module of the same structure.

        Raises:
            taktiny.StateDictError: listing every problem; nothing is loaded.
        """
        return tree_load_state_dict(
            self, state, strict=strict, match_quantization=match_quantization
        )

    def load_flat_state_dict(
        self, flat: Mapping[str, Any], *, strict: bool = False, match_quantization: bool = False
    ) -> Any:
        """As :meth:`load_state_dict`, for a dict of dotted names as :meth:`flat_state_dict`
        gives. A float array for a QArray comes under its name (``"dense.kernel"``); a
        QArray for a float array comes whole under that name, or as its parts
        (``"dense.kernel.value"`` and ``"dense.kernel.scale"``).

        Args:
            flat: ``{dotted name: array}`` for all or part of the parameters.
            strict: whether `flat` must supply every leaf.
            match_quantization: as for :meth:`load_state_dict`.

        Returns:
            A new module, as :meth:`load_state_dict` returns.

        Raises:
            taktiny.StateDictError: as :meth:`load_state_dict` raises it.
        """
        return tree_load_flat_state_dict(
            self, flat, strict=strict, match_quantization=match_quantization
        )


_MODULE_INIT = Module.__init__
# Every attribute a Module has (its methods and the class attributes Taktiny keeps): a field
# of the same name would hide it.
_RESERVED = frozenset(name for name in vars(Module) if not name.startswith("__"))
