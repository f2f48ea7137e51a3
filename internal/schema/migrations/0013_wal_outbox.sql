-- kfn:additive
-- The WAL outbox (--outbox wal): a function's events go into the WAL as
-- logical decoding messages (pg_logical_emit_message, prefix 'kfn.outbox')
-- instead of kfn.outbox rows, and the relay reads them from a logical
-- replication slot. `kfn migrate --outbox wal` creates the slot and the
-- publication and writes this table's one row; the table alone sets
-- nothing up.
--
-- The row also holds the slot reader's fence and its last report:
--   fence_token   the lease token of the relay that reads the slot. A relay
--                 raises it (never lowers it) before it starts replication,
--                 and terminates the walsender of the reader it replaces
--                 (reader_pid, and the slot's active_pid): a relay with an
--                 older token cannot read the slot again.
--   confirmed_*   the slot's position the reader last confirmed, and when.
--   pending_events, oldest_pending  events read from the slot and not yet
--                 acked by the stream, and the oldest one's emit time.
--   lost_at       when a reader found the slot gone (slot loss: see
--                 docs/production/wal-outbox.md).
CREATE TABLE kfn.wal_outbox (
    id             boolean     PRIMARY KEY DEFAULT true CHECK (id),
    slot_name      text        NOT NULL CHECK (slot_name ~ '^[a-z0-9_]{1,63}$'),
    publication    text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    created_lsn    pg_lsn,
    fence_token    bigint      NOT NULL DEFAULT 0,
    reader         text,
    reader_pid     integer,
    fenced_at      timestamptz,
    confirmed_lsn  pg_lsn,
    confirmed_at   timestamptz,
    pending_events bigint      NOT NULL DEFAULT 0,
    oldest_pending timestamptz,
    reported_at    timestamptz,
    lost_at        timestamptz
);
-- Nothing secret: every role may read it (the lease token floor reads the
-- fence; kfn status reads the rest).
GRANT SELECT ON kfn.wal_outbox TO PUBLIC;

-- kfn.emit_events writes a transaction's events into the WAL, in order,
-- as transactional messages: they are decoded only if the transaction
-- commits, in commit order. It refuses (SQLSTATE 55000, which a worker
-- retries, never dead-letters) when the WAL outbox is not set up or its
-- slot is gone: an event written with no slot to hold it would never be
-- relayed. SECURITY DEFINER so that a function's own role needs no right
-- on kfn.wal_outbox.
CREATE FUNCTION kfn.emit_events(payloads bytea[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    slot text;
BEGIN
    SELECT w.slot_name INTO slot FROM kfn.wal_outbox w;
    IF slot IS NULL THEN
        RAISE EXCEPTION 'kfn: the WAL outbox is not set up in database %', current_database()
            USING ERRCODE = '55000', HINT = 'run `kfn migrate --outbox wal`, or run the workers with --outbox table';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots s
                    WHERE s.slot_name = slot AND s.database = current_database()) THEN
        RAISE EXCEPTION 'kfn: the WAL outbox''s replication slot % is gone: events written now would never be relayed', slot
            USING ERRCODE = '55000', HINT = 'see "Slot loss" in docs/production/wal-outbox.md: `kfn migrate --outbox wal` creates it again';
    END IF;
    PERFORM pg_catalog.pg_logical_emit_message(true, 'kfn.outbox', u.p)
       FROM unnest(payloads) WITH ORDINALITY AS u(p, n)
      ORDER BY u.n;
END;
$$;
