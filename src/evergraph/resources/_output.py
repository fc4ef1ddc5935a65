"""What kinds that write one whole file (tar, gzip, http:client) share: the file's
content is theirs (a claim), it is a path others may depend on, it follows its
nearest managed parent directory, and a reversal removes it only if it did not
exist before."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from evergraph.engine.build import build
from evergraph.engine.contract import Resource, default_registry, parent_dir_keys
from evergraph.resources._owninode import OwnInode


class OutputFile(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    if TYPE_CHECKING:  # set by the kind's init (not struct fields)
        #: the output path, and our last write's inode (until its rename is seen)
        _target: str
        _own: OwnInode

    def _out(self) -> str:
        """The output file's normalised path."""
        raise NotImplementedError

    def claims(self) -> list[str]:
        return [f"content:{self._out()}"]  # all of its content is ours

    def autoedge_provides(self) -> list[str]:
        return [f"path:{self._out()}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        yield parent_dir_keys(self._out())

    def _output_changed(self, mask: int) -> None:
        """The output file's watch callback: an event, unless it is our own write
        renamed into place (see OwnInode)."""
        if not self._own.renamed_in(mask, self._target):
            self.handle.event()

    def reversal(self) -> Resource | None:
        """An output that did not exist is removed again; one that did is left."""
        if os.path.lexists(self._out()):
            return None
        # (by its kind's name: a kind never imports another kind)
        return build(default_registry, "file", {"name": self._out(), "state": "absent"})
