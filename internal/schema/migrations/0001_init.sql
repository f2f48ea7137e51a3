-- kfn:breaks-before 1
-- (The first schema: no worker is older.)

-- kfn bookkeeping lives in its own schema so it never collides with a
-- function's business tables.
CREATE SCHEMA IF NOT EXISTS kfn;

-- One row per applied migration; the highest version is the schema version.
CREATE TABLE kfn.schema_migrations (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- The resume position and fencing epoch of one source partition for one
-- consumer (a function). next_offset only moves forward in normal operation;
-- only a replay moves it back. high_water is the highest next_offset ever
-- committed and never moves back (only an audited re-execution lowers it), so
-- every offset below it has been handled and is skipped even after its inbox
-- row was purged. epoch is the fencing token of the current owner: a commit
-- is accepted only while epoch equals the token the committer claimed the
-- partition with.
CREATE TABLE kfn.cursors (
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL,
    high_water  bigint      NOT NULL,
    generation  integer     NOT NULL DEFAULT 0, -- bumped by each re-execution; part of event ids
    epoch       bigint      NOT NULL,
    owner       text        NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition)
);

-- Every Kafka record a consumer has handled, keyed by its coordinates. The
-- unique key is what makes a second delivery a no-op.
CREATE TABLE kfn.inbox (
    consumer     text        NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    "offset"     bigint      NOT NULL,
    epoch        bigint      NOT NULL,
    outcome      text        NOT NULL DEFAULT 'applied' CHECK (outcome IN ('applied', 'dead_lettered')),
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition, "offset")
);
CREATE INDEX inbox_processed_at ON kfn.inbox (processed_at);

-- Records that could not be applied, with everything needed to inspect and
-- re-drive them. A dead-lettered record also has an inbox row, so a replay
-- does not apply it behind the operator's back.
CREATE TABLE kfn.dead_letters (
    id          bigserial   PRIMARY KEY,
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    "offset"    bigint      NOT NULL,
    record_key  bytea,
    value       bytea,
    headers     jsonb       NOT NULL DEFAULT '[]',
    record_time timestamptz,
    reason      text        NOT NULL,
    error       text        NOT NULL,
    attempts    integer     NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, topic, partition, "offset")
);

-- Events emitted by functions, written in the same transaction as the
-- business write and forwarded to NATS JetStream by the relay. event_id is
-- deterministic (derived from the source record and the emit index) so a
-- replay emits the same ids. txid is the id of the writing transaction,
-- kept for diagnosis: the relay does not read it (its reads need no cursor
-- and no snapshot bound; see outbox/relay_store.go).
CREATE TABLE kfn.outbox (
    id            bigserial   PRIMARY KEY,
    event_id      text        NOT NULL UNIQUE,
    subject       text        NOT NULL,
    event_type    text        NOT NULL,
    event_key     text        NOT NULL,
    shard         integer     NOT NULL,
    data          bytea       NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    source        text        NOT NULL,
    source_topic  text        NOT NULL,
    source_partition integer  NOT NULL,
    source_offset bigint      NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    txid          xid8        NOT NULL DEFAULT pg_current_xact_id()
);
CREATE INDEX outbox_shard_id ON kfn.outbox (shard, id);

-- Audit trail of operator actions that change what gets processed (replays,
-- re-executions, dead letter re-drives).
CREATE TABLE kfn.audit_log (
    id         bigserial   PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text        NOT NULL,
    action     text        NOT NULL,
    consumer   text        NOT NULL,
    topic      text        NOT NULL,
    partition  integer     NOT NULL,
    details    jsonb       NOT NULL DEFAULT '{}'
);
