"""The engine: one step over any layout (`step`: plan -> propose -> verify -> accept -> commit ->
realign), verification of a chain or a tree (`verify`), admission of waiting rows with chunked
prefill, the loop that the offline `ragged` method and the server share, the online engine (no
HTTP) and its tensor-parallel lockstep, the invariant checker."""
