-- kfn:additive
-- (A new table, and a trigger on kfn.cursors that writes only that table:
-- workers built before it run every partition as one lane, which is
-- KeyConcurrency 1, and never touch it.)

-- Key-lanes of a partition. A function with KeyConcurrency K > 1 splits
-- each partition's records by key hash over K key-lanes, which commit in
-- transactions of their own, side by side. A key-lane's transaction fences
-- itself on its own row here (UPDATE … WHERE epoch = token), not on the
-- partition's cursor row, so the key-lanes of a partition never wait for
-- each other; the cursor moves in small fenced transactions of its own,
-- over the offsets every key-lane has committed.
--
-- epoch follows the cursor's. Whenever a partition's epoch is written (a
-- worker's claim, a replay, a change of a subject's lane count), the
-- trigger below writes it into the partition's key-lane rows, in the same
-- transaction. That UPDATE waits for every key-lane transaction in flight,
-- each of which holds its row's lock: a key-lane's transaction commits
-- before the claim, or is fenced after it.
--
-- next_offset is the offset after the last record the key-lane committed,
-- and lanes the key-lane count of the owner that wrote the row: progress,
-- for kfn status.
CREATE TABLE kfn.key_lanes (
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    lane        integer     NOT NULL CHECK (lane >= 0),
    lanes       integer     NOT NULL CHECK (lanes > lane),
    epoch       bigint      NOT NULL,
    next_offset bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition, lane)
);

-- It runs as the owner of kfn's tables (SECURITY DEFINER), so that a role
-- granted its rights before this table existed (by an older kfn migrate
-- grants) can still claim: it only writes the key-lane rows of the cursor
-- row the role just wrote, which row-level security let it write.
CREATE FUNCTION kfn.fence_key_lanes() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE kfn.key_lanes SET epoch = NEW.epoch
     WHERE consumer = NEW.consumer AND topic = NEW.topic AND partition = NEW.partition AND epoch < NEW.epoch;
    RETURN NULL;
END;
$$;
CREATE TRIGGER fence_key_lanes AFTER UPDATE OF epoch ON kfn.cursors
    FOR EACH ROW WHEN (NEW.epoch > OLD.epoch) EXECUTE FUNCTION kfn.fence_key_lanes();

CREATE POLICY function_rows ON kfn.key_lanes USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
ALTER TABLE kfn.key_lanes ENABLE ROW LEVEL SECURITY;

-- Rolling upgrade: every role that may write kfn.cursors now (a worker's,
-- the operator's) may write the key-lane rows its epoch writes fence.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN SELECT r.rolname FROM pg_roles r
                    WHERE r.rolname <> current_user AND r.rolname NOT LIKE 'pg\_%'
                      AND has_table_privilege(r.oid, 'kfn.cursors', 'UPDATE')
    LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON kfn.key_lanes TO %I', grantee);
    END LOOP;
END;
$$;
