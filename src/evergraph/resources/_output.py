"""What kinds that write one whole file (tar, gzip, http:client) share: the file's
content is theirs (a claim), it is a path others may depend on, it follows its
nearest managed parent directory, and a reversal removes it only if it did not
exist before."""

from __future__ import annotations

import os
from collections.abc import Iterator

from evergraph.engine.contract import Resource, parent_dir_keys


class OutputFile(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    def _out(self) -> str:
        """The output file's normalised path."""
        raise NotImplementedError

    def claims(self) -> list[str]:
        return [f"content:{self._out()}"]  # all of its content is ours

    def autoedge_provides(self) -> list[str]:
        return [f"path:{self._out()}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        yield parent_dir_keys(self._out())

    def reversal(self) -> Resource | None:
        """An output that did not exist is removed again; one that did is left."""
        from evergraph.resources.file import File

        if os.path.lexists(self._out()):
            return None
        return File(name=self._out(), state="absent")
