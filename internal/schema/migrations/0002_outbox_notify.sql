-- kfn:additive
-- (A trigger: older workers write the outbox as before.)

-- Wake the outbox relay as soon as outbox rows commit, instead of waiting for
-- its next poll. One notification per INSERT/COPY statement (not per row);
-- the payload lists the relay shards the statement wrote to, comma separated,
-- so the relay wakes only those shard loops. Postgres delivers the
-- notification at COMMIT and drops it on ROLLBACK, so a wake-up always
-- follows committed rows. Notifications are a latency optimisation only: the
-- relay still polls, so a lost notification delays rows but never loses them.
CREATE FUNCTION kfn.notify_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shards text;
BEGIN
    SELECT string_agg(DISTINCT shard::text, ',') INTO shards FROM new_rows;
    IF shards IS NOT NULL THEN -- an INSERT of zero rows wakes nobody
        PERFORM pg_notify('kfn_outbox', shards);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON kfn.outbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kfn.notify_outbox();
