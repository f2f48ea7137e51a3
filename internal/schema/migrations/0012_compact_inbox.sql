-- kfn:breaks-before 12
-- (kfn.inbox loses its consumer, topic and partition columns: a worker built
-- for an older schema writes them, so it stops here. Stop the old workers,
-- run kfn migrate, start the new ones: docs/production/upgrades.md.)

-- A compact inbox key. Each inbox row and its primary key repeated the
-- function's name and the topic as text; a row is now keyed by a lane id,
-- an integer standing for one (consumer, topic, partition) — or, for a
-- NATS-triggered function, (consumer, subject, lane), the cursor's own key
-- — plus the offset. For the bench's names that is about 60% less space
-- per row and index entry (docs/benchmarks.md, "The inbox key").
--
-- Lanes are never deleted or renumbered, so an inbox row keeps meaning the
-- same partition. A worker adds its partition's lane when it claims it
-- (inbox.ClaimPartition); the ids need no privilege on a sequence (an
-- identity column's).
CREATE TABLE kfn.lanes (
    id        integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer  text    NOT NULL,
    topic     text    NOT NULL,
    partition integer NOT NULL,
    UNIQUE (consumer, topic, partition)
);

-- How a handled record ended, in 4 bytes rather than a text of 8 or 14.
CREATE TYPE kfn.outcome AS ENUM ('applied', 'dead_lettered');

-- The columns in this order leave no alignment padding: 32 bytes of data
-- after the 24-byte row header, and a 24-byte index entry.
CREATE TABLE kfn.inbox_compact (
    "offset"     bigint      NOT NULL,
    epoch        bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    lane         integer     NOT NULL,
    outcome      kfn.outcome NOT NULL DEFAULT 'applied',
    CONSTRAINT inbox_compact_pkey PRIMARY KEY (lane, "offset")
);

-- Every partition that has a cursor or an inbox row gets its lane, in name
-- order. The old primary key leads with (consumer, topic, partition): the
-- DISTINCT walks it.
INSERT INTO kfn.lanes (consumer, topic, partition)
SELECT consumer, topic, partition FROM kfn.cursors
 UNION
SELECT DISTINCT consumer, topic, partition FROM kfn.inbox
 ORDER BY 1, 2, 3;

-- Every old row moves, so dedup is kept: a row at or above its cursor's
-- high-water mark (written back by a bounded re-execution) still blocks
-- that offset, and replays, retention, kfn verify and kfn status read the
-- same rows as before. The old table is read in its primary key's order,
-- which is the new one's (lanes are numbered in name order).
INSERT INTO kfn.inbox_compact ("offset", epoch, processed_at, lane, outcome)
SELECT i."offset", i.epoch, i.processed_at, l.id, i.outcome::kfn.outcome
  FROM kfn.inbox i
  JOIN kfn.lanes l ON l.consumer = i.consumer AND l.topic = i.topic AND l.partition = i.partition
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

DROP TABLE kfn.inbox;
ALTER TABLE kfn.inbox_compact RENAME TO inbox;
ALTER TABLE kfn.inbox RENAME CONSTRAINT inbox_compact_pkey TO inbox_pkey;

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
