"""What a Taktiny module is: the `Module` class and its metaclass, the node classes, declared
fields, the checks made when a module is built, `Rngs` and the trainable marker. The
design note is `_module.md` beside this file. The public names are re-exported by
``taktiny`` and ``taktiny.nn``; nothing is imported here."""
