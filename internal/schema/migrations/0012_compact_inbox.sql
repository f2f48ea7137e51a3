-- kfn:breaks-before 12
-- (kfn.inbox loses its consumer, topic and partition columns: a worker built
-- for an older schema writes them, so it stops here. kfn migrate copies the
-- inbox while those workers run and swaps the tables at the end, where they
-- stop: docs/production/upgrades.md.)

-- A compact inbox key. Each inbox row and its primary key repeated the
-- function's name and the topic as text; a row is now keyed by a lane id,
-- an integer standing for one (consumer, topic, partition) — or, for a
-- NATS-triggered function, (consumer, subject, lane), the cursor's own key
-- — plus the offset. For the bench's names that is about 60% less space
-- per row and index entry (docs/benchmarks.md, "The inbox key").
--
-- Online. On an installation that has an inbox, kfn migrate first runs the
-- part of this file above the line "kfn:online-prepare ends" in a short
-- transaction of its own, adds a trigger that mirrors every write of the
-- old kfn.inbox into kfn.inbox_compact, and copies the old rows in small
-- transactions, all while workers built for schema 11 keep running
-- (internal/schema/compact_inbox.go, which states the races). Then this
-- file runs whole, as a migration: the part above the line finds
-- everything in place, and the rest swaps the tables without reading the
-- inbox. Applied without that copy, or after one that did not finish, it
-- copies every row itself, in its own transaction. The part above the
-- line may run any number of times.

-- Lanes are never deleted or renumbered, so an inbox row keeps meaning the
-- same partition. A worker adds its partition's lane when it claims it
-- (inbox.ClaimPartition); the ids need no privilege on a sequence (an
-- identity column's).
CREATE TABLE IF NOT EXISTS kfn.lanes (
    id        integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer  text    NOT NULL,
    topic     text    NOT NULL,
    partition integer NOT NULL,
    UNIQUE (consumer, topic, partition)
);

-- How a handled record ended, in 4 bytes rather than a text of 8 or 14.
DO $$
BEGIN
    CREATE TYPE kfn.outcome AS ENUM ('applied', 'dead_lettered');
EXCEPTION WHEN duplicate_object THEN
    NULL; -- made by an earlier run of this part
END;
$$;

-- The columns in this order leave no alignment padding: 32 bytes of data
-- after the 24-byte row header, and a 24-byte index entry. Autovacuum
-- leaves it alone until the swap: the swap's lock would wait for a
-- vacuum of the rows just copied to be cancelled (deadlock_timeout, a
-- second), and the workers with it.
CREATE TABLE IF NOT EXISTS kfn.inbox_compact (
    "offset"     bigint      NOT NULL,
    epoch        bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    lane         integer     NOT NULL,
    outcome      kfn.outcome NOT NULL DEFAULT 'applied',
    CONSTRAINT inbox_compact_pkey PRIMARY KEY (lane, "offset")
) WITH (autovacuum_enabled = false);

-- How far the online copy got: the old primary key of the last row it
-- copied (it starts below every key kfn writes: partitions and offsets are
-- never negative), how many rows it copied, and whether it copied every
-- row that was there when its trigger was added. Dropped below.
CREATE TABLE IF NOT EXISTS kfn.inbox_backfill (
    single    boolean PRIMARY KEY DEFAULT true CHECK (single),
    consumer  text    NOT NULL DEFAULT '',
    topic     text    NOT NULL DEFAULT '',
    partition integer NOT NULL DEFAULT -2147483648,
    "offset"  bigint  NOT NULL DEFAULT -9223372036854775808,
    copied    bigint  NOT NULL DEFAULT 0,
    done      boolean NOT NULL DEFAULT false
);
INSERT INTO kfn.inbox_backfill DEFAULT VALUES ON CONFLICT DO NOTHING;

-- Every partition that has a cursor gets its lane, in name order.
INSERT INTO kfn.lanes (consumer, topic, partition)
SELECT consumer, topic, partition FROM kfn.cursors ORDER BY 1, 2, 3
ON CONFLICT DO NOTHING;

-- kfn:online-prepare ends

-- From here on no one writes the old table: a worker built for schema 11
-- waits here, and its write fails once the table is gone.
LOCK TABLE kfn.inbox IN ACCESS EXCLUSIVE MODE;

-- Unless the online copy finished (and its trigger has mirrored every
-- write since), every old row moves here, so dedup is kept: a row at or
-- above its cursor's high-water mark (written back by a bounded
-- re-execution) still blocks that offset, and replays, retention, kfn
-- verify and kfn status read the same rows as before. What an unfinished
-- copy left is dropped first. Each partition with an inbox row gets its
-- lane (the old primary key leads with (consumer, topic, partition): the
-- DISTINCT walks it), and the old table is read in its primary key's
-- order. When the copy finished, these statements read nothing: their
-- condition is checked once, before any row.
DELETE FROM kfn.inbox_compact WHERE NOT (SELECT done FROM kfn.inbox_backfill);
INSERT INTO kfn.lanes (consumer, topic, partition)
SELECT DISTINCT consumer, topic, partition FROM kfn.inbox
 WHERE NOT (SELECT done FROM kfn.inbox_backfill)
 ORDER BY 1, 2, 3
ON CONFLICT DO NOTHING;
INSERT INTO kfn.inbox_compact ("offset", epoch, processed_at, lane, outcome)
SELECT i."offset", i.epoch, i.processed_at, l.id, i.outcome::kfn.outcome
  FROM kfn.inbox i
  JOIN kfn.lanes l ON l.consumer = i.consumer AND l.topic = i.topic AND l.partition = i.partition
 WHERE NOT (SELECT done FROM kfn.inbox_backfill)
 ORDER BY i.consumer, i.topic, i.partition, i."offset";

-- The old table's grants carry over to the new one, and to the lanes: a
-- role that may read the inbox may read the lanes (the inbox's row-level
-- security reads them, as the caller), and one that may write it may add
-- a lane.
DO $$
DECLARE
    g record;
    who text;
BEGIN
    FOR g IN SELECT a.grantee, a.privilege_type
               FROM pg_class c, aclexplode(c.relacl) a
              WHERE c.oid = 'kfn.inbox'::regclass AND a.grantee <> c.relowner
    LOOP
        who := CASE g.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.grantee)) END;
        EXECUTE format('GRANT %s ON kfn.inbox_compact TO %s', g.privilege_type, who);
        EXECUTE format('GRANT SELECT ON kfn.lanes TO %s', who);
        IF g.privilege_type = 'INSERT' THEN
            EXECUTE format('GRANT INSERT ON kfn.lanes TO %s', who);
        END IF;
    END LOOP;
END;
$$;

-- The online copy's trigger goes with the old table, and its function and
-- progress after it.
DROP TABLE kfn.inbox;
DROP FUNCTION IF EXISTS kfn.inbox_mirror();
DROP TABLE kfn.inbox_backfill;
ALTER TABLE kfn.inbox_compact RENAME TO inbox;
ALTER TABLE kfn.inbox RENAME CONSTRAINT inbox_compact_pkey TO inbox_pkey;
ALTER TABLE kfn.inbox RESET (autovacuum_enabled);

-- Row-level security (0011): a lane is a function's row like any other,
-- and an inbox row belongs to its lane's function. The inbox's policy
-- reads the role's bindings and its lanes by uncorrelated subqueries, once
-- per statement each: a role bound to every function ('*') passes on the
-- first; any other sees, and may write, the rows of the lanes the lanes'
-- own policy lets it see.
CREATE POLICY function_rows ON kfn.lanes USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.inbox USING (
    (SELECT coalesce(bool_or(f.consumer = '*'), false) FROM kfn.function_roles f WHERE f.role_name = current_user)
    OR lane = ANY (ARRAY(SELECT l.id FROM kfn.lanes l)));
ALTER TABLE kfn.lanes ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.inbox ENABLE ROW LEVEL SECURITY;
