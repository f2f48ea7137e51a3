-- kfn:breaks-before 7
-- (An older worker would apply the later records of a parked key, out of
-- order for a function with KeyOrder ParkKey.)

-- Park by key (Function.KeyOrder = ParkKey): when a record of a function
-- that keeps per-key order is dead-lettered, its key is blocked on its
-- partition until the dead letter is retried successfully or discarded.
-- Every later record of that key on that partition is dead-lettered with
-- reason key_parked instead of reaching the handler; when the key is
-- released, those letters are marked for retry and the partition's lane
-- applies them in offset order.
--
-- One row per blocked key of a partition, written in the transaction that
-- dead-letters the blocking record, deleted in the transaction that retries
-- it successfully or discards (or purges) it.
CREATE TABLE kfn.parked_keys (
    consumer        text        NOT NULL,
    topic           text        NOT NULL,
    partition       integer     NOT NULL,
    record_key      bytea       NOT NULL,
    -- The offset of the dead-lettered record that blocks the key: the
    -- earliest record of the key on the partition that is not applied.
    blocking_offset bigint      NOT NULL,
    parked_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition, record_key)
);

-- A record has one key, so one offset blocks at most one key. Releasing a
-- key finds its row by the dead letter that blocks it.
CREATE UNIQUE INDEX parked_keys_blocker ON kfn.parked_keys (consumer, topic, partition, blocking_offset);

-- Releasing a key marks the key_parked letters of that key for retry.
CREATE INDEX dead_letters_key_parked ON kfn.dead_letters (consumer, topic, partition, record_key, "offset")
    WHERE reason = 'key_parked';
