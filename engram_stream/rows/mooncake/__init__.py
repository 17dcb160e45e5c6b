"""Rows from a Mooncake Store: publish a model's tables, read a step's missed rows in one call.

    tier = MooncakeTier(master="127.0.0.1:50051", metadata="http://127.0.0.1:8080/metadata")
    tier.publish(model)                                            # every layer's rows into the store
    remote = EngramModel.load(path, tables=tier, row_cache_mb=64)  # weights from the file, rows from the store
    local = EngramModel.load(path, row_cache_mb=64)                # the same cache in front of the file
    remote.row_cache_stats()   # {"hits", "misses", "bytes_fetched", "evictions", ...}

Row records. A row travels and is cached as its bytes in the table's dtype, followed by its
scale's bytes (demo int8 tables: a float32; V4.1: 8 e8m0 bytes, so 264-byte records): the
gather converts a record exactly as it converts a table row, so every tier gives the same
floats bit for bit.

Store layout (Mooncake's EngramStore): one object per head, key `engram:{name}:l{L}:h{h}`, holding
that head's records [N_h, record bytes] contiguous (N_h = the head's prime). That is EngramStore's
byte-row layout (Mooncake #4065: `row_bytes` 264 for V4.1, 256 FP8 bytes then 8 E8M0 bytes);
float32 tables are byte-identical to what 0.3.13's float32 EngramStore writes. Beside the heads,
`engram:{name}:l{L}:fingerprint` (JSON) names what was published: the layout, `tables_digest` (the
SHA-256 of every byte of the layer's tables: layer_digests, taken once at publish) and
a digest of sampled records. A model loading with tables=tier is refused unless the store holds
its layout, the digest of its own tables (a mismatch names both digests; a store without one, as
EngramStore.populate leaves it, is refused too) and the store's bytes of the sampled rows equal
its own (rows another writer put under the name since). Rows EngramStore.populate wrote get their
fingerprints from tier.adopt(model), which compares every row with the model's first.

Names. Every key of a model carries a name, so that several models (or revisions of one) share
a store: MooncakeTier(name=None) names each model by model_name(model), a digest of its config
and of every layer's tables_digest (two checkpoints that differ in any byte of a table get
different names, one checkpoint the same name on every host); name="..." puts every model the
tier serves under that name; name="" is EngramStore's own keys, `engram:l{L}:h{h}` (one model a
store). Either way the stored digest decides which model's rows they are.

The model's side of the check digests its own tables at load: once a host for tables mapped from
files (layer_digests caches the digest, keyed by the files' stamps), every load for
tables in RAM.

Reads. An engine in remote mode hashes a token at feed(), looks its rows up in the
RAM cache, and fetches the misses before the nogil gather in ONE `get_into_ranges`
call into a registered staging buffer: keys de-duplicated (one entry per head, its
rows as ranges: 0.3.13 leaves a repeated key's buffer unfilled and reports success,
upstream #3876), every range's returned length checked, the call bounded by a
timeout. Any failure raises TierError and the engine's state is left as it was;
no zeros or stale rows reach the output. Calls work again once the store is back.

Bounded calls. Every call that may wait on the master or a store server (setup, publish's
writes, size and fingerprint checks, reads) runs on a daemon thread and is bounded: a
stopped (SIGSTOP) master never answers, and only the bound ends the wait (TierError). A call
that timed out keeps its thread, its staging buffer and the client alive for good (it may
still write into them), and nothing waits for it at exit: the process exits at once.

The package: keys.py (key names, row records, fingerprints), calls.py (bounded calls on daemon
threads, closing clients at exit, probing a server's port), tier.py (MooncakeTier, its
StoreTables and the RemoteRows reader). Import from those modules.
"""
