"""`tt.schema`: what a tree's state is, name by name (shape, dtype, sharding, quantization),
with a fingerprint that any process on any machine computes alike."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import taktiny.state._names as _names

from .._messages import layout_text, short
from ..quant import Parameter

FORMAT = "taktiny-schema/1"  # the JSON's "format": what its reader must know
KEY = "taktiny_schema"  # the safetensors header metadata key a saved model's schema is under
KINDS = ("missing", "added", "reshaped", "recast", "resharded", "requantized")
_KEYS = {"format", "fingerprint", "tensors", "version", "versions"}
_FIELDS = ("shape", "dtype", "sharding", "quantization")
_KIND_OF = dict(zip(_FIELDS, KINDS[2:], strict=True))  # a changed field -> its change


class Schema(Mapping[str, Mapping[str, Any]]):
    """What a tree's state is: a read-only mapping from each leaf's flat name to its
    entry, ``{"shape": [4096, 1024], "dtype": "bfloat16", "sharding": {"spec": [None,
    "model"], "mesh": {"data": 2, "model": 4}}, "quantization": None}``, in the tree's
    order.

    ``sharding`` is None for a leaf on one device (or a host array); for a leaf on a mesh,
    its ``PartitionSpec`` (one entry per axis: an axis name, a list of them, or None) and
    the mesh's axis sizes, which hold on any machine with that mesh (device ids are left
    out). ``quantization`` is None for a plain array; for a :class:`~taktiny.QArray`,
    ``{"bits": 4, "axis": 0, "group_size": 64}``, and then ``dtype`` is the float dtype it
    stands for. A leaf of a stack of layers (:class:`taktiny.nn.Stack`) also has
    ``"stack": {"path": "layers", "count": 32}``: its first axis is the layer axis, and
    per layer it reads ``layers.<i>.<rest>``.

    ``version`` is the state version the tree's class declares (``state_version``, see
    :func:`taktiny.migrate`), or None when it declares none: a load of an older version
    applies the class's migrations. ``versions`` holds the same for the modules inside the
    tree whose classes declare one, by their paths (``{"blocks.0": 2, "blocks.1": 2}``):
    each is migrated from its own version.

    Two schemas are equal when their entries and versions are (the order of names aside);
    the :attr:`fingerprint` says so in 32 hex digits. :meth:`to_json` and :meth:`from_json`
    write and read it; :func:`taktiny.io.save_safetensors` stores a model's schema in
    its checkpoint (``open_safetensors(path).schema``).

    Args:
        entries: ``{flat name: entry}``, each entry as above.
        version: the state version (an int >= 1), or None.
        versions: ``{path: state version}`` of the versioned modules inside the tree
            (paths as flat names give them, never ``""``); None or ``{}`` for none.

    Attributes:
        version: the state version, or None.
        versions: the versions of the modules inside, by path (read-only; empty for none).

    Raises:
        ValueError: an entry is not of that form, naming it and what is wrong; a version
            that is not an int >= 1, or a path that is not a name.
    """

    __slots__ = ("_entries", "version", "versions")

    class Change(NamedTuple):
        """One difference between two schemas (see :meth:`Schema.changes`).

        Attributes:
            kind: ``"missing"`` (only the first schema has the name), ``"added"`` (only the
                second), ``"reshaped"``, ``"recast"``, ``"resharded"`` or ``"requantized"``.
            name: the leaf's flat name.
            before: the first schema's value of what changed (its whole entry for
                ``"missing"``; None for ``"added"``).
            after: the second schema's (None for ``"missing"``; the entry for ``"added"``).
        """

        kind: str
        name: str
        before: Any
        after: Any

        def __str__(self) -> str:
            if self.kind in ("missing", "added"):
                entry = self.before if self.kind == "missing" else self.after
                return f"{self.kind:<11} {self.name}: {_entry_text(entry)}"
            return f"{self.kind:<11} {self.name}: {_text(self.before)} -> {_text(self.after)}"

    def __init__(
        self,
        entries: Mapping[str, Mapping[str, Any]],
        *,
        version: int | None = None,
        versions: Mapping[str, int] | None = None,
    ):
        self._entries = {name: _checked(name, entry) for name, entry in entries.items()}
        self.version = _checked_version(version)
        self.versions: Mapping[str, int] = MappingProxyType(_checked_versions(versions))

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schema):
            return NotImplemented
        return (
            self._entries == other._entries
            and self.version == other.version
            and self.versions == other.versions
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @property
    def fingerprint(self) -> str:
        """32 hex digits (SHA-256) of the entries in a canonical JSON form (names sorted):
        equal schemas have equal fingerprints on every machine, and any change of a
        name, shape, dtype, sharding, quantization or version changes it. A schema
        without versions hashes its entries alone, as before versions were recorded."""
        value: Any = self._entries
        if self.version is not None or self.versions:
            value = {"tensors": self._entries, **self._versions()}
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def to_json(self) -> str:
        """The schema as JSON, for a file or a header beside a checkpoint.

        Returns:
            One line: ``{"format": "taktiny-schema/1", "fingerprint": ..., "tensors":
            {name: entry}}``, with ``"version"`` and ``"versions"`` too when there are
            any, which :meth:`from_json` reads.
        """
        value: dict[str, Any] = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tensors": self._entries,
            **self._versions(),
        }
        return json.dumps(value, separators=(",", ":"))

    def _versions(self) -> dict[str, Any]:
        """The versions as the JSON holds them: only those there are."""
        out: dict[str, Any] = {}
        if self.version is not None:
            out["version"] = self.version
        if self.versions:
            out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_json(cls, text: str) -> Schema:
        """The schema :meth:`to_json` wrote.

        Args:
            text: the JSON.

        Returns:
            The schema, each entry checked.

        Raises:
            ValueError: `text` is not such JSON (another format, a malformed entry, or a
                fingerprint its entries do not give), saying what is wrong.
        """
        value = _document(text)
        tensors = _as_dict(value["tensors"])
        if tensors is None:
            raise ValueError(
                f"the schema's 'tensors' must map names to entries, got {short(value['tensors'])}"
            )
        version, versions = _recorded(value)
        schema = cls(tensors, version=version, versions=versions)
        if value["fingerprint"] != schema.fingerprint:
            raise ValueError(
                f"the schema's fingerprint {short(value['fingerprint'])} is not its entries' "
                f"({schema.fingerprint}): it was changed after it was written"
            )
        return schema

    def changes(self, other: Schema) -> list[Schema.Change]:
        """What differs from this schema to `other`: each name only this one has
        (``"missing"``), each only `other` has (``"added"``), then for each name both
        have, each of its shape, dtype, sharding and quantization that differs.

        Args:
            other: the schema to compare with (the newer one, say).

        Returns:
            The changes (:class:`Schema.Change`), names in this schema's order then
            `other`'s; empty when equal.
        """
        out = [self.Change("missing", n, e, None) for n, e in self.items() if n not in other]
        out += [self.Change("added", n, None, e) for n, e in other.items() if n not in self]
        for name, entry in self.items():
            theirs = other.get(name)
            if theirs is not None:
                out += [
                    self.Change(_KIND_OF[f], name, entry[f], theirs[f])
                    for f in _FIELDS
                    if entry[f] != theirs[f]
                ]
        return out

    def __repr__(self) -> str:
        version = "" if self.version is None else f", version {self.version}"
        if self.versions:
            version += f", {len(self.versions)} versioned modules inside"
        return f"Schema({len(self)} leaves{version}, fingerprint {self.fingerprint})"


def schema(tree: Any) -> Schema:
    """The schema of `tree`'s state: for each leaf, by its flat name, its shape, dtype,
    sharding and quantization (see :class:`Schema`). Abstract trees
    (``jax.eval_shape``, ``ShapeDtypeStruct`` leaves with shardings) give the same schema
    as the concrete ones they describe.

    Args:
        tree: a module, or any PyTree holding arrays and modules.

    Returns:
        The :class:`Schema`; a :class:`~taktiny.QArray` is one entry under its name. Its
        version is the ``state_version`` `tree`'s class declares, or None; its versions,
        those the classes of the modules inside it declare, by path.

    Raises:
        ValueError: a class declares a ``state_version`` that is not an int >= 1.
    """
    leaves, _, spec = _names.flatten(tree)
    return schema_of(leaves, spec)


def schema_of(leaves: list[Any], spec: _names.Spec) -> Schema:
    """The :func:`schema` of a tree already flattened (`leaves` and `spec`, as
    :func:`~taktiny.state.flatten` gives them), without flattening it again."""
    found: dict[str, dict[str, Any]] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(cast("Mapping[str, Any]", value), f"{prefix}{key}.")
            else:
                found[prefix + key] = leaf_entry(value)

    walk(_names.nested(spec.template, leaves), "")
    for name, entry in found.items():
        stack = spec.stack_of(name)
        if stack is not None:
            entry["stack"] = {"path": stack.path, "count": stack.count}
    versions = declared_versions(spec.modules)
    return Schema(found, version=versions.pop("", None), versions=versions)


def declared_versions(modules: Mapping[str, type]) -> dict[str, int]:
    """The state version each of a tree's `modules` (a `Spec`'s: each module's class by
    its path, ``""`` for the root) declares (its class's ``state_version``), by path, for
    those that declare one; outer modules first.

    Raises:
        ValueError: a ``state_version`` that is not an int >= 1, naming the class.
    """
    out: dict[str, int] = {}
    for path, cls in modules.items():
        version: object = getattr(cls, "state_version", None)
        if version is None:
            continue
        if type(version) is not int or version < 1:
            raise ValueError(
                f"{cls.__name__}.state_version must be an int >= 1, got {short(version)}"
            )
        out[path] = version
    return out


def leaf_entry(leaf: Any) -> dict[str, Any]:
    """The schema entry of one leaf: an array, an abstract array or a QArray (anything
    else as NumPy makes an array of it: a Python number)."""
    import numpy as np

    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        leaf = np.asarray(leaf)
    quantization = None
    placed = leaf
    if isinstance(leaf, Parameter):
        quantization = leaf.layout()
        placed = leaf.part_values()[0]  # (its first part, split as the whole is)
    return {
        "shape": [int(n) for n in leaf.shape],
        "dtype": _dtype_name(leaf.dtype),
        "sharding": _sharding(getattr(placed, "sharding", None), len(leaf.shape)),
        "quantization": quantization,
    }


def _dtype_name(dtype: Any) -> str:
    """NumPy's name of a dtype (``"bfloat16"``); JAX's for a PRNG key array's
    (``"key<fry>"``), which NumPy has none for."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)
    return np.dtype(dtype).name


def _sharding(sharding: Any, ndim: int) -> dict[str, Any] | None:
    """A sharding as a schema records it: None on one device; a mesh's spec (padded to
    one entry per axis) and axis sizes; else the number of devices."""
    if sharding is None:
        return None
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is not None and mesh is not None:
        entries: list[Any] = [
            list(cast("tuple[str, ...]", e)) if isinstance(e, tuple) else e for e in spec
        ]
        entries += [None] * (ndim - len(entries))
        return {"spec": entries, "mesh": {str(k): int(v) for k, v in mesh.shape.items()}}
    count = len(sharding.device_set)
    return None if count == 1 else {"devices": count}


def recorded_versions(text: str) -> tuple[int | None, dict[str, int]]:
    """The state versions the JSON of a schema records (the tree's, None for none; those
    of the modules inside, by path), checking the document and its versions but reading
    none of its entries: what a load needs to know, at a fraction of
    :meth:`Schema.from_json`'s cost for a large model.

    Raises:
        ValueError: `text` is not a schema's JSON, or a version is not an int >= 1.
    """
    return _recorded(_document(text))


def _recorded(value: Mapping[str, Any]) -> tuple[int | None, dict[str, int]]:
    versions: object = value.get("versions")
    found = _as_dict(versions)
    if versions is not None and found is None:
        raise ValueError(
            f"a schema's 'versions' maps module paths to versions, got {short(versions)}"
        )
    return _checked_version(value.get("version")), _checked_versions(found)


def _document(text: str) -> dict[Any, Any]:
    """The JSON object of a schema, its keys and format checked (its entries are not)."""
    try:
        parsed: object = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"a schema must be JSON: {error}") from None
    value = _as_dict(parsed)
    if value is None or not {"format", "fingerprint", "tensors"} <= set(value) <= _KEYS:
        raise ValueError(
            "a schema is a JSON object with 'format', 'fingerprint' and 'tensors' (and "
            f"optionally 'version' and 'versions'), got {short(parsed)}"
        )
    if value["format"] != FORMAT:
        raise ValueError(
            f"the schema's format is {short(value['format'])}; this Taktiny reads {FORMAT!r}"
        )
    return value


def _checked_versions(versions: Mapping[Any, object] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, version in (versions or {}).items():
        if not isinstance(path, str) or not path or "" in path.split("."):
            raise ValueError(
                f"a schema's versions are by module path (a flat name such as 'blocks.0'), "
                f"got {short(path)}"
            )
        checked = _checked_version(version)
        if checked is None:
            raise ValueError(f"the schema's version of {path!r} is an int >= 1, got None")
        out[path] = checked
    return out


def _checked_version(version: object) -> int | None:
    if version is None:
        return None
    if type(version) is not int or version < 1:
        raise ValueError(f"a schema's version is an int >= 1 or None, got {short(version)}")
    return version


def _checked(name: object, entry: object) -> dict[str, Any]:
    """`entry` checked to be a schema entry (as :class:`Schema` says), copied."""
    fields = _as_dict(entry)
    problem = None
    if not isinstance(name, str):
        problem = "names must be strings"
    elif fields is None or set(fields) - {"stack"} != set(_FIELDS):
        problem = f"an entry has exactly the keys {list(_FIELDS)} (and 'stack' for a stack's leaf)"
    elif (shape := _as_list(fields["shape"])) is None or not all(
        type(n) is int and n >= 0 for n in shape
    ):
        problem = "'shape' is a list of sizes (ints >= 0)"
    elif not isinstance(fields["dtype"], str):
        problem = "'dtype' is a dtype's name ('float32')"
    elif not _is_sharding(fields["sharding"], len(shape)):
        problem = (
            "'sharding' is None, {'spec': [one entry per axis: a mesh axis, a list of them, "
            "or None], 'mesh': {axis: size}} or {'devices': count}"
        )
    elif not _is_quantization(fields["quantization"]):
        problem = (
            "'quantization' is None or {'bits': 4 or 8, 'axis': int, 'group_size': int or None}"
        )
    elif "stack" in fields and not _is_stack(fields["stack"], shape):
        problem = "'stack' is {'path': the stack's name, 'count': the size of the first axis}"
    if problem is not None:
        raise ValueError(f"schema entry {short(name)}: {problem}; got {short(entry)}")
    return json.loads(json.dumps(fields))  # a copy no caller can change


def _as_dict(value: object) -> dict[Any, Any] | None:
    return cast("dict[Any, Any]", value) if isinstance(value, dict) else None


def _as_list(value: object) -> list[Any] | None:
    return cast("list[Any]", value) if isinstance(value, list) else None


def _is_sharding(value: object, ndim: int) -> bool:
    if value is None:
        return True
    fields = _as_dict(value)
    if fields is None:
        return False
    if set(fields) == {"devices"}:
        return type(fields["devices"]) is int and fields["devices"] > 1
    spec, mesh = _as_list(fields.get("spec")), _as_dict(fields.get("mesh"))
    if set(fields) != {"spec", "mesh"} or spec is None or mesh is None:
        return False
    axes: list[Any] = []
    for entry in spec:
        axes += [] if entry is None else (_as_list(entry) or [entry])
    return (
        all(isinstance(k, str) and type(v) is int and v >= 1 for k, v in mesh.items())
        and len(spec) == ndim
        and all(isinstance(a, str) and a in mesh for a in axes)
        and len(set(axes)) == len(axes)
    )


def _is_stack(value: object, shape: list[Any]) -> bool:
    fields = _as_dict(value)
    return (
        fields is not None
        and set(fields) == {"path", "count"}
        and isinstance(fields["path"], str)
        and type(fields["count"]) is int
        and bool(shape)
        and shape[0] == fields["count"]
    )


def _is_quantization(value: object) -> bool:
    if value is None:
        return True
    fields = _as_dict(value)
    if fields is None or set(fields) != {"bits", "axis", "group_size"}:
        return False
    group = fields["group_size"]
    return (
        type(fields["bits"]) is int
        and fields["bits"] in (4, 8)
        and type(fields["axis"]) is int
        and (group is None or (type(group) is int and group > 0))
    )


def _text(value: Any) -> str:
    """A field's value in a change's line: a shape ``[4096, 1024]``, a dtype, a sharding
    ``P(None, 'model') on {data: 2, model: 4}``, a quantization ``int4 (groups of 64
    along axis 0)``, or ``none``."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return str(cast("list[int]", value))
    if "bits" in value:
        return layout_text(value["bits"], value["axis"], value["group_size"])
    if "devices" in value:
        return f"{value['devices']} devices"
    axes: list[Any] = value["spec"]
    spec = ", ".join(
        repr(tuple(cast("list[str]", e))) if isinstance(e, list) else repr(e) for e in axes
    )
    mesh = ", ".join(f"{k}: {v}" for k, v in value["mesh"].items())
    return f"P({spec}) on {{{mesh}}}"


def _entry_text(entry: Mapping[str, Any]) -> str:
    parts = [f"{entry['dtype']}{entry['shape']}"]
    if entry["sharding"] is not None:
        parts.append(_text(entry["sharding"]))
    if entry["quantization"] is not None:
        parts.append(_text(entry["quantization"]))
    if "stack" in entry:
        parts.append(_stack_text(entry["stack"]))
    return ", ".join(parts)


def _stack_text(stack: Mapping[str, Any]) -> str:
    """``stacked: 32 layers of 'layers' on axis 0``."""
    return f"stacked: {stack['count']} layers of {stack['path'] or 'the root'!r} on axis 0"
