"""The controller: per request, choose an arm for its class and load, serve it, learn from it.

`controller` serves requests alone or coalesced (`coalesce`) into continuous batches
(`continuous`); `learning` journals every policy update in the store and `saving` writes
checkpoints in the background; `classifier` names a request's class when the caller gives
none; `metrics` reads a request's features and the GPU; `inspect_store` reports what a store
has learned.
"""
