-- kfn:additive
-- (Workers built for an older schema only call kfn.emit_events, whose
-- signature and SQLSTATEs stay as they were.)
--
-- Retiring the WAL outbox (`kfn migrate --drop-wal-outbox`), after the
-- workers went back to --outbox table:
--   retired_at   when the retirement committed. From then on emit_events
--                refuses, so no event enters the WAL that the relay would
--                have to read after the slot is dropped.
--   retired_lsn  the WAL insert position while the retirement held the
--                table's ACCESS EXCLUSIVE lock: every transaction that had
--                called emit_events before had ended (it held ACCESS SHARE
--                on this table from its call to its end), so each event
--                ever committed lies before it. The slot may be dropped
--                once its confirmed position is past it.
ALTER TABLE kfn.wal_outbox
    ADD COLUMN retired_at  timestamptz,
    ADD COLUMN retired_lsn pg_lsn;

-- As in 0013, and it also refuses once the WAL outbox is retired (the
-- same SQLSTATE 55000, which a worker retries, never dead-letters).
CREATE OR REPLACE FUNCTION kfn.emit_events(payloads bytea[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    slot    text;
    retired timestamptz;
BEGIN
    SELECT w.slot_name, w.retired_at INTO slot, retired FROM kfn.wal_outbox w;
    IF slot IS NULL THEN
        RAISE EXCEPTION 'kfn: the WAL outbox is not set up in database %', current_database()
            USING ERRCODE = '55000', HINT = 'run `kfn migrate --outbox wal`, or run the workers with --outbox table';
    END IF;
    IF retired IS NOT NULL THEN
        RAISE EXCEPTION 'kfn: the WAL outbox of database % is being retired (since %): it takes no more events', current_database(), retired
            USING ERRCODE = '55000', HINT = 'run the workers with --outbox table (KFN_OUTBOX=table)';
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
