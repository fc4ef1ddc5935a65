"""Boruta's HTTP API v1 on the wire: what the farm routes read and write. Pure.

The farm's routes (SPEC §5.2) are wire-compatible with SamsungSLAV/boruta's REST
API v1; the reference is Boruta's golden responses in `shared/boruta-ref/`. This
package knows that wire and nothing else (no I/O, no Starlette, no World): the
routes parse a body here, call the farm, and encode the answer here. Its parts,
from the bottom:

- `gotime`: Go's `time.Time` (strict RFC 3339 in and out, Go's messages) and
  `gojson`: Go's `encoding/json` (`dumps` as `json.Marshal`; `decode` as
  `json.Decoder` into declared Go types, with Go's messages and this reader's
  limits). Emulations of Go's standard library: they know nothing of Boruta.
- `wire`: the names, Boruta's messages, `WireError` (a status and
  `{"message": ...}`: 404 `<What> not found`, 400 `invalid request: <reason>`,
  400 `no body provided in HTTP request`).
- `encode`: the answers (`req_info`, `worker_info`, `access_info`, `req_id`,
  `version`) in Go's field order, and the `Boruta-*` headers.
- `schema`: Boruta's Go types for the decoder, and `read_body` (a body into one,
  failures as Boruta answers them); `bodies`: the request bodies read and
  checked (new request, update, set state, set groups, IDs in URLs);
  `listing`: list bodies, filters, sorting and Boruta's keyset paging.

Import the part you use (`from evergraph.http.boruta import encode`); this
package re-exports nothing, so reading a time costs no import of the listing.
"""
