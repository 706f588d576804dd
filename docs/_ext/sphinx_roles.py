"""A griffe extension for the documentation site (mkdocs.yml): Taktiny's docstrings are
Google-style with Sphinx's cross-reference roles, which Markdown would print as they are.

Each ``:func:`name```, ``:class:`~taktiny.QArray```, ``:meth:`text <target>``` (and
``:mod:``, ``:attr:``, ``:exc:``) becomes an mkdocstrings cross-reference
``[`name`][target]``, its target resolved as Sphinx would: a bare ``open_safetensors`` in
``taktiny.io``'s loader names what that module imports under that name; ``:meth:`` and
``:attr:`` look in the enclosing class first. So a role naming nothing fails
``mkdocs build --strict`` (autorefs warns of an unresolved cross-reference), and the source
keeps the roles that read well in ``help()``. A paragraph ending in ``::`` (a
reStructuredText literal block follows) ends in ``:`` instead; the indented block after it
is a Markdown code block.

A class attribute without a docstring of its own takes its entry in the class's
``Attributes`` section, so that the site shows it (and can link to it) as a member; the
site hides the sections themselves (``show_docstring_attributes: false``). An ``__init__``
keeps no docstring inherited from a base class (griffe-inherited-docstrings gives it
``Module.__init__``'s): a class's own docstring documents its constructor.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(func|class|meth|mod|attr|exc|obj|data):`(~?)([^`<]+?)(?:\s*<([^`>]+)>)?`")
LITERAL = re.compile(r"::$(?=\n\s*\n)", re.M)
IN_CLASS = {"meth", "attr"}  # the roles that look in the enclosing class first

logger = griffe.get_logger(__name__)


def _scope(obj: griffe.Object, role: str) -> griffe.Object:
    """Where `role` in the docstring of `obj` resolves its names."""
    scope = obj
    while not scope.is_module and scope.parent is not None:
        if scope.is_class and role in IN_CLASS:
            break
        scope = scope.parent
    return scope


def _target(obj: griffe.Object, role: str, name: str) -> str:
    """The full path that `name` (dotted or not) means in `obj`'s docstring."""
    if name == "taktiny" or name.startswith("taktiny."):
        return name
    first, _, rest = name.partition(".")
    try:
        path = _scope(obj, role).resolve(first)
    except griffe.NameResolutionError:
        logger.warning(f"{obj.path}: the cross-reference {name!r} names nothing in scope")
        return name
    return f"{path}.{rest}" if rest else path


def _rewrite(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match[str]) -> str:
        role, short, name, explicit = match.groups()
        name = name.strip()
        target = _target(obj, role, explicit.strip() if explicit else name)
        shown = name.rsplit(".", 1)[-1] if short else name
        return f"[`{shown}`][{target}]"

    return LITERAL.sub(":", ROLE.sub(link, text))


def _lift_attributes(cls: griffe.Class) -> None:
    """Gives each attribute of `cls` without a docstring its `Attributes` entry's text."""
    docstring = cls.docstring
    if docstring is None:
        return
    for section in docstring.parsed:
        if section.kind is not griffe.DocstringSectionKind.attributes:
            continue
        for item in section.value:
            member = cls.members.get(item.name)
            if isinstance(member, griffe.Attribute) and not member.docstring:
                member.docstring = griffe.Docstring(
                    item.description, parent=member, parser=docstring.parser
                )


class SphinxRoles(griffe.Extension):
    """Rewrites the docstrings of a loaded package (see the module's docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
        if isinstance(obj, griffe.Class):
            _lift_attributes(obj)
            init = obj.members.get("__init__")
            if isinstance(init, griffe.Function) and init.docstring is not None:
                if init.docstring.parent is not init:  # (inherited)
                    init.docstring = None
        for member in obj.members.values():
            if isinstance(member, griffe.Object):  # (not an alias: that object is walked)
                self._walk(member, seen)
